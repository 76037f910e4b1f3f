"""The loader pool: threads that run the daemon's slot work off the serving thread, reads of records into slots
and the checks of donated ones (ServedModel.fill, ServedModel.take_donation), so that no request waits for a
disk or a checksum."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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

    def submit(self, work: Callable[[], object], cancel: Callable[[], object]) -> None:
        """Run `work` (one slot's, begun: it ends the fill) on a loader thread, or `cancel` (which ends it
        unfilled) at once once the pool is stopping."""
        with self._lock:
            if self._stopping:
                cancel()
                return
            self._in_flight += 1
        self._pool.submit(self._run, work)

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception:  # the work handles its own failures: only a bug gets here
            log.exception("slot work failed")
        finally:
            with self._lock:
                self._in_flight -= 1

    def shutdown(self) -> None:
        """Finish the work in progress (it writes into segments about to be unmapped), drop the queue."""
        with self._lock:
            self._stopping = True
        self._pool.shutdown(wait=True, cancel_futures=True)
