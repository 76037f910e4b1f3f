"""The adaptive, LRU and LFU policies, the policies' hooks, and how the stores use them (the learned policy:
tests/test_learned.py)."""

from __future__ import annotations

import random

import pytest

from moe_l2.cache.policy import DEFAULT_POLICY, LRU, AdaptiveLRFU, LFUDecay, make_policy
from moe_l2.cache.replay import Task, replay_layer
from moe_l2.cache.store import LayerStore


def hit_rate(policy_name: str, batches, n_experts: int, slots: int) -> float:
    r = replay_layer(Task(0, slots, policy_name, batches, n_experts))
    return r["hits"] / r["lookups"]


def skewed_with_scans(seed=0, tokens=3000, n_experts=32):
    """A stable hot set plus bursts of one-off experts: frequency should win, LRU is flushed by bursts."""
    rng = random.Random(seed)
    out = []
    for t in range(tokens):
        if t % 50 < 10:
            out.append(tuple(rng.sample(range(8, n_experts), 2)))
        else:
            out.append(tuple(rng.sample(range(8), 2)))
    return out


def drifting_working_set(seed=0, tokens=3000, n_experts=32):
    """A small working set that moves every 60 tokens: recency should win, old counts mislead."""
    rng = random.Random(seed)
    out = []
    for t in range(tokens):
        base = (t // 60 * 5) % n_experts
        out.append(tuple(rng.sample([(base + i) % n_experts for i in range(6)], 2)))
    return out


def test_the_store_tells_a_policy_its_capacity():
    policy = make_policy("adaptive")
    LayerStore(16, 5, policy)
    assert policy.capacity == 5
    assert make_policy("adaptive", capacity=3).capacity == 3
    learned = make_policy(DEFAULT_POLICY, 3, 16)
    LayerStore(16, 5, learned)
    assert DEFAULT_POLICY == "learned" and learned.capacity == 5


def test_adaptive_follows_frequency_when_frequency_wins():
    batches = skewed_with_scans()
    policy = AdaptiveLRFU(capacity=8)
    for batch in batches:
        for e in batch:
            policy.access(e)
    assert policy.half_life >= 1024
    assert hit_rate("adaptive", batches, 32, 8) > hit_rate("lru", batches, 32, 8) + 0.02


def test_adaptive_follows_recency_when_the_working_set_drifts():
    batches = drifting_working_set()
    policy = AdaptiveLRFU(capacity=6)
    for batch in batches:
        for e in batch:
            policy.access(e)
    assert policy.half_life <= 64
    adaptive, lfu = hit_rate("adaptive", batches, 32, 6), hit_rate("lfu", batches, 32, 6)
    assert adaptive > lfu + 0.05 and adaptive >= hit_rate("lru", batches, 32, 6) - 0.02


def test_adaptive_learns_its_capacity_from_inserts_when_not_told():
    # The client's L0 pool builds policies without a capacity: inserts and evictions show it.
    policy = make_policy("adaptive")
    for e in range(4):
        policy.insert(e)
    policy.evict(0)
    policy.insert(5)
    assert policy.capacity == 4


def test_prior_ranks_experts_nobody_has_seen_yet():
    policy = AdaptiveLRFU(capacity=4)
    policy.set_prior([0.1, 0.5, 0.0, 0.4])
    assert policy.victim([0, 1, 3]) == 0 and policy.victim([1, 2, 3]) == 2
    # The prior is a past, not a pin: enough new traffic overrides it.
    for _ in range(5000):
        policy.access(0)
    assert policy.victim([0, 1]) == 1


def test_scores_stay_finite_over_long_runs():
    policy = AdaptiveLRFU(capacity=4)
    rng = random.Random(1)
    for _ in range(60000):
        policy.access(rng.randrange(16))
    assert all(all(v == v and v < float("inf") for v in s.values()) for s in policy._scores)
    assert policy.victim(range(16)) in range(16)


def test_every_policy_runs_in_the_store_with_pins():
    for name in ("adaptive", "lru", "lfu", "learned"):
        store = LayerStore(16, 4, make_policy(name, 4, 16))
        store.pin([0], "permanent")
        for e in range(16):
            store.observe([e])
            r = store.reserve(e)
            if r is not None:
                store.commit(r)
        assert store.slot(0) >= 0 and store.resident == 4


def test_bad_half_lives_are_refused():
    with pytest.raises(ValueError, match="positive"):
        AdaptiveLRFU(half_lives=(0, 10))


def test_lru_and_lfu_unchanged():
    assert isinstance(make_policy("lru"), LRU) and isinstance(make_policy("lfu"), LFUDecay)


@pytest.mark.parametrize("name", ["adaptive", "lru", "lfu"])
def test_a_policy_restored_from_its_state_decides_as_the_original(name):
    """Through msgpack, as the daemon's heat file carries it: the same ranking, and the same victims after the
    same further accesses."""
    import msgpack

    from moe_l2.cache.policy import restored_policy

    rng = random.Random(3)
    original = make_policy(name, 6)
    for batch in skewed_with_scans(tokens=400, n_experts=16):
        for e in batch:
            original.access(e)
    state = msgpack.unpackb(msgpack.packb(original.state()))
    copy = restored_policy(name, state, 16, 6)
    assert copy.state() == original.state()
    assert copy.hottest(range(16)) == original.hottest(range(16))
    for _ in range(300):
        e = rng.randrange(16)
        original.access(e)
        copy.access(e)
        candidates = rng.sample(range(16), 6)
        assert copy.victim(candidates) == original.victim(candidates)


@pytest.mark.parametrize("name, change, words", [
    ("lru", lambda s: s.update(last=[[16, 1]]), "not one of 0..15"),
    ("lru", lambda s: s.update(last=[[1, 1], [1, 2]]), "twice"),
    ("lru", lambda s: s.update(clock=-1), "clock"),
    ("lfu", lambda s: s.update(half_life=1.0), "half-life"),
    ("lfu", lambda s: s.update(score=[[2, float("inf")]]), "finite"),
    ("adaptive", lambda s: s.update(best=6), "best"),
    ("adaptive", lambda s: s.update(half_lives=[1.0]), "half-lives"),
    ("adaptive", lambda s: s.update(hits=[0.0]), "one per half-life"),
    ("adaptive", lambda s: s["scores"][0].append([3, float("nan")]), "finite"),
    ("adaptive", lambda s: s.update(inc=[1e300] * 6), "adaptive inc"),  # its next access would overflow
    ("adaptive", lambda s: s.update(shadows=[list(range(17))] * 6), "at most 16"),
    ("adaptive", lambda s: s.update(extra=1), "fields"),
    ("adaptive", lambda s: s.clear(), "fields"),
])
def test_a_damaged_or_hostile_policy_state_is_refused_with_what_is_wrong(name, change, words):
    from moe_l2.cache.policy import restored_policy

    policy = make_policy(name, 4)
    for e in (1, 2, 1):
        policy.access(e)
    state = policy.state()
    change(state)
    with pytest.raises(ValueError, match=words):
        restored_policy(name, state, 16, 4)


def test_a_restored_adaptive_policy_keeps_the_best_of_its_shadows_that_fit_a_smaller_store():
    from moe_l2.cache.policy import restored_policy

    policy = make_policy("adaptive", 8)
    for e in range(8):
        for _ in range(e + 1):
            policy.access(e)
    smaller = restored_policy("adaptive", policy.state(), 16, 3)
    assert all(shadow == {5, 6, 7} for shadow in smaller._shadows)
