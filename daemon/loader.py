"""The loader pool: threads that read expert records from the model files straight into slot memory, and
check each against the model's checksum manifest before it is published (docs/architecture.md, "Integrity").

Two queues: a client's loads (its misses, prefetches, pins and hints, each with its slot reserved) and below
them the warm start's preloads (Preload), taken only when no client's load waits, one record at a time, each
given a free slot only when a thread takes it (docs/architecture.md, "Warm after a restart")."""

from __future__ import annotations

import collections
import logging
import threading
import time

from moe_l2.model import CorruptRecord

log = logging.getLogger("moe-l2d.loader")


class Preload:
    """Records of one model to load when nothing else waits, in order (the hottest first); `loaded` counts those
    that a preload itself put in L2 (not those a client's load got there first, nor those that found no free
    slot)."""

    def __init__(self, model, records: list[tuple[int, int]]):
        self.model = model
        self.records = records  # (layer, expert)
        self.taken = 0
        self.loaded = 0

    def pending(self) -> list[tuple[int, int]]:
        """The records no thread has taken yet (read without the loader's lock: a snapshot)."""
        taken = self.taken
        return self.records[taken:]


class Loader:
    def __init__(self, threads: int = 4):
        self._lock = threading.Condition()
        self._urgent: collections.deque = collections.deque()  # (model, layer, reservation)
        self._preloads: collections.deque[Preload] = collections.deque()
        self._in_flight = 0
        # Preloads read on at most half the threads, so that a client's miss that comes meanwhile finds one free.
        self._preload_limit = max(1, threads // 2)
        self._preloading = 0
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"moe-l2-load-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, model, layer: int, reservation) -> None:
        """Queue a load; the store already de-duplicated it (an expert has at most one reservation)."""
        with self._lock:
            if not self._stopping:
                self._in_flight += 1
                self._urgent.append((model, layer, reservation))
                self._lock.notify()
                return
        model.abort_fill(layer, reservation)

    def preload(self, preload: Preload) -> None:
        """Queue a warm start's records behind every client's load, now and to come."""
        with self._lock:
            if not self._stopping and preload.pending():
                self._preloads.append(preload)
                self._lock.notify_all()

    def _next(self) -> tuple | None:
        """The next item to work on, a client's load first: ('load', model, layer, reservation) or
        ('preload', preload, layer, expert); None once stopping. Called with the lock held."""
        while not self._stopping:
            if self._urgent:
                return ("load", *self._urgent.popleft())
            while self._preloads and self._preloading < self._preload_limit:
                preload = self._preloads[0]
                if preload.taken == len(preload.records):
                    self._preloads.popleft()
                    continue
                layer, expert = preload.records[preload.taken]
                preload.taken += 1
                self._preloading += 1
                return ("preload", preload, layer, expert)
            self._lock.wait()
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                item = self._next()
            if item is None:
                return
            kind, target, layer, what = item
            if kind == "load":
                self._load(target, layer, what)
                with self._lock:
                    self._in_flight -= 1
            else:
                self._preload_one(target, layer, what)

    def _preload_one(self, preload: Preload, layer: int, expert: int) -> None:
        """Load a preload's record into a free slot, unless it is held already or no slot is free (clients' loads
        since the start took them: theirs are the fresher choices)."""
        reservation = preload.model.reserve_free(layer, expert)
        loaded = False
        if reservation is not None:
            with self._lock:
                self._in_flight += 1
            loaded = self._load(preload.model, layer, reservation)
        with self._lock:
            self._preloading -= 1
            if reservation is not None:
                self._in_flight -= 1
            if loaded:
                preload.loaded += 1
            self._lock.notify()

    def _load(self, model, layer: int, reservation) -> bool:
        """Read, check and publish one reserved record; True when it is in L2."""
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
            return True
        except CorruptRecord as exc:
            if model.counters.add_corrupt(layer, reservation.expert):
                log.error("%s", exc)  # once per record: every miss on it tries (and refuses) it again
            model.abort_fill(layer, reservation)
        except Exception as exc:  # a bad read must cost one load, never the daemon
            log.error("loading layer %d expert %d of %s failed: %s", layer, reservation.expert,
                      model.files.path, exc)
            model.abort_fill(layer, reservation)
            model.counters.add_load_error()
        return False

    def shutdown(self) -> None:
        """Finish the reads in progress (they write into segments about to be unmapped), drop the queues."""
        with self._lock:
            self._stopping = True
            self._urgent.clear()
            self._preloads.clear()
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
