"""Eviction policies, shared by the daemon's slot stores (L2) and the client's pools (L0).

A policy sees every access and every insertion of its layer and, when asked, picks a victim among the
candidates the store allows (resident, not pinned, not loading).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[int, int] = {}

    def access(self, expert: int, count: int = 1) -> None:
        self._clock += 1
        self._last[expert] = self._clock

    def insert(self, expert: int) -> None:
        self.access(expert)

    def evict(self, expert: int) -> None:
        self._last.pop(expert, None)

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: self._last.get(e, 0))


class LFUDecay:
    """Frequency with exponential decay (half-life in accesses), so that yesterday's hot experts fade."""

    name = "lfu"

    def __init__(self, half_life: float = 2048.0) -> None:
        self._clock = 0
        self._rate = math.log(2) / half_life
        # expert -> (score at time t, t); the score of every expert decays at the same rate, so comparing
        # log-scores shifted by the clock needs no periodic rescan.
        self._score: dict[int, float] = {}

    def _log_score(self, expert: int) -> float:
        return self._score.get(expert, -math.inf)

    def access(self, expert: int, count: int = 1) -> None:
        self._clock += 1
        # score(t) = sum over accesses of exp(-rate (t - t_i)); stored as log(score) + rate * t
        shifted = math.log(count) + self._rate * self._clock
        old = self._log_score(expert)
        high, low = max(old, shifted), min(old, shifted)
        self._score[expert] = high + math.log1p(math.exp(low - high)) if low > -math.inf else high

    def insert(self, expert: int) -> None:
        if expert not in self._score:
            self.access(expert)

    def evict(self, expert: int) -> None:
        # Frequencies survive eviction: an expert that comes back is judged on its whole history.
        pass

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=self._log_score)


POLICIES = {"lru": LRU, "lfu": LFUDecay}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}") from None
