"""The slot store's bookkeeping and the eviction policies, without shared memory."""

import pytest

from moe_l2.cache.policy import LRU, LFUDecay, make_policy
from moe_l2.cache.store import LayerStore


def fill(store, expert):
    r = store.reserve(expert)
    store.commit(r)
    return r


def test_lru_evicts_least_recently_used():
    store = LayerStore(8, 3, LRU())
    for e in (0, 1, 2):
        fill(store, e)
    store.observe([0])
    r = fill(store, 3)
    assert r.evicted == 1
    assert store.slot(1) == -1 and store.slot(3) == r.slot


def test_lfu_keeps_frequent_experts_and_decays_old_counts():
    policy = LFUDecay(half_life=4)
    store = LayerStore(8, 2, policy)
    fill(store, 0)
    fill(store, 1)
    for _ in range(5):
        store.observe([0])
    assert fill(store, 2).evicted == 1
    # Many accesses ago expert 0 was hot; after enough decay a steadily used expert overtakes it.
    for _ in range(40):
        store.observe([2])
    assert policy.victim([0, 2]) == 0


def test_reserved_slots_are_not_evicted_or_reused_and_dedupe():
    store = LayerStore(8, 2, LRU())
    a = store.reserve(0)
    b = store.reserve(1)
    assert store.reserve(0) is None  # in flight: not loaded twice
    assert store.reserve(2) is None  # both slots loading: nothing to evict
    store.commit(a)
    store.abort(b)
    assert store.slot(1) == -1 and not store.has(1)
    assert store.reserve(2).slot == b.slot


def test_pins_are_never_evicted_and_capped():
    store = LayerStore(8, 4, LRU())
    pinned, refused = store.pin([0, 1, 2], "permanent")
    assert pinned == [0, 1] and refused == [2]  # half the slots at most
    assert store.pins("permanent") == [0, 1] and store.pins("domain") == []
    for e in (0, 1, 2, 3):
        fill(store, e)
    for e in (4, 5, 6):
        assert fill(store, e).evicted not in (0, 1)
    store.unpin([0], "permanent")
    assert store.pins("permanent") == [1] and store.pin_count == 1
    store.observe([1])
    assert fill(store, 7).evicted in (0, 6, 5)


def test_out_of_range_expert_is_refused():
    store = LayerStore(8, 2, LRU())
    with pytest.raises(IndexError, match="0..7"):
        store.reserve(8)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="lru, lfu"):
        make_policy("fifo")


def test_shrink_takes_free_slots_then_victims_never_pins_or_loads_and_grow_gives_them_back():
    store = LayerStore(8, 6, LRU())
    for e in (0, 1, 2, 3):
        fill(store, e)
    loading = store.reserve(4)
    store.pin([0], "permanent")
    store.observe([1])
    taken = store.shrink(2)
    # One free slot, then LRU victims 2, 3, 1; the pin (0) and the load in flight (4) stay: the floor is
    # pins + 1, and the load's slot cannot be taken, so two slots remain.
    assert [r.evicted for r in taken] == [-1, 2, 3, 1]
    assert store.capacity == 2 and store.residents() == [0] and store.has(4)
    assert store.reserve(5) is None  # no room: the remaining slots are pinned or loading
    store.commit(loading)
    assert store.shrink(0) == [] and store.capacity == 2  # never below the pins + 1
    given = store.off_slots(10)
    assert given == [r.slot for r in reversed(taken)] and store.capacity == 2  # offered, not given yet
    assert store.off_slots(3) == given[:1]
    store.grow(given)
    assert store.capacity == 6 and store.off_slots(10) == []
    for e in (5, 6, 7, 1):
        fill(store, e)
    assert store.residents() == [0, 1, 4, 5, 6, 7]
