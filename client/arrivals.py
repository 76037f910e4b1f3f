"""Arrivals: wake-ups for the lookups that wait for the daemon to load their misses (load-through).

The connection thread counts the daemon's Loaded notices per MoE layer (protocol.Loaded); a waiting lookup
notes the layer's count, looks at L2, and sleeps until the count moves or its deadline passes, then looks again.
A notice is only a wake-up: the lookup trusts what L2's seqlock says, never the notice, so a lost notice costs a
wait until the deadline and a false or hostile one one more look (docs/architecture.md, "Load-through").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class WaitCounts:
    notices: int = 0   # Loaded notices taken
    dropped: int = 0   # notices dropped as malformed or not this client's
    woken: int = 0     # waits ended by a notice (or a detach) before the deadline
    expired: int = 0   # waits that reached the deadline


class Arrivals:
    def __init__(self, n_layers: int):
        self._cond = threading.Condition()
        self._generation = [0] * n_layers
        self.counts = WaitCounts()

    def generation(self, layer: int) -> int:
        """The layer's count of notices: what `wait` compares against, taken before looking at L2."""
        return self._generation[layer]

    def loaded(self, layer: int) -> None:
        """A notice for the layer: wake its waiters."""
        with self._cond:
            self.counts.notices += 1
            self._generation[layer] += 1
            self._cond.notify_all()

    def drop(self) -> None:
        with self._cond:
            self.counts.dropped += 1

    def wake_all(self) -> None:
        """Wake every waiter (the client detached or closes: nothing more will land)."""
        with self._cond:
            self._generation = [g + 1 for g in self._generation]
            self._cond.notify_all()

    def wait(self, layer: int, seen: int, timeout_s: float) -> bool:
        """Until the layer's count is no longer `seen` (True) or timeout_s has passed (False)."""
        with self._cond:
            woken = self._cond.wait_for(lambda: self._generation[layer] != seen, max(0.0, timeout_s))
            if woken:
                self.counts.woken += 1
            else:
                self.counts.expired += 1
            return woken
