"""The learned policy (moe_l2/cache/learned.py): what it learns, its guard, its bounds, and that moe-l2d's store and
the client's L0 run the one implementation on the batches they see."""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import random
import threading
from array import array
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from moe_l2 import _native, protocol
from moe_l2.cache import learned
from moe_l2.cache import replay as rp
from moe_l2.cache.learned import LearnedReuse
from moe_l2.cache.policy import make_policy
from moe_l2.cache.replay import Task, replay_layer
from moe_l2.cache.store import LayerStore
from moe_l2.cache.trace import read_traces
from moe_l2.client.connection import L2Client, wait_idle
from moe_l2.client.pool import ExpertPool
from moe_l2.control import dealer
from moe_l2.daemon.loader import Loader
from moe_l2.daemon.served import ServedModel
from moe_l2.daemon.server import report_pieces
from moe_l2.layout import Geometry, new_token, segment_name

from .conftest import budget_for, filling_pool, shared_trace, stats, synthetic_trace, wait_for


def hit_rates(batches, n_experts: int, slots: int, names=("learned", "lru", "min")) -> dict[str, float]:
    rates = {}
    for name in names:
        r = replay_layer(Task(0, slots, name, batches, n_experts))
        rates[name] = r["hits"] / r["lookups"]
    return rates


def loop(span: int, per_batch: int, batches: int) -> list[tuple[int, ...]]:
    """Experts 0..span-1 in turn, `per_batch` at a time: each comes back every span / per_batch batches."""
    return [tuple((t * per_batch + i) % span for i in range(per_batch)) for t in range(batches)]


def test_on_a_loop_larger_than_the_cache_it_learns_what_min_does_and_lru_cannot():
    """10 experts in turn, 2 a token, 8 slots: LRU evicts each expert just before it comes back (no hit at all);
    MIN keeps 8 of the 10 for their next turn. The model learns that the experts just picked are the ones not
    needed within the cache's lifetime."""
    rates = hit_rates(loop(10, 2, 3000), 16, 8)
    assert rates["lru"] == 0
    assert rates["learned"] >= 0.97 * rates["min"] and rates["min"] > 0.75


