"""Waits for records on their way into L2.

A lookup whose miss L2 lacks may find its record coming into a slot: another process is reading it and gives it
(client/donor.py), or the daemon loads it (for a report of this process, load-through, or of another). Instead of
reading it again, the lookup sleeps on the record's slot_of entry in the daemon's index (SlotIndex.wait: a futex
on Linux, os_sync_wait_on_address or __ulock_wait on macOS), which the daemon's publish or abort wakes, with no
message in between; then it takes the record through the seqlock as any lookup does. The wait is only a wake-up: a
daemon that never wakes it, or one killed mid-fill, costs the lookup its timeout, after which it reads the file
(docs/architecture.md, "Fills").
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace


@dataclass
class WaitCounts:
    waits: int = 0       # waits that had a record to wait for
    woken: int = 0       # of them, those that ended before their deadline (every record published, or given up)
    expired: int = 0     # those that reached it
    waited_s: float = 0.0  # the time they took

    def minus(self, other: "WaitCounts") -> "WaitCounts":
        """The counts since `other` was taken."""
        return WaitCounts(**{name: getattr(self, name) - getattr(other, name) for name in self.__dataclass_fields__})


class SlotWaits:
    """One pool's waits on the slot indexes of the daemon epoch attached, and their counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = WaitCounts()

    def counts(self) -> WaitCounts:
        with self._lock:
            return replace(self._counts)

    def wait(self, index, experts: list[int], timeout_s: float, absent: bool = False) -> list[bool]:
        """SlotIndex.wait on a layer's index, counted: which experts were coming (with `absent`, also awaited)."""
        if not experts:
            return []
        start = time.perf_counter()
        waited = index.wait(experts, timeout_s, absent)
        if any(waited):
            took = time.perf_counter() - start
            expired = took >= timeout_s
            with self._lock:
                self._counts.waits += 1
                self._counts.expired += expired
                self._counts.woken += not expired
                self._counts.waited_s += took
        return waited
