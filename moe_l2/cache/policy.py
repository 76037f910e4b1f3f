"""Eviction policies, shared by the daemon's slot stores (L2) and the client's pools (L0).

A policy sees every access and every insertion of its layer and, when asked, picks a victim among the
candidates the store allows (resident, not pinned, not loading).

- ``lru``: least recently used.
- ``lfu``: frequency with exponential decay (half-life 2048 accesses).
- ``adaptive`` (the default): LRFU, decayed frequency, whose half-life is chosen online. Six shadow caches
  of the same capacity, each ranking experts with its own half-life (1 access: exactly LRU; 16, 64, 256,
  1024; 4096 accesses: almost LFU), watch the same accesses; the live cache evicts by the ranking of the
  shadow that has hit most over the latest ~4096 accesses. A profile's expert frequencies can seed the
  scores (``set_prior``), as if the layer had already seen that much traffic. See docs/policy-report.md.
- ``BeladyMIN`` is the offline optimum (it needs the future); `moe-l2 replay` uses it as the ceiling.

Optional hooks a store calls when a policy has them: ``set_capacity(n_slots)``, ``set_prior(weights)``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence


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


class AdaptiveLRFU:
    """Decayed frequency (LRFU) with the half-life picked online by shadow caches.

    score_h(e) = sum over e's accesses of 2^(-age / h), age counted in this layer's accesses. h = 1 ranks
    exactly like LRU (the latest access outweighs all earlier ones together), a large h like LFU; which is better depends on the model, the layer, the capacity and
    the workload (decode streams repeat experts token after token, prefill passes and mixed tenants less),
    so each half-life in HALF_LIVES runs a shadow cache of the live capacity over the same accesses, and
    the live cache evicts by the ranking of the shadow with the most hits, counted with a decay of WINDOW
    accesses. Scores survive eviction. Costs O(len(HALF_LIVES)) per access and O(capacity) per shadow miss.
    """

    name = "adaptive"
    HALF_LIVES = (1.0, 16.0, 64.0, 256.0, 1024.0, 4096.0)
    WINDOW = 4096.0
    _RESCALE = 1e100

    def __init__(self, capacity: int | None = None, half_lives: Sequence[float] = HALF_LIVES,
                 window: float = WINDOW) -> None:
        if not half_lives or any(h <= 0 for h in half_lives):
            raise ValueError("half-lives must be positive")
        self.half_lives = tuple(float(h) for h in half_lives)
        self._growth = [2.0 ** (1.0 / h) for h in self.half_lives]
        self._inc = [1.0] * len(self.half_lives)
        self._scores: list[dict[int, float]] = [{} for _ in self.half_lives]
        self._shadows: list[set[int]] = [set() for _ in self.half_lives]
        self._hits = [0.0] * len(self.half_lives)
        self._hit_growth = 2.0 ** (1.0 / window)
        self._hit_inc = 1.0
        self.best = len(self.half_lives) // 2
        self._capacity = capacity
        self._resident: set[int] = set()  # to learn the capacity when nobody tells it (client pools)
        self._seen_capacity = 0

    def set_capacity(self, n_slots: int) -> None:
        self._capacity = n_slots

    @property
    def capacity(self) -> int:
        return self._capacity if self._capacity is not None else max(1, self._seen_capacity)

    @property
    def half_life(self) -> float:
        """The half-life the live cache follows now."""
        return self.half_lives[self.best]

    def set_prior(self, weights: Mapping[int, float] | Sequence[float] | None, strength: float = 1.0) -> None:
        """Add a frequency prior: weights[e] is the share of this layer's accesses that go to e (they are
        normalised). With strength 1 every score becomes what a history of that distribution would have
        given; existing scores are kept and the prior is added to them."""
        if weights is None:
            return
        items = weights.items() if isinstance(weights, Mapping) else enumerate(weights)
        items = [(int(e), float(w)) for e, w in items if w > 0]
        total = sum(w for _, w in items)
        if total <= 0 or strength <= 0:
            return
        for i, growth in enumerate(self._growth):
            mass = strength * self._inc[i] / (1.0 - 1.0 / growth)
            scores = self._scores[i]
            for e, w in items:
                scores[e] = scores.get(e, 0.0) + mass * w / total

    def access(self, expert: int, count: int = 1) -> None:
        capacity = self.capacity
        self._hit_inc *= self._hit_growth
        hits = self._hits
        for i, shadow in enumerate(self._shadows):
            inc = self._inc[i] = self._inc[i] * self._growth[i]
            scores = self._scores[i]
            scores[expert] = scores.get(expert, 0.0) + inc * count
            if expert in shadow:
                hits[i] += self._hit_inc
            else:
                if len(shadow) >= capacity:
                    shadow.discard(min(shadow, key=scores.__getitem__))
                shadow.add(expert)
            if inc > self._RESCALE:
                for e in scores:
                    scores[e] /= inc
                self._inc[i] = 1.0
        if self._hit_inc > self._RESCALE:
            self._hits = hits = [h / self._hit_inc for h in hits]
            self._hit_inc = 1.0
        top = max(hits)
        if hits[self.best] < top:
            self.best = hits.index(top)

    def insert(self, expert: int) -> None:
        self._resident.add(expert)
        if len(self._resident) > self._seen_capacity:
            self._seen_capacity = len(self._resident)
        scores = self._scores[self.best]
        if expert not in scores:
            self.access(expert)

    def evict(self, expert: int) -> None:
        self._resident.discard(expert)

    def victim(self, candidates: Iterable[int]) -> int:
        scores = self._scores[self.best]
        return min(candidates, key=lambda e: scores.get(e, 0.0))


class BeladyMIN:
    """The offline optimum: evict the expert whose next use lies farthest in the future (never used again
    first). It needs the whole future of the layer, so only `moe-l2 replay` uses it; call `at(t)` before
    the accesses of token t."""

    name = "min"

    def __init__(self, batches: Sequence[Iterable[int]]) -> None:
        self._uses: dict[int, list[int]] = {}
        for t, batch in enumerate(batches):
            for e in batch:
                self._uses.setdefault(e, []).append(t)
        self.now = -1

    def at(self, t: int) -> None:
        self.now = t

    def next_use(self, expert: int) -> int | float:
        uses = self._uses.get(expert)
        if not uses:
            return math.inf
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else math.inf

    def load_order(self, misses: list[int]) -> list[int]:
        """Load a token's misses farthest next use first: a later load of the same token may then evict an
        earlier one, which is how the optimum skips caching an expert not needed again soon."""
        return sorted(misses, key=lambda e: (-self.next_use(e), e))

    def access(self, expert: int, count: int = 1) -> None:
        pass

    def insert(self, expert: int) -> None:
        pass

    def evict(self, expert: int) -> None:
        pass

    def victim(self, candidates: Iterable[int]) -> int:
        # Ties (several never used again) go to the lowest id, so results do not depend on set order.
        return max(sorted(candidates), key=self.next_use)


POLICIES = {"adaptive": AdaptiveLRFU, "lru": LRU, "lfu": LFUDecay}
DEFAULT_POLICY = "adaptive"


def make_policy(name: str, capacity: int | None = None):
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    policy = cls()
    if capacity is not None and hasattr(policy, "set_capacity"):
        policy.set_capacity(capacity)
    return policy