def drifting_working_set(tokens=3000, seed=0) -> list[tuple[int, ...]]:
    """Two of six experts a token, the six moving on by 5 of 32 every 60 tokens."""
    rng = random.Random(seed)
    return [tuple(rng.sample([(t // 60 * 5 + i) % 32 for i in range(6)], 2)) for t in range(tokens)]


def test_where_the_model_loses_to_lru_it_evicts_as_lru_does():
    """A working set that drifts every 60 tokens: what the model learned of one set misleads it on the next, and
    its shadow hits less than LRU's; the live cache then follows LRU."""
    batches = drifting_working_set()
    policy = LearnedReuse(32, 6)
    for batch in batches:
        policy.observe(batch)
    assert policy.follows_lru
    rates = hit_rates(batches, 32, 6, ("learned", "lru"))
    assert rates["learned"] >= rates["lru"] - 0.002


def test_the_guard_hands_the_cache_back_to_the_model_soon_after_lru_stops_winning():
    """1000 batches where LRU wins, then a loop of 8 experts over 6 slots where LRU never hits: the guard's memory
    is a quarter of the policy's age, so the model evicts again within 100 batches (with the fixed 4096-batch
    memory, after 263)."""
    policy = LearnedReuse(32, 6)
    for batch in drifting_working_set(1000):
        policy.observe(batch)
    assert policy.follows_lru
    for batch in loop(8, 2, 100):
        policy.observe(tuple(20 + e for e in batch))
        if not policy.follows_lru:
            break
    assert not policy.follows_lru, "the guard still follows LRU 100 batches after LRU stopped hitting"


def test_it_beats_adaptive_on_real_routing():
    traces = read_traces([shared_trace("deepseek-v2-lite.jsonl.gz")])
    traces.sequences = traces.sequences[:40]
    result = rp.replay(traces, slots=[16], compare=("adaptive", "lru"), policy="learned", layers=[0, 12])
    entry = result.capacities[0]
    ps = entry.policies
    assert ps["learned"].hit_rate > ps["adaptive"].hit_rate + 0.02 > ps["lru"].hit_rate
    assert ps["learned"].misses_vs_min < ps["adaptive"].misses_vs_min
    assert entry.gap_closed_vs_lru > 0.3


def test_replay_is_deterministic_with_one_client_and_with_several(tmp_path):
    traces = read_traces(synthetic_trace(tmp_path / "t.jsonl.gz", n_experts=16, seqs=6, tokens=60))
    for processes in (1, 3):
        one = rp.replay(traces, slots=[4, 8], policy="learned", processes=processes)
        two = rp.replay(traces, slots=[4, 8], policy="learned", processes=processes, jobs=2)
        assert one == two


def logistic(x: np.ndarray) -> np.ndarray:
    return np.array([1.0 / (1.0 + math.exp(-v)) for v in x.ravel().tolist()]).astype(np.float32).reshape(x.shape)


def log1p(x: np.ndarray) -> np.ndarray:
    return np.array([math.log1p(v) for v in x.ravel().tolist()]).astype(np.float32).reshape(x.shape)


class NumpyModel:
    """The learned model of one layer in numpy's float32 ufuncs, as learned.py computed it before native/learned.h,
    with log1p and the logistic in double through libm (math), rounded once: the ground truth the native model must
    match to the bit (numpy's own float32 exp and log1p differ from libm's in the last bit). The history's sum was an
    einsum, which on x86-64 multiplies and adds as these ufuncs do; a build of numpy may fuse the two (arm64), and the
    ufuncs are what the native code follows."""

    def __init__(self, n: int) -> None:
        k, features = len(learned.HORIZON_MULTIPLES), 2 + len(learned.HALF_LIVES)
        self.n, self.clock, self.batch_mean = n, 0, 0.0
        self.own, self.own_ms = np.zeros((k, features, n), np.float32), np.zeros((k, features, n), np.float32)
        for name in learned._PAIRED:
            setattr(self, name, np.zeros((k, n, n), np.float32))
        self.counts = np.zeros((len(learned.HALF_LIVES), n), np.float32)
        self.decay = np.array([2.0 ** (-1.0 / h) for h in learned.HALF_LIVES], np.float32)[:, None]
        self.pending = [collections.deque() for _ in learned.HORIZON_MULTIPLES]
        self.sources: dict[int, SimpleNamespace] = {}  # least recent first

    def arrays(self) -> dict:
        return {name: getattr(self, name) for name in ("own", "own_ms", *learned._PAIRED, "counts")}

    def lifetime(self, capacity: int) -> int:
        low, high = learned.HORIZON_RANGE
        return low if self.batch_mean <= 0 else int(min(high, max(low, round(capacity / self.batch_mean))))

    def observe(self, picked, source, context, capacity):
        ids, n = np.array(picked, np.intp), self.n
        self.clock += 1
        clock = self.clock
        self.batch_mean += (len(picked) - self.batch_mean) / min(clock, 256)
        life = self.lifetime(capacity)
        mine = self.sources.pop(source, None)
        if mine is None:
            mine = SimpleNamespace(past=np.zeros(n, np.float32), last_picked=np.zeros(n, np.int64), chances=None)
        else:
            mine.past *= learned.HISTORY_DECAY
            mine.past[mine.batch] += learned.HISTORY_DECAY
        mine.batch, mine.clock = ids, clock
        self.sources[source] = mine
        gone = []
        while len(self.sources) > learned.MAX_SOURCES or \
                next(iter(self.sources.values())).clock < clock - learned.SOURCE_TTL * life:
            gone.append(next(iter(self.sources)))
            del self.sources[gone[-1]]
        mine.last_picked[ids] = clock
        due = [[] for _ in self.pending]
        for k, pending in enumerate(self.pending):
            while pending and clock - pending[0].clock >= max(1, round(learned.HORIZON_MULTIPLES[k] * life)):
                due[k].append((k, pending.popleft()))
        for step in itertools.zip_longest(*due):
            self.learn([d for d in step if d is not None])
        now = np.zeros(n, np.float32)
        now[ids] = 1.0
        self.counts *= self.decay
        self.counts += now
        features = np.concatenate((now[None], log1p(self.counts), np.ones((1, n), np.float32)))
        past_ids = np.flatnonzero(mine.past >= learned._HISTORY_FLOOR)
        past_weights = mine.past[past_ids]
        before = np.array(context, np.intp)
        mine.chances = logistic((self.own * features).sum(axis=1) + self.cross[:, ids].sum(axis=1)
                                + self.before[:, before].sum(axis=1)
                                + (past_weights[:, None] * self.history[:, past_ids]).sum(axis=1))
        scored = SimpleNamespace(batch=ids, past_ids=past_ids, past_weights=past_weights, features=features,
                                 clock=clock, chances=mine.chances, last_picked=mine.last_picked, before=before)
        for pending in self.pending:
            pending.append(scored)
        chances = [s.chances for s in self.sources.values() if s.chances is not None]
        score = chances[0].sum(axis=0) if len(chances) == 1 else \
            (1.0 - np.prod(1.0 - np.stack(chances), axis=0)).sum(axis=0)
        return score.tolist(), gone

    def learn(self, due):
        ks = np.array([k for k, _ in due], np.intp)
        error = np.stack([s.chances[k] for k, s in due]) - np.stack([s.last_picked > s.clock for _, s in due])

        def rows(picked):
            sizes = [len(p) for p in picked]
            return (np.repeat(ks, sizes), np.concatenate(picked)), np.repeat(error, sizes, axis=0)

        def step(weights, mean_squares, index, grad):
            ms = mean_squares[index] * learned.RMS_DECAY + (1 - learned.RMS_DECAY) * grad * grad
            mean_squares[index] = ms
            weights[index] -= learned.LEARNING_RATE * grad / (np.sqrt(ms) + learned._EPS)

        step(self.own, self.own_ms, ks, np.stack([s.features for _, s in due]) * error[:, None])
        step(self.cross, self.cross_ms, *rows([s.batch for _, s in due]))
        step(self.before, self.before_ms, *rows([s.before for _, s in due]))
        index, grad = rows([s.past_ids for _, s in due])
        step(self.history, self.history_ms, index, np.concatenate([s.past_weights for _, s in due])[:, None] * grad)


@pytest.mark.parametrize("n_experts, slots, top_k", [(64, 16, 6), (32, 8, 4)])
def test_its_native_model_scores_and_learns_as_numpy_to_the_bit(n_experts, slots, top_k):
    """Three clients with contexts, 2,000 batches: every weight, mean square, score and shadow the same."""
    rng = random.Random(n_experts)
    native, reference = LearnedReuse(n_experts, slots), LearnedReuse(n_experts, slots)
    reference._model = NumpyModel(n_experts)
    for name, values in reference._model.arrays().items():
        setattr(reference, f"_{name}", values)
    for t in range(2000):
        batch, context = rng.sample(range(n_experts), top_k), rng.sample(range(n_experts), top_k)
        for policy in (native, reference):
            policy.observe(batch, source=t % 3, context=context if t % 5 else None)
    assert native.state() == reference.state()
    assert native.state()["cross"] != LearnedReuse(n_experts, slots).state()["cross"]  # it learned something


def test_the_native_model_refuses_experts_outside_the_layer_and_changes_nothing():
    policy = LearnedReuse(8, 4)
    policy.observe([1, 2])
    before = policy.state()
    for picked, context, match in [([8], [], "a batch must be distinct experts 0..7"), ([-1], [], "a batch"),
                                   ([2, 1], [], "ascending"), ([1, 1], [], "distinct"), ([], [], "at least one"),
                                   ([1], [9], "a context")]:
        with pytest.raises(ValueError, match=match):
            policy._model.observe(picked, 0, context, 4)
    assert policy.state() == before
    with pytest.raises(ValueError, match="must be positive"):
        _native.LearnedModel(0, count_decay=[0.5], horizon_multiples=[1.0], lifetime=(2, 16), rate=0.1,
                             rms_decay=0.9, eps=1e-6, history_decay=0.5, history_floor=0.01, max_sources=1,
                             source_ttl=1)


def test_its_state_stays_bounded_on_a_long_trace_from_many_clients():
    """100 clients in turn, 30,000 batches: the pending batches, the clients kept as context, the shadows and the
    arrays stay within their bounds (a layer of 32 experts: under 128 KiB, 96 of it the weights)."""
    rng = random.Random(0)
    policy = LearnedReuse(32, 8)
    most = 0
    for t in range(30_000):
        policy.observe(rng.sample(range(32), 4), source=t % 100)
        assert all(p <= max(learned.HORIZON_MULTIPLES) * learned.HORIZON_RANGE[1] for p in policy._model.pending_sizes)
        assert len(policy._model.sources) == len(policy._source_ids) <= learned.MAX_SOURCES
        most = max(most, policy.nbytes)
    assert most < 128 << 10
    assert len(policy._lru_shadow) <= 8 and len(policy._model_shadow) <= 8
    assert all(math.isfinite(s) for s in policy._ranking.score)
    assert all(np.isfinite(a).all() for a in (policy._cross, policy._history, policy._own))


def client_chances(policy: LearnedReuse, client) -> np.ndarray:
    """The client's latest chances [horizons, experts]."""
    flat = policy._model.chances(policy._source_ids[client])
    return np.array(flat, np.float32).reshape(len(learned.HORIZON_MULTIPLES), policy.n_experts)


def test_with_several_clients_an_expert_scores_its_chance_of_a_pick_by_any():
    """Each client is scored from its own picks and keeps its scores while the others report: an expert's score is
    the chance that some client picks it within each horizon. A client left silent past SOURCE_TTL horizons drops
    out of the scores."""
    policy = LearnedReuse(24, 8)
    a, b = loop(12, 2, 600), [tuple(12 + e for e in batch) for batch in loop(12, 2, 600)]
    for batch_a, batch_b in zip(a, b):
        policy.observe(batch_a, source="a")
        policy.observe(batch_b, source="b")
    chances = [client_chances(policy, c) for c in ("a", "b")]
    combined = (1 - (1 - chances[0]) * (1 - chances[1])).sum(axis=0)
    assert np.allclose(policy._ranking.score, combined, rtol=1e-5)
    # Each client's own next picks rank first in its own chances, and both clients' stay high in the score.
    next_a = loop(12, 2, 601)[-1]
    next_b = tuple(12 + e for e in next_a)
    top = sorted(range(24), key=lambda e: -policy._ranking.score[e])[:8]
    assert set(next_a) <= set(top) and set(next_b) <= set(top)
    for _ in range(learned.SOURCE_TTL * learned.HORIZON_RANGE[1] + 1):
        policy.observe(b[0], source="b")
    assert list(policy._source_ids) == ["b"] and policy._model.sources == [policy._source_ids["b"]]
    assert np.allclose(policy._ranking.score, client_chances(policy, "b").sum(axis=0), rtol=1e-5)


def test_it_never_evicts_a_pin_or_the_batch_being_loaded():
    """On the loop, the model would evict the experts just picked; a pinned expert is never picked again and
    ranks last. Neither goes: the store hands the policy only the others."""
    store = LayerStore(16, 8, make_policy("learned", 8, 16))
    store.pin([15], "permanent")
    store.commit(store.reserve(15))
    for batch in loop(10, 2, 2000):
        store.observe(batch)
        for expert in batch:
            if store.slot(expert) < 0:
                r = store.reserve(expert, keep=frozenset(batch))
                assert r is not None and r.evicted not in batch and r.evicted != 15
                store.commit(r)
    assert store.pinned(15) and store.has(15)


def test_a_small_report_is_one_batch_per_layer():
    """moe-l2d folds a layer's hits and misses as one piece where they fit, so that the policy sees the lookups of
    one forward as one batch."""
    pieces = report_pieces({0: [[1, 2], [3]], 1: [[], [4]]}, {}, 8, {1: [4]})
    assert [p.layers for p in pieces] == [{0: [[1, 2], [3]]}, {1: [[], [4]]}]
    assert pieces[0].keep == {0: frozenset({1, 2, 3})} and not pieces[0].given
    assert pieces[1].given == {1: [4]}
    # Past the piece size, hits and misses go apart as before.
    big = report_pieces({0: [list(range(6)), [6, 7, 8]]}, {}, 4)
    assert [p.layers for p in big] == [{0: [[0, 1, 2, 3], []]}, {0: [[4, 5], []]}, {0: [[], [6, 7, 8]]}]


def walk(batches: int, seed: int = 7) -> list[tuple[int, ...]]:
    """Three experts a token, x, x+3 and x+7 of 16, x moving on by 1, 2 or 5: which experts come next follows from
    the latest, and a token's lookups are partly hits, partly misses."""
    rng, x, out = random.Random(seed), 0, []
    for _ in range(batches):
        x = (x + rng.choice((1, 2, 5))) % 16
        out.append(tuple(sorted({x, (x + 3) % 16, (x + 7) % 16})))
    return out


def test_restarted_it_goes_on_from_what_it_learned():
    """moe-l2 replay --warm restarts each policy from its saved state after the train share, as moe-l2d restarts:
    on the walk, the restarted model hits as the one that never stopped does, where a cold one is still learning,
    and its store starts with what it held. (It hits 7% of MIN's lead over LRU more than the cold one, 231 against
    216; 12% before admission, which helps a cold model the most.)"""
    batches = walk(2200)
    before, after = batches[:2000], batches[2000:]
    never_stopped = replay_layer(Task(0, 6, "learned", before + after, 16, record_tokens=True))
    restarted = replay_layer(Task(0, 6, "learned", after, 16, warm=(before, None, None)))
    cold = replay_layer(Task(0, 6, "learned", after, 16))
    lru, best = (replay_layer(Task(0, 6, name, after, 16))["hits"] for name in ("lru", "min"))
    assert restarted["preloads"] == 6 and cold["preloads"] == 0
    assert restarted["hits"] >= sum(array("H", never_stopped["per_token"])[len(before):]) - 2
    assert (restarted["hits"] - cold["hits"]) / (best - lru) > 0.05


def reference_hits(batches, slots: int, name: str, context=None, gives: bool = False, told: str = "before") -> int:
    """What a store evicting by `name` hits on `batches`, loading each batch's misses and never evicting the
    batch: what moe-l2d and L0 do; its policy told of `context`, each batch's at the layer before, where given.
    gives: the misses are a giving process's, which the policy may refuse (reserved as optional). told: when the
    policy is told of each batch: "before" its misses are reserved, "after" them or "twice" (before and after)."""
    store = LayerStore(16, slots, make_policy(name, slots, 16))
    hits = 0
    for t, batch in enumerate(batches):
        missing = [e for e in batch if store.slot(e) < 0]
        hits += len(batch) - len(missing)
        before = context[t] if context is not None else None
        if told in ("before", "twice"):
            store.observe(batch, None, before)
        for expert in missing:
            reservation = store.reserve(expert, keep=frozenset(batch), optional=gives)
            if reservation is not None:
                store.commit(reservation)
        if told in ("after", "twice"):
            store.observe(batch, None, before)
    return hits


@contextlib.contextmanager
def full_layer(model_files, slots: int, name: str):
    """A ServedModel (policy learned) of `slots` slots a layer whose layer 0 holds experts 0..slots-1, loaded through a
    report and published, and its loader."""
    geometry = Geometry.for_budget(model_files.n_layers, model_files.n_experts, model_files.layout.nbytes,
                                   budget_for(model_files, slots))
    served = ServedModel(model_files, geometry, lambda layer, nbytes: _native.Segment.create(
        segment_name(name, 0, layer, new_token()), nbytes, 0o600), epoch=1, policy="learned")
    loader = Loader(1)
    try:
        served.report({0: [[], list(range(slots))]}, {}, loader)
        index = served.slot_indexes[0]
        wait_for(lambda: all(index.slot_of(e) >= 0 for e in range(slots)), what="layer 0's slots published")
        yield served, loader
    finally:
        loader.shutdown()
        served.close()


def test_moe_l2d_reserves_a_slot_while_the_policy_learns_from_a_report(model_files):
    """The learned model's work on a report (numpy steps, 0.1-0.4 ms a layer) runs outside ServedModel's lock, which
    the fill desk's reservations and the loaders' publishing take: here a report's batch is held on its way into
    the policy while another thread reserves a slot, evicting for it, as the fill desk does for a donor."""
    slots = 4
    inside, release = threading.Event(), threading.Event()
    with full_layer(model_files, slots, "learnlock") as (served, loader):
        store = served.stores[0]
        observe = store.policy.observe

        def held(experts, source=None, context=None) -> None:
            inside.set()
            release.wait(30)
            observe(experts, source, context)

        store.policy.observe = held
        reporter = threading.Thread(target=served.report, args=({0: [list(range(slots)), []]}, {}, loader))
        reporter.start()
        try:
            assert inside.wait(30)
            taken: list = []
            reserving = threading.Thread(target=lambda: taken.extend(served.reserve(0, [slots])))
            reserving.start()
            reserving.join(10)
            assert [r.expert for r in taken] == [slots] and taken[0].evicted in range(slots), \
                "a reservation waited for the policy's work on a report"
            served.abort_fill(0, taken[0])
            release.set()
            reporter.join(30)
            assert not reporter.is_alive()
        finally:
            release.set()


def test_a_give_takes_a_slot_only_from_a_victim_the_model_expects_back_later():
    """L2 admits a give (a miss its reader computes on from its own copy) only where the model scores it at least as
    high as the victim it names: a record that would leave before the victim came back is only a copy and a check.
    A free slot, a pinned expert, or a miss that is not optional (a client may be waiting for it) gets its slot
    whatever its score."""
    policy = LearnedReuse(16, 5)
    store = LayerStore(16, 5, policy)
    for expert in range(4):
        store.commit(store.reserve(expert))
    for t in range(500):
        store.observe([t % 5, (t + 1) % 5])
    score = policy._ranking.score
    assert not policy.follows_lru and max(score[9], score[12]) < min(score[:5])
    free = store.reserve(9, optional=True)
    assert free is not None and free.evicted == -1
    store.abort(free)
    store.commit(store.reserve(4))  # the free slot taken: from here on a miss must evict
    assert store.reserve(9, optional=True) is None
    assert all(store.slot(e) >= 0 for e in range(5)) and not store.has(9)
    store.pin([9], "permanent")
    pinned = store.reserve(9, optional=True)
    assert pinned is not None and pinned.evicted in range(5)
    store.commit(pinned)
    assert store.reserve(12, optional=True) is None
    needed = store.reserve(12)
    assert needed is not None and needed.evicted in range(5)


def test_moe_l2d_offers_a_give_slots_past_a_record_its_policy_does_not_admit(model_files):
    """A give names several records: one the policy does not admit leaves the others their slots."""
    slots = 4
    with full_layer(model_files, slots, "admit") as (served, _):
        store = served.stores[0]
        hot, cold = slots, slots + 1
        for t in range(400):
            store.observe([t % slots, hot])  # picked every time, never loaded
        taken = served.reserve(0, [cold, hot], optional=True)
        assert [r.expert for r in taken] == [hot] and taken[0].evicted in range(slots)
        served.abort_fill(0, taken[0])


def test_moe_l2d_and_l0_run_the_one_implementation(daemon_factory, model_dir, model_files):
    """The same batches through a real moe-l2d started with --policy learned (reports, misses loaded before the
    next) and through a real L0 pool with policy learned hit exactly where the store's reference does. The counts
    tell apart LRU, and the learned policy fed one lookup at a time or a token's hits apart from its misses (the
    reference's hits would be 163, 213 and 226 of 900)."""
    slots, batches = 6, walk(300)
    expected = reference_hits(batches, slots, "learned")
    assert expected == 229

    pool = ExpertPool(model_files, slots, policy="learned", grow=False)
    try:
        assert sum(pool.fetch(0, list(batch)).l0_hits for batch in batches) == expected
    finally:
        pool.close()

    daemon = daemon_factory([model_dir], str(budget_for(model_files, slots)), "--policy", "learned")
    client = L2Client(model_files, daemon.socket, wait_s=5)
    viewer = ExpertPool(model_files, model_files.top_k, client)
    try:
        view, seen = viewer._l2_view(), 0
        for batch in batches:
            held = view.lend(0, list(batch)).experts
            hits = [e for e in batch if e in held]
            misses = [e for e in batch if e not in held]
            client.report(0, hits, misses, list(batch))
            seen += len(batch)
            wait_for(lambda: stats(daemon)["models"][0]["hits"] + stats(daemon)["models"][0]["misses"] == seen,
                     what="the report")
            wait_for(lambda: len(view.lend(0, misses).experts) == len(misses), what="the misses in L2")
        assert stats(daemon)["models"][0]["hits"] == expected
    finally:
        viewer.close()
        client.close()


def test_a_giving_processs_lookups_reach_the_policy_before_its_gives_once_each(daemon_factory, model_dir,
                                                                               model_files):
    """A process that gives its misses to a real moe-l2d (--policy learned) sends each lookup through the fill
    socket ahead of its give, and its reports only count it: L2 hits exactly where the store's reference told of
    each batch before its gives does, not where one told after them (as reports alone told it, a flush later) or
    twice does."""
    slots, batches = 6, walk(300)
    expected = reference_hits(batches, slots, "learned", gives=True)
    assert expected not in {reference_hits(batches, slots, "learned", gives=True, told=told)
                            for told in ("after", "twice")}
    daemon = daemon_factory([model_dir], str(budget_for(model_files, slots)), "--policy", "learned")
    with filling_pool(model_files, daemon) as pool:
        seen = 0
        for batch in batches:
            pool.fetch(0, list(batch))
            seen += len(batch)
            assert pool.donor.wait_answered(10)
            wait_idle(daemon.socket)  # the donations checked and published before the next lookup
            wait_for(lambda: stats(daemon)["models"][0]["hits"] + stats(daemon)["models"][0]["misses"] == seen,
                     what="the report")
            for expert in batch:  # every lookup goes to L2, as in the reference
                pool.evict(0, expert)
        assert stats(daemon)["models"][0]["hits"] == expected


def test_moe_l2d_and_l0_give_each_layer_the_tokens_latest_picks_at_the_layer_before(daemon_factory, model_dir,
                                                                                    model_files):
    """A token's lookups at layers 0 and 1: a real L0 pool with policy learned, and a real moe-l2d told of both in
    one report that names layer 1 first, hit at layer 1 exactly where a reference store told of layer 0's batch as
    context does, and not where one told nothing does."""
    slots, below, batches = 6, walk(300, seed=3), walk(300)
    expected = reference_hits(batches, slots, "learned", context=below)
    assert expected != reference_hits(batches, slots, "learned")

    pool = ExpertPool(model_files, slots, policy="learned", grow=False)
    try:
        hits = 0
        for b0, b1 in zip(below, batches):
            pool.fetch(0, list(b0))
            hits += pool.fetch(1, list(b1)).l0_hits
        assert hits == expected
    finally:
        pool.close()

    daemon = daemon_factory([model_dir], str(budget_for(model_files, slots)), "--policy", "learned")
    client = L2Client(model_files, daemon.socket, wait_s=5)
    viewer = ExpertPool(model_files, model_files.top_k, client)
    reporter = dealer(daemon.socket, None, protocol.MAX_REPLY_BYTES)  # one client: one socket for every report
    try:
        view, seen = viewer._l2_view(), 0
        for t, (b0, b1) in enumerate(zip(below, batches)):
            held = {layer: view.lend(layer, list(batch)).experts for layer, batch in ((1, b1), (0, b0))}
            asked = {layer: [e for e in batch if e not in held[layer]] for layer, batch in ((1, b1), (0, b0))}
            reporter.send(protocol.Report(id=t, model=model_files.fingerprint, layers={
                layer: [[e for e in batch if e in held[layer]], asked[layer]] for layer, batch in ((1, b1), (0, b0))
            }).encode())
            seen += len(b0) + len(b1)
            wait_for(lambda: stats(daemon)["models"][0]["hits"] + stats(daemon)["models"][0]["misses"] == seen,
                     what="the report")
            wait_for(lambda: all(len(view.lend(layer, asked[layer]).experts) == len(asked[layer]) for layer in asked),
                     what="the misses in L2")
        assert stats(daemon)["models"][0]["layers"][1]["hits"] == expected
    finally:
        reporter.close(0)
        viewer.close()
        client.close()


def test_its_state_survives_a_restart_and_a_planted_state_is_refused():
    """state() is what moe-l2d's heat file keeps (msgpack); restored, the policy holds the same model, weights from
    expert to expert included, and ranks and evicts as it did. A state that is damaged or planted is refused with a
    ValueError naming the field, before anything changes."""
    rng = random.Random(0)
    policy = LearnedReuse(32, 8)
    for _ in range(2000):
        policy.observe(rng.sample(range(32), 4))
    saved = msgpack.unpackb(msgpack.packb(policy.state()))
    restored = LearnedReuse(32, 8)
    restored.restore(saved, 32)
    assert restored.hottest(range(32)) == policy.hottest(range(32))
    assert restored.victim(range(32)) == policy.victim(range(32))
    assert restored.state() == policy.state() and saved["cross"] != LearnedReuse(32, 8).state()["cross"]
    n = 32
    nan = np.full((4, n, n), np.nan, "<f4").tobytes()
    negative = np.full((4, n, n), -1.0, "<f4").tobytes()
    for bad, words in [({}, "fields"), ({**saved, "clock": -1}, "clock"), ({**saved, "clock": True}, "clock"),
                       ({**saved, "last": [0] * (n - 1)}, "last picks"),
                       ({**saved, "last": [saved["clock"] + 1] * n}, "last picks"),
                       ({**saved, "own": [[float("nan")] * n] * 5}, "weights"),
                       ({**saved, "counts": "x"}, "counts"), ({**saved, "counts": [[1e300] * n] * 3}, "counts"),
                       ({**saved, "lru_shadow": [0, 0]}, "LRU shadow"), ({**saved, "model_shadow": [n]}, "model"),
                       ({**saved, "duel": [1.0]}, "duel"), ({**saved, "batch_mean": [1, 2]}, "batch mean"),
                       ({**saved, "cross": saved["cross"][:-4]}, "cross weights"),
                       ({**saved, "cross": [0.0] * n}, "cross weights"), ({**saved, "history": nan}, "history weights"),
                       ({**saved, "history_ms": negative}, "history mean squares")]:
        fresh = LearnedReuse(32, 8)
        with pytest.raises(ValueError, match=words):
            fresh.restore(bad, n)
        assert fresh.state() == LearnedReuse(32, 8).state()
    with pytest.raises(ValueError, match="64 experts"):
        LearnedReuse(32, 8).restore(saved, 64)
