"""Eviction policies, shared by the daemon's slot stores (L2) and the client's pools (L0).

A policy sees every access and every insertion of its layer and, when asked, picks a victim among the
candidates the store allows (resident, not pinned, not loading).

- ``lru``: least recently used.
- ``lfu``: frequency with exponential decay (half-life 2048 accesses).
- ``adaptive``: LRFU, decayed frequency, whose half-life is chosen online. Six shadow caches
  of the same capacity, each ranking experts with its own half-life (1 access: exactly LRU; 16, 64, 256,
  1024; 4096 accesses: almost LFU), watch the same accesses; the live cache evicts by the ranking of the
  shadow that has hit most over the latest ~4096 accesses. A profile's expert frequencies can seed the
  scores (``set_prior``), as if the layer had already seen that much traffic. See docs/policy-report.md.
- ``learned`` (the default): evicts the expert an online model of the layer's routing finds least likely to be
  picked within the cache's lifetime (src/moe_l2/cache/learned.py), LRU's ranking while LRU would do better.
  It reads fewer records than ``adaptive`` at every point measured (docs/policy-report.md, "The learned
  policy").
- ``BeladyMIN`` is the offline optimum (it needs the future); `moe-l2 replay` uses it as the ceiling.

Optional hooks a store calls when a policy has them: ``set_capacity(n_slots)``, ``set_prior(weights)``,
``observe(experts, source)`` (one batch of accesses at once: a token's, a report's, a forward's; without it the
store calls ``access`` for each expert), ``admits(expert, victim)`` (whether a give, which its reader computes on
anyway, may evict the victim; without it every give may).

The live policies' state survives a daemon's restart: ``state()`` gives it as plain data, `restored_policy` makes a
policy from such data read back from a file, checking every value (the file may be damaged or planted), and
``hottest(experts)`` ranks experts as the policy would keep them (docs/architecture.md, "Warm after a restart").
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from moe_l2.cache.learned import LearnedReuse
from moe_l2.protocol import quote

# A clock or count read back from a saved state past this is no state this code wrote.
_MAX_COUNT = 1 << 62


def _count(value, what: str, high: int = _MAX_COUNT) -> int:
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"{what} is {quote(value)}, not a whole number from 0 to {high}")
    return value


def _finite(value, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{what} is {quote(value)}, not a finite number from {low} to {high}")
    return float(value)


def _expert(value, n_experts: int, what: str) -> int:
    if type(value) is not int or not 0 <= value < n_experts:
        raise ValueError(f"{what} names expert {quote(value)}, not one of 0..{n_experts - 1}")
    return value


def _by_expert(pairs, n_experts: int, what: str, check: Callable) -> dict[int, object]:
    """{expert: value} of [[expert, value], ...], each expert once and in range, each value check(value, what)."""
    if not isinstance(pairs, list) or len(pairs) > n_experts:
        raise ValueError(f"{what} is not a list of at most {n_experts} [expert, value] pairs")
    out = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{what} holds {quote(pair)}, not an [expert, value] pair")
        expert = _expert(pair[0], n_experts, what)
        if expert in out:
            raise ValueError(f"{what} names expert {expert} twice")
        out[expert] = check(pair[1], what)
    return out


def _fields(state, names: tuple[str, ...], policy: str) -> list:
    if not isinstance(state, dict) or set(state) != set(names):
        raise ValueError(f"the {policy} state is {quote(state)}, not a map of the fields {', '.join(names)}")
    return [state[name] for name in names]


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

    def hottest(self, experts: Iterable[int]) -> list[int]:
        return sorted(experts, key=lambda e: (-self._last.get(e, 0), e))

    def state(self) -> dict:
        return {"clock": self._clock, "last": [[e, t] for e, t in sorted(self._last.items())]}

    def restore(self, state, n_experts: int) -> None:
        clock, last = _fields(state, ("clock", "last"), self.name)
        self._clock = _count(clock, "lru clock")
        self._last = _by_expert(last, n_experts, "lru last use", lambda t, what: _count(t, what, self._clock))


class LFUDecay:
    """Frequency with exponential decay (half-life in accesses), so that yesterday's hot experts fade."""

    name = "lfu"

    def __init__(self, half_life: float = 2048.0) -> None:
        self._clock = 0
        self.half_life = half_life
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

    def hottest(self, experts: Iterable[int]) -> list[int]:
        return sorted(experts, key=lambda e: (-self._log_score(e), e))

    def state(self) -> dict:
        return {"clock": self._clock, "half_life": self.half_life,
                "score": [[e, s] for e, s in sorted(self._score.items())]}

    def restore(self, state, n_experts: int) -> None:
        clock, half_life, score = _fields(state, ("clock", "half_life", "score"), self.name)
        if half_life != self.half_life:
            raise ValueError(f"the lfu state decays with a half-life of {quote(half_life)}, not {self.half_life}")
        self._clock = _count(clock, "lfu clock")
        self._score = _by_expert(score, n_experts, "lfu score", _finite)


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
    # What a restored state's increments, scores and hits may be at most: an increment is rescaled past _RESCALE
    # (after at most one growth, of at most 2), and a decayed sum of increments stays within a few thousand of them.
    _MAX_INC = 2 * _RESCALE
    _MAX_SUM = 1e6 * _MAX_INC

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

    def hottest(self, experts: Iterable[int]) -> list[int]:
        scores = self._scores[self.best]
        return sorted(experts, key=lambda e: (-scores.get(e, 0.0), e))

    _STATE = ("half_lives", "inc", "scores", "shadows", "hits", "hit_inc", "best")

    def state(self) -> dict:
        return {"half_lives": list(self.half_lives), "inc": list(self._inc),
                "scores": [[[e, v] for e, v in sorted(scores.items())] for scores in self._scores],
                "shadows": [sorted(shadow) for shadow in self._shadows], "hits": list(self._hits),
                "hit_inc": self._hit_inc, "best": self.best}

    def restore(self, state, n_experts: int) -> None:
        half_lives, inc, scores, shadows, hits, hit_inc, best = _fields(state, self._STATE, self.name)
        n = len(self.half_lives)
        if half_lives != list(self.half_lives):
            raise ValueError(f"the adaptive state follows the half-lives {quote(half_lives)}, not "
                             f"{list(self.half_lives)}")
        for name, value in (("inc", inc), ("scores", scores), ("shadows", shadows), ("hits", hits)):
            if not isinstance(value, list) or len(value) != n:
                raise ValueError(f"adaptive {name} is not a list of {n}, one per half-life")
        self._inc = [_finite(v, "adaptive inc", 1.0, self._MAX_INC) for v in inc]

        def bounded(value, what: str) -> float:
            return _finite(value, what, 0.0, self._MAX_SUM)

        self._scores = [_by_expert(s, n_experts, "adaptive score", bounded) for s in scores]
        self._hits = [bounded(v, "adaptive hits") for v in hits]
        self._shadows = []
        for shadow, score in zip(shadows, self._scores):
            if not isinstance(shadow, list) or len(shadow) > n_experts:
                raise ValueError(f"an adaptive shadow is not a list of at most {n_experts} experts")
            kept = {_expert(e, n_experts, "an adaptive shadow") for e in shadow}
            # The capacity may have changed since: a shadow keeps its best-scored experts that fit.
            self._shadows.append(set(sorted(kept, key=lambda e: -score.get(e, 0.0))[:self.capacity]))
        self._hit_inc = _finite(hit_inc, "adaptive hit_inc", 1.0, self._MAX_INC)
        self.best = _count(best, "adaptive best", n - 1)


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


