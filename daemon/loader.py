"""The loader pool: threads that read expert records from the model files straight into slot memory, and
check each against the model's checksum manifest before it is published (docs/architecture.md, "Integrity")."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from moe_l2.model import CorruptRecord

log = logging.getLogger("moe-l2d.loader")


class Loader:
    def __init__(self, threads: int = 4):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moe-l2-load")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stopping = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, model, layer: int, reservation) -> None:
        """Queue a load; the store already de-duplicated it (an expert has at most one reservation)."""
        with self._lock:
            if self._stopping:
                model.abort_fill(layer, reservation)
                return
            self._in_flight += 1
        self._pool.submit(self._load, model, layer, reservation)

    def _load(self, model, layer: int, reservation) -> None:
        start = time.perf_counter()
        try:
            data = model.data[layer]
            stride = model.geometry.slot_stride
            base = reservation.slot * stride
            # Straight into the slot: a packed record in one read (direct I/O where the fds have it), a GGUF
            # record converted to MLX's layout on the way, so that L2 holds what clients copy as is.
            model.files.read_into_slots(model.fds, layer, [(reservation.expert, data, base, stride)], threads=1)
            # The checksum is only compared with a manifest; without one it is not computed (a CRC-32 of a
            # 13 MB record costs milliseconds of a core), and the slot's metadata holds 0.
            checksum = 0
            if model.files.checksums is not None:
                view = data.view()
                checksum = model.files.layout.checksum(view, base)
                del view
            # A record that fails the manifest is never published: the slot stays free (expert -1).
            model.files.check_record(layer, reservation.expert, checksum, "the model file")
            model.finish_fill(layer, reservation, checksum)
            model.counters.add_load(time.perf_counter() - start, model.files.layout.nbytes)
        except CorruptRecord as exc:
            if model.counters.add_corrupt(layer, reservation.expert):
                log.error("%s", exc)  # once per record: every miss on it tries (and refuses) it again
            model.abort_fill(layer, reservation)
        except Exception as exc:  # a bad read must cost one load, never the daemon
            log.error("loading layer %d expert %d of %s failed: %s", layer, reservation.expert,
                      model.files.path, exc)
            model.abort_fill(layer, reservation)
            model.counters.add_load_error()
        finally:
            with self._lock:
                self._in_flight -= 1

    def shutdown(self) -> None:
        """Finish the reads in progress (they write into segments about to be unmapped), drop the queue."""
        with self._lock:
            self._stopping = True
        self._pool.shutdown(wait=True, cancel_futures=True)
