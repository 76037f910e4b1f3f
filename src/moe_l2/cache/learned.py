"""The ``learned`` eviction policy: evict the expert least likely to be picked again soon, as an online model of
the layer's own routing predicts it (docs/policy-report.md, "The learned policy").

Time counts in batches: what the caller observes at once (`observe`): a token's picks in replay, a report's
lookups of the layer in moe-l2d, a forward's picks of the layer in L0. After each batch the model scores every
expert e of the layer:

    z_e = bias_e + sum over f in the batch of cross[f, e] + own_e . (1 if e is in the batch, log1p of e's
          decayed pick counts with half-lives HALF_LIVES batches)

a logistic regression of "e is picked within the next `horizon` batches". The cross weights carry what
recency and frequency cannot: which experts follow which (in replay, most of what it gains over `adaptive`).
The label of a batch's scores is known `horizon` batches later; the model then takes one RMSprop step on it,
so it keeps following the workload. The horizon is the cache's lifetime in batches: HORIZON_FACTOR times the
capacity over the mean distinct experts per batch, within HORIZON_RANGE.

Several clients (`source`): the batch is each client's latest one, up to MAX_SOURCES seen within SOURCE_TTL
horizons, since what a client picks next follows from its own latest picks, not from another's.

Guard: a shadow LRU cache and a shadow of the model's ranking, of the live capacity, see the same accesses;
where LRU has hit more over the latest ~DUEL_WINDOW accesses (a drifting working set that the model has not
learned), the live cache evicts as LRU does, until the model's shadow is ahead again.

Deterministic (no randomness), and bounded: per layer O(n_experts^2) floats (the cross weights and their
RMSprop state) plus HORIZON_RANGE[1] pending batches; numpy work of O(n_experts x batch) per batch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

import numpy as np

HALF_LIVES = (4.0, 32.0, 256.0)  # batches
LEARNING_RATE = 0.003
RMS_DECAY = 0.99
HORIZON_FACTOR = 1.0
HORIZON_RANGE = (2, 16)
DUEL_WINDOW = 4096.0  # accesses: the half-life of the shadows' hit counts
# Sources (clients) whose latest batch is context: at most MAX_SOURCES, each for SOURCE_TTL horizons.
MAX_SOURCES = 16
SOURCE_TTL = 4
_EPS = 1e-6
_RESCALE = 1e100
# Bounds of a restored state: no run reaches them (a decayed count stays under 1.5 x its half-life, an RMSprop
# step moves a weight by about LEARNING_RATE), and anything past them is no state this code wrote.
_MAX_COUNT = 1 << 62
_MAX_COUNTS = 2 * max(HALF_LIVES)
_MAX_WEIGHT = 1e6
_MAX_SCORE = 1e9
_MAX_DUEL = 1e6 * _RESCALE


class LearnedReuse:
    name = "learned"

    def __init__(self, n_experts: int, capacity: int) -> None:
        if n_experts < 1 or capacity < 1:
            raise ValueError("the learned policy needs the layer's number of experts and its capacity")
        n = self.n_experts = n_experts
        # Per expert, the weights of its own features (picked now, log1p of each decayed count) and its bias.
        self._own = np.zeros((2 + len(HALF_LIVES), n), np.float32)
        self._cross = np.zeros((n, n), np.float32)  # cross[f, e]: f picked now -> e picked soon
        self._own_ms = np.zeros_like(self._own)  # RMSprop's mean squared gradients
        self._cross_ms = np.zeros_like(self._cross)
        self._decay = np.array([2.0 ** (-1.0 / h) for h in HALF_LIVES], np.float32)[:, None]
        self._counts = np.zeros((len(HALF_LIVES), n), np.float32)
        self._ones = np.ones((1, n), np.float32)  # the bias' feature
        # Batches whose label is not known yet, oldest first: (context, features, clock, logits).
        self._pending: deque[tuple[np.ndarray, np.ndarray, int, np.ndarray]] = deque()
        self._clock = 0
        self._recent: OrderedDict[object, tuple[np.ndarray, int]] = OrderedDict()  # source -> latest batch
        self._batch_mean = 0.0
        self._score = [0.0] * n
        self._last = [0] * n  # clock of each expert's latest pick: ties, the LRU ranking
        self._last_picked = np.zeros(n, np.int64)  # the same, for the labels
        self.capacity = capacity
        self._lru_shadow: OrderedDict[int, None] = OrderedDict()
        self._model_shadow: set[int] = set()
        self._duel = [0.0, 0.0]  # decayed hits of the LRU shadow and of the model's
        self._duel_growth = 2.0 ** (1.0 / DUEL_WINDOW)
        self._duel_inc = 1.0
        self.follows_lru = False

    def set_capacity(self, n_slots: int) -> None:
        self.capacity = n_slots

    @property
    def horizon(self) -> int:
        """Batches ahead the model predicts: about how long an expert stays cached."""
        low, high = HORIZON_RANGE
        if self._batch_mean <= 0:
            return low
        return int(min(high, max(low, round(HORIZON_FACTOR * self.capacity / self._batch_mean))))

    def observe(self, experts: Iterable[int], source=None) -> None:
        """One batch of picks of this layer, from `source` (a client; None: the only one); the model learns from
        the batch `horizon` batches back and scores every expert anew."""
        picked = sorted(set(experts))
        if not picked:
            return
        ids = np.array(picked, np.intp)
        self._clock += 1
        clock = self._clock
        self._batch_mean += (len(picked) - self._batch_mean) / min(clock, 256)
        horizon = self.horizon
        context = self._context(source, ids, clock, horizon)
        self._last_picked[ids] = clock
        while self._pending and clock - self._pending[0][2] >= horizon:
            self._learn(*self._pending.popleft())
        now = np.zeros(self.n_experts, np.float32)
        now[ids] = 1.0
        self._counts *= self._decay
        self._counts += now
        now[context] = 1.0
        features = np.concatenate((now[None], np.log1p(self._counts), self._ones))
        logits = (self._own * features).sum(axis=0) + self._cross[context].sum(axis=0)
        self._pending.append((context, features, clock, logits))
        self._score = logits.tolist()
        last = self._last
        for e in picked:
            last[e] = clock
        self._shadows(picked)

    @property
    def nbytes(self) -> int:
        """Memory of its arrays now, pending batches included (at most HORIZON_RANGE[1] of them)."""
        fixed = sum(a.nbytes for a in (self._own, self._cross, self._own_ms, self._cross_ms, self._decay,
                                       self._counts, self._ones, self._last_picked))
        return fixed + sum(sum(a.nbytes for a in (c, f, z)) for c, f, _, z in self._pending)

    def access(self, expert: int, count: int = 1) -> None:
        self.observe((expert,))

    def _context(self, source, ids: np.ndarray, clock: int, horizon: int) -> np.ndarray:
        """The latest batch of every source seen lately, this one's being `ids`."""
        recent = self._recent
        recent[source] = (ids, clock)
        recent.move_to_end(source)
        stale = clock - SOURCE_TTL * horizon
        while len(recent) > MAX_SOURCES or next(iter(recent.values()))[1] < stale:
            recent.popitem(last=False)
        return ids if len(recent) == 1 else np.concatenate([batch for batch, _ in recent.values()])

    def _learn(self, context: np.ndarray, features: np.ndarray, at: int, logits: np.ndarray) -> None:
        """One RMSprop step on a batch `horizon` batches old, from the logits it was scored with: was each expert
        picked since."""
        error = 1.0 / (1.0 + np.exp(-logits)) - (self._last_picked > at)
        grad = features * error
        ms = self._own_ms
        ms *= RMS_DECAY
        ms += (1 - RMS_DECAY) * grad * grad
        self._own -= LEARNING_RATE * grad / (np.sqrt(ms) + _EPS)
        ms = self._cross_ms[context] * RMS_DECAY + (1 - RMS_DECAY) * error * error
        self._cross_ms[context] = ms
        self._cross[context] -= LEARNING_RATE * error / (np.sqrt(ms) + _EPS)

    def _shadows(self, picked: list[int]) -> None:
        """Run the picks through the LRU shadow and the model's, and follow LRU while it has hit more lately."""
        capacity = self.capacity
        self._duel_inc *= self._duel_growth
        lru, model = self._lru_shadow, self._model_shadow
        score, last = self._score, self._last
        hits = [0, 0]
        for e in picked:
            if e in lru:
                hits[0] += 1
                lru.move_to_end(e)
            else:
                if len(lru) >= capacity:
                    lru.popitem(last=False)
                lru[e] = None
            if e in model:
                hits[1] += 1
            else:
                if len(model) >= capacity:
                    model.discard(min(model, key=lambda c: (score[c], last[c], c)))
                model.add(e)
        duel = self._duel
        duel[0] += hits[0] * self._duel_inc
        duel[1] += hits[1] * self._duel_inc
        if self._duel_inc > _RESCALE:
            self._duel = [h / self._duel_inc for h in duel]
            self._duel_inc = 1.0
        self.follows_lru = self._duel[0] > self._duel[1]

    def insert(self, expert: int) -> None:
        pass

    def evict(self, expert: int) -> None:
        pass

    def victim(self, candidates: Iterable[int]) -> int:
        last = self._last
        if self.follows_lru:
            return min(candidates, key=lambda c: (last[c], c))
        score = self._score
        return min(candidates, key=lambda c: (score[c], last[c], c))

    def hottest(self, experts: Iterable[int]) -> list[int]:
        last = self._last
        if self.follows_lru:
            return sorted(experts, key=lambda e: (-last[e], e))
        score = self._score
        return sorted(experts, key=lambda e: (-score[e], -last[e], e))

    _STATE = ("clock", "batch_mean", "counts", "own", "own_ms", "last", "score", "lru_shadow", "model_shadow",
              "duel", "duel_inc")

    def state(self) -> dict:
        """What a restart keeps: the per-expert part (clock, counts, own weights, scores, shadows, the duel), a
        few numbers per expert. The cross weights (n_experts^2) are learned again, in a few hundred batches."""
        return {"clock": self._clock, "batch_mean": self._batch_mean, "counts": self._counts.tolist(),
                "own": self._own.tolist(), "own_ms": self._own_ms.tolist(), "last": list(self._last),
                "score": list(self._score), "lru_shadow": list(self._lru_shadow),
                "model_shadow": sorted(self._model_shadow), "duel": list(self._duel), "duel_inc": self._duel_inc}

    def restore(self, state, n_experts: int) -> None:
        """Take a state() read back from a file that may be damaged or planted: ValueError says what is wrong."""
        if not isinstance(state, dict) or set(state) != set(self._STATE):
            raise ValueError(f"the learned state is not a map of the fields {', '.join(self._STATE)}")
        if n_experts != self.n_experts:
            raise ValueError(f"the learned state is of {n_experts} experts, not {self.n_experts}")
        n, clock = self.n_experts, state["clock"]
        if type(clock) is not int or not 0 <= clock <= _MAX_COUNT:
            raise ValueError(f"the learned clock is not a whole number from 0 to {_MAX_COUNT}")
        last = state["last"]
        if not isinstance(last, list) or len(last) != n or not all(type(t) is int and 0 <= t <= clock for t in last):
            raise ValueError(f"the learned last picks are not {n} whole numbers from 0 to the clock")
        counts = _numbers(state["counts"], self._counts.shape, 0, _MAX_COUNTS, "learned counts")
        own = _numbers(state["own"], self._own.shape, -_MAX_WEIGHT, _MAX_WEIGHT, "learned weights")
        own_ms = _numbers(state["own_ms"], self._own.shape, 0, _MAX_WEIGHT, "learned mean squares")
        score = _numbers(state["score"], (n,), -_MAX_SCORE, _MAX_SCORE, "learned scores")
        batch_mean = _numbers(state["batch_mean"], (), 0, n, "learned batch mean")
        duel = _numbers(state["duel"], (2,), 0, _MAX_DUEL, "learned duel")
        duel_inc = _numbers(state["duel_inc"], (), 1, 2 * _RESCALE, "learned duel increment")
        lru = _experts(state["lru_shadow"], n, "learned LRU shadow")
        model = _experts(state["model_shadow"], n, "learned model shadow")
        self._clock, self._batch_mean, self._duel_inc = clock, float(batch_mean), float(duel_inc)
        self._last = list(last)
        self._last_picked = np.array(last, np.int64)
        self._counts, self._own, self._own_ms = (a.astype(np.float32) for a in (counts, own, own_ms))
        self._score, self._duel = score.tolist(), duel.tolist()
        # A smaller store keeps the most recent of LRU's shadow and the best scored of the model's.
        self._lru_shadow = OrderedDict.fromkeys(lru[-self.capacity:])
        self._model_shadow = set(sorted(model, key=lambda e: (score[e], e))[-self.capacity:])
        self.follows_lru = self._duel[0] > self._duel[1]


def _numbers(value, shape: tuple[int, ...], low: float, high: float, what: str) -> np.ndarray:
    """A saved array (or number) of `shape`, every element a finite number from low to high."""
    try:
        array = np.array(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"the {what} are not numbers") from None
    if array.shape != shape or not np.isfinite(array).all() or (array < low).any() or (array > high).any():
        raise ValueError(f"the {what} are not {' x '.join(map(str, shape)) or 'one'} finite numbers from {low:g} "
                         f"to {high:g}")
    return array


def _experts(value, n_experts: int, what: str) -> list[int]:
    if (not isinstance(value, list) or len(value) > n_experts
            or not all(type(e) is int and 0 <= e < n_experts for e in value) or len(set(value)) != len(value)):
        raise ValueError(f"the {what} is not a list of distinct experts 0..{n_experts - 1}")
    return value