POLICIES = {"adaptive": AdaptiveLRFU, "lru": LRU, "lfu": LFUDecay, "learned": LearnedReuse}
DEFAULT_POLICY = "learned"


def restored_policy(name: str, state, n_experts: int, capacity: int | None = None):
    """A `name` policy (of `capacity`) holding `state`, what a policy's state() gave, read back from a file that
    may be damaged or planted: ValueError says what in it is wrong."""
    policy = make_policy(name, capacity, n_experts)
    policy.restore(state, n_experts)
    return policy


def observe(policy, experts: Iterable[int], source=None, context: Iterable[int] | None = None) -> None:
    """Tell a policy of one batch of accesses from `source` (and its latest at the layer before, `context`): at once
    where it takes batches, else one by one."""
    batch = getattr(policy, "observe", None)
    if batch is not None:
        batch(experts, source, context)
        return
    for expert in experts:
        policy.access(expert)


def latest(policy, source=None) -> list[int] | None:
    """The batch `source` last told a policy of, where the policy keeps it (None where it keeps none): the layer
    after's context."""
    kept = getattr(policy, "latest", None)
    return kept(source) if kept is not None else None


def admits(policy, expert: int, victim: int) -> bool:
    """Whether the policy lets a load of `expert` evict `victim` (the victim it named): yes where it has no say."""
    check = getattr(policy, "admits", None)
    return check is None or check(expert, victim)


def make_policy(name: str, capacity: int | None = None, n_experts: int | None = None):
    """A policy for one layer of `n_experts` experts and `capacity` slots (`learned` needs both)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    if cls is LearnedReuse:
        if n_experts is None or capacity is None:
            raise ValueError("the learned policy needs the layer's number of experts and its capacity")
        return cls(n_experts, capacity)
    policy = cls()
    if capacity is not None and hasattr(policy, "set_capacity"):
        policy.set_capacity(capacity)
    return policy
