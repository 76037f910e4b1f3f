"""The loader pool: threads that run the daemon's slot work off the serving thread, so that no request waits for
a disk or a checksum: reads of records into slots, checked against the manifest (ServedModel.fill), and the
checks of records clients gave (ServedModel.take_donation: daemon/fills.py).

Two queues: the work of clients (their misses, prefetches, pins and hints, each with its slot reserved, and their
fills) and below it the warm start's preloads (Preload), taken only when no client's work waits, one record at a
time, each given a free slot only when a thread takes it (docs/architecture.md, "Warm after a restart")."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("moe-l2d.loader")


class Preload:
    """Records of one model to load when nothing else waits, in order (the hottest first); `loaded` counts those
    that a preload itself put in L2 (not those a client's load got there first, nor those that found no free
    slot), `finished` those a thread is done with either way."""

    def __init__(self, model, records: list[tuple[int, int]]):
        self.model = model
        self.records = records  # (layer, expert)
        self.taken = 0
        self.loaded = 0
        self.finished = 0

    def untaken(self) -> list[tuple[int, int]]:
        """The records no thread has taken yet (read without the loader's lock: a snapshot)."""
        taken = self.taken
        return self.records[taken:]

    def unfinished(self) -> int:
        """The records not loaded or passed over yet: queued, or being read (a snapshot)."""
        return len(self.records) - self.finished


@dataclass(frozen=True)
class SlotWork:
    """A client's slot work, its slot reserved: `work` ends the fill, `cancel` ends it unfilled."""

    work: Callable[[], object]
    cancel: Callable[[], object]


@dataclass(frozen=True)
class PreloadRecord:
    """A record of a preload that a thread took."""

    preload: Preload
    layer: int
    expert: int


class Loader:
    def __init__(self, threads: int = 4):
        self._lock = threading.Condition()
        self._urgent: collections.deque[SlotWork] = collections.deque()
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

    def submit(self, work: Callable[[], object], cancel: Callable[[], object]) -> None:
        """Queue a client's slot work (one slot's, begun: `work` ends the fill), or run `cancel` (which ends it
        unfilled) at once once the pool is stopping. The store already de-duplicated it (an expert has at most
        one reservation)."""
        with self._lock:
            if not self._stopping:
                self._in_flight += 1
                self._urgent.append(SlotWork(work, cancel))
                self._lock.notify()
                return
        cancel()

    def preload(self, preload: Preload) -> None:
        """Queue a warm start's records behind every client's load, now and to come."""
        with self._lock:
            if not self._stopping and preload.untaken():
                self._preloads.append(preload)
                self._lock.notify_all()

    def _next(self) -> SlotWork | PreloadRecord | None:
        """The next item to work on, a client's first; None once stopping. Called with the lock held."""
        while not self._stopping:
            if self._urgent:
                return self._urgent.popleft()
            while self._preloads and self._preloading < self._preload_limit:
                preload = self._preloads[0]
                if preload.taken == len(preload.records):
                    self._preloads.popleft()
                    continue
                layer, expert = preload.records[preload.taken]
                preload.taken += 1
                self._preloading += 1
                return PreloadRecord(preload, layer, expert)
            self._lock.wait()
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                item = self._next()
            if item is None:
                return
            if isinstance(item, SlotWork):
                try:
                    item.work()
                except Exception:  # the work handles its own failures: only a bug gets here
                    log.exception("slot work failed")
                with self._lock:
                    self._in_flight -= 1
            else:
                self._preload_one(item.preload, item.layer, item.expert)

    def _preload_one(self, preload: Preload, layer: int, expert: int) -> None:
        """Load a preload's record into a free slot, unless it is held already or no slot is free (clients' loads
        since the start took them: theirs are the fresher choices)."""
        reservation = preload.model.reserve_free(layer, expert)
        loaded = False
        if reservation is not None:
            with self._lock:
                self._in_flight += 1
            loaded = preload.model.fill(layer, reservation)
        with self._lock:
            self._preloading -= 1
            if reservation is not None:
                self._in_flight -= 1
            if loaded:
                preload.loaded += 1
            preload.finished += 1
            self._lock.notify()

    def shutdown(self) -> None:
        """Finish the work in progress (it writes into segments about to be unmapped), drop the queues."""
        with self._lock:
            self._stopping = True
            self._urgent.clear()
            self._preloads.clear()
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
