"""The ``learned`` eviction policy: evict the expert least likely to be picked again soon, as an online model of
the layer's own routing predicts it (docs/policy-report.md, "The learned policy").

Time counts in batches: what the caller observes at once (`observe`): a token's picks in replay, a report's
lookups of the layer in moe-l2d (a giving process's lookup, one at a time: `look`), a forward's picks of the layer in
L0. After each batch the model scores every expert e of the layer, for each horizon h_k:

    z_ke = bias_ke + sum over f in the batch of cross[k, f, e] + sum over f of past_f . history[k, f, e]
           + sum over g in the context of before[k, g, e]
           + own_ke . (1 if e is in the batch, log1p of e's decayed pick counts with half-lives HALF_LIVES)

a logistic regression of "the batch's client picks e within the next h_k batches", where past_f is the client's
decayed picks before this batch (HISTORY_DECAY a batch) and the context is that client's latest batch at the layer
before (its token's picks there in replay and L0, its latest lookups there in moe-l2d; none at the first layer).
The cross, history and before weights carry what recency and frequency cannot: which experts follow which (in
replay, most of what it gains over `adaptive`; docs/policy-report.md, "The layer before"). An expert's score
is the sum of its probabilities over the horizons, so that the one evicted is the one expected back the latest, as
Belady's MIN evicts (one horizon ranks only "soon or not"); with several clients, the probability of a pick by any
of them. The label of a batch's scores for h_k is known h_k batches later; the model then takes one RMSprop step on
it, so it keeps following the workload. The horizons are HORIZON_MULTIPLES of the cache's lifetime in batches: the
capacity over the mean distinct experts per batch, within HORIZON_RANGE.

Several clients (`source`): what a client picks next follows from its own picks, not from another's, so each
client's batch is scored from that client's batch and history, and labelled by that client's later picks; the
cache's chance of a pick of e within h_k is 1 - prod over clients c of (1 - p_cke), from each client's latest
scores, for up to MAX_SOURCES clients seen within SOURCE_TTL horizons (docs/policy-report.md, "Several clients").

Guard: a shadow LRU cache and a shadow of the model's ranking, of the live capacity, see the same accesses;
where LRU has hit more lately (a drifting working set that the model has not learned), the live cache evicts as LRU
does, until the model's shadow is ahead again. "Lately" is the latest quarter of the batches seen (DUEL_AGE, within
DUEL_WINDOW): a cold model's first batches, which it ranks worse than LRU, soon stop counting against it
(docs/policy-report.md, "What moe-l2d's policy sees").

Deterministic (no randomness), and bounded: per layer 6 x len(HORIZON_MULTIPLES) x n_experts^2 floats (the
cross, history and before weights and their RMSprop state) plus max(HORIZON_MULTIPLES) x HORIZON_RANGE[1] pending
batches and MAX_SOURCES clients' scores; work (native/learned.h, one call a batch, the GIL released) of O(horizons x
n_experts x (the batch, its context and its history + the clients)) per batch.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from moe_l2 import _native

HALF_LIVES = (4.0, 32.0, 256.0)  # batches
LEARNING_RATE = 0.003
RMS_DECAY = 0.99
HORIZON_RANGE = (2, 16)  # the cache's lifetime in batches
HORIZON_MULTIPLES = (0.5, 1.0, 2.0, 4.0)  # of the lifetime: the horizons an expert's score sums over
HISTORY_DECAY = 0.5  # a source's picks one batch older weigh this much less in its history
_HISTORY_FLOOR = 0.01  # past weights below it (picks 7 batches old and older) are dropped
DUEL_AGE = 0.25  # of the batches seen: the half-life of the shadows' hit counts,
DUEL_WINDOW = (16.0, 4096.0)  # within these many batches
# Sources (clients) whose latest scores count: at most MAX_SOURCES, each for SOURCE_TTL horizons.
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
# The n_experts x n_experts arrays a state keeps, per horizon, as float32: the bytes a pair of experts takes in it.
_PAIRED = ("cross", "cross_ms", "history", "history_ms", "before", "before_ms")
PAIR_STATE_BYTES = 4 * len(_PAIRED) * len(HORIZON_MULTIPLES)


class LearnedReuse:
    name = "learned"
    # observe() may run on one thread beside victim(), hottest() and state() on others: they read one _Ranking,
    # which observe replaces whole; state(), latest() and nbytes wait for observe, whose native model changes without
    # the GIL. moe-l2d runs it outside its store lock.
    concurrent_observe = True

    def __init__(self, n_experts: int, capacity: int) -> None:
        if n_experts < 1 or capacity < 1:
            raise ValueError("the learned policy needs the layer's number of experts and its capacity")
        self.n_experts = n_experts
        # The weights, counts, clients and pending batches (native/learned.h), and views of its arrays: per horizon
        # and expert the weights of its own features (picked now, log1p of each decayed count, its bias), cross[k, f,
        # e] (f picked now -> e picked within h_k), history[k, f, e] (f picked lately -> the same), before[k, g, e]
        # (g picked at the layer before -> the same), RMSprop's mean squares of each, and the decayed counts.
        self._model = _native.LearnedModel(
            n_experts, count_decay=np.array([2.0 ** (-1.0 / h) for h in HALF_LIVES], np.float32).tolist(),
            horizon_multiples=list(HORIZON_MULTIPLES), lifetime=HORIZON_RANGE, rate=LEARNING_RATE,
            rms_decay=RMS_DECAY, eps=_EPS, history_decay=HISTORY_DECAY, history_floor=_HISTORY_FLOOR,
            max_sources=MAX_SOURCES, source_ttl=SOURCE_TTL)
        self._arrays = self._model.arrays()
        for name, array in self._arrays.items():
            setattr(self, f"_{name}", array)
        self._source_ids: dict[object, int] = {}  # a client -> the model's id of it, while the model keeps it
        self._new_ids = itertools.count()
        self._ranking = _Ranking([0.0] * n_experts, [0] * n_experts, False)
        self.capacity = capacity
        self._lru_shadow: OrderedDict[int, None] = OrderedDict()
        self._model_shadow: set[int] = set()
        self._duel = [0.0, 0.0]  # decayed hits of the LRU shadow and of the model's
        self._duel_inc = 1.0
        self._lock = threading.Lock()

    def set_capacity(self, n_slots: int) -> None:
        self.capacity = n_slots

    @property
    def follows_lru(self) -> bool:
        """Whether the cache evicts as LRU does now (the guard: LRU's shadow has hit more lately)."""
        return self._ranking.follows_lru

    @property
    def horizon(self) -> int:
        """About how long an expert stays cached, in batches: the horizons are multiples of it."""
        return self._model.lifetime(self.capacity)

    def observe(self, experts: Iterable[int], source=None, context: Iterable[int] | None = None) -> None:
        """One batch of picks of this layer, from `source` (a client; None: the only one), and `context`, that
        client's latest picks at the layer before (None: unknown); the model learns from the batch `horizon`
        batches back and scores every expert anew."""
        picked = sorted(set(experts))
        if picked:
            with self._lock:
                self._observe(picked, source, context)

    def _observe(self, picked: list[int], source, context: Iterable[int] | None) -> None:
        score, gone = self._model.observe(picked, self._source_id(source),
                                          sorted(set(context)) if context is not None else [], self.capacity)
        if gone:  # at most MAX_SOURCES clients to look through
            self._source_ids = {client: known for client, known in self._source_ids.items() if known not in gone}
        clock, last = self._model.clock, list(self._ranking.last)
        for e in picked:
            last[e] = clock
        self._ranking = _Ranking(score, last, self._shadows(picked, score, last))

    def _source_id(self, source) -> int:
        """The model's id of the client `source`: a new one for a client it let go or never saw."""
        known = self._source_ids.get(source)
        if known is None:
            known = self._source_ids[source] = next(self._new_ids)
        return known

    @property
    def nbytes(self) -> int:
        """Memory of its arrays now, the clients' histories and the pending batches included."""
        with self._lock:  # the native model changes them without the GIL
            return sum(a.nbytes for a in self._arrays.values()) + self._model.dynamic_bytes

    def latest(self, source=None) -> list[int] | None:
        """The client's latest batch at this layer, while it counts as recent: the layer after's context."""
        with self._lock:
            known = self._source_ids.get(source)
            return None if known is None else self._model.latest(known)

    def access(self, expert: int, count: int = 1) -> None:
        self.observe((expert,))

    def _shadows(self, picked: list[int], score: list[float], last: list[int]) -> bool:
        """Run the picks through the LRU shadow and the model's, ranked by `score` and `last`: whether to follow
        LRU, which has hit more lately."""
        capacity = self.capacity
        low, high = DUEL_WINDOW
        self._duel_inc *= 2.0 ** (1.0 / min(high, max(low, self._model.clock * DUEL_AGE)))
        lru, model = self._lru_shadow, self._model_shadow
        hits = [0, 0]
        ranked = None  # the model's shadow as a heap by (score, last, expert), made at its first eviction
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
                    if ranked is None:
                        ranked = [(score[c], last[c], c) for c in model]
                        heapq.heapify(ranked)
                    model.discard(heapq.heappop(ranked)[2])
                model.add(e)
                if ranked is not None:
                    heapq.heappush(ranked, (score[e], last[e], e))
        duel = self._duel
        duel[0] += hits[0] * self._duel_inc
        duel[1] += hits[1] * self._duel_inc
        if self._duel_inc > _RESCALE:
            self._duel = [h / self._duel_inc for h in duel]
            self._duel_inc = 1.0
        return self._duel[0] > self._duel[1]

    def insert(self, expert: int) -> None:
        pass

    def evict(self, expert: int) -> None:
        pass

    def victim(self, candidates: Iterable[int]) -> int:
        ranking = self._ranking
        score, last = ranking.score, ranking.last
        if ranking.follows_lru:
            return min(candidates, key=lambda c: (last[c], c))
        return min(candidates, key=lambda c: (score[c], last[c], c))

    def admits(self, expert: int, victim: int) -> bool:
        """Whether a miss on `expert` whose reader has its own copy should take `victim`'s slot: not when the model
        expects the victim back sooner (a higher score), where the slot would cost a copy, a check and a hit later
        (docs/decisions.md, "Admission"). While the cache follows LRU, every miss is admitted, as LRU would."""
        ranking = self._ranking
        return ranking.follows_lru or ranking.score[expert] >= ranking.score[victim]

    def hottest(self, experts: Iterable[int]) -> list[int]:
        ranking = self._ranking
        score, last = ranking.score, ranking.last
        if ranking.follows_lru:
            return sorted(experts, key=lambda e: (-last[e], e))
        return sorted(experts, key=lambda e: (-score[e], -last[e], e))

    _STATE = ("clock", "batch_mean", "counts", "own", "own_ms", *_PAIRED, "last", "score", "lru_shadow",
              "model_shadow", "duel", "duel_inc")

    def state(self) -> dict:
        """What a restart keeps: the whole model (the cross and history weights and their mean squares as
        little-endian float32 bytes, PAIR_STATE_BYTES a pair of experts), the counts, scores, shadows and the duel;
        not the pending batches or the clients, which a restart has none of."""
        with self._lock:
            ranking = self._ranking
            return {"clock": self._model.clock, "batch_mean": self._model.batch_mean, "counts": self._counts.tolist(),
                    "own": self._own.tolist(), "own_ms": self._own_ms.tolist(),
                    **{name: getattr(self, f"_{name}").astype("<f4", copy=False).tobytes() for name in _PAIRED},
                    "last": list(ranking.last), "score": list(ranking.score), "lru_shadow": list(self._lru_shadow),
                    "model_shadow": sorted(self._model_shadow), "duel": list(self._duel),
                    "duel_inc": self._duel_inc}

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
        paired = {name: _packed(state[name], self._cross.shape, 0 if name.endswith("_ms") else -_MAX_WEIGHT,
                                _MAX_WEIGHT, f"learned {_paired_name(name)}")
                  for name in _PAIRED}
        score = _numbers(state["score"], (n,), -_MAX_SCORE, _MAX_SCORE, "learned scores")
        batch_mean = _numbers(state["batch_mean"], (), 0, n, "learned batch mean")
        duel = _numbers(state["duel"], (2,), 0, _MAX_DUEL, "learned duel")
        duel_inc = _numbers(state["duel_inc"], (), 1, 2 * _RESCALE, "learned duel increment")
        lru = _experts(state["lru_shadow"], n, "learned LRU shadow")
        model = _experts(state["model_shadow"], n, "learned model shadow")
        self._model.clock, self._model.batch_mean, self._duel_inc = clock, float(batch_mean), float(duel_inc)
        for name, array in {"counts": counts, "own": own, "own_ms": own_ms, **paired}.items():
            np.copyto(getattr(self, f"_{name}"), array, casting="unsafe")  # checked finite and in bounds above
        self._duel = duel.tolist()
        # A smaller store keeps the most recent of LRU's shadow and the best scored of the model's.
        self._lru_shadow = OrderedDict.fromkeys(lru[-self.capacity:])
        self._model_shadow = set(sorted(model, key=lambda e: (score[e], e))[-self.capacity:])
        self._ranking = _Ranking(score.tolist(), list(last), self._duel[0] > self._duel[1])


@dataclass(frozen=True, slots=True)
class _Ranking:
    """What the cache evicts by, replaced whole after each batch: each expert's score (the sum of its chances), the
    clock of its latest pick (ties, and the LRU ranking), and whether the guard follows LRU now."""
    score: list[float]
    last: list[int]
    follows_lru: bool


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


def _paired_name(name: str) -> str:
    return f"{name.removesuffix('_ms')} mean squares" if name.endswith("_ms") else f"{name} weights"


def _packed(value, shape: tuple[int, ...], low: float, high: float, what: str) -> np.ndarray:
    """A saved float32 array of `shape` (state()'s bytes), every element a finite number from low to high."""
    if not isinstance(value, bytes) or len(value) != 4 * int(np.prod(shape)):
        raise ValueError(f"the {what} are not {' x '.join(map(str, shape))} float32 numbers")
    array = np.frombuffer(value, "<f4").reshape(shape)
    if not np.isfinite(array).all() or (array < low).any() or (array > high).any():
        raise ValueError(f"the {what} are not finite numbers from {low:g} to {high:g}")
    return array.astype(np.float32)


def _experts(value, n_experts: int, what: str) -> list[int]:
    if (not isinstance(value, list) or len(value) > n_experts
            or not all(type(e) is int and 0 <= e < n_experts for e in value) or len(set(value)) != len(value)):
        raise ValueError(f"the {what} is not a list of distinct experts 0..{n_experts - 1}")
    return value
