"""Side rows: next-layer guesses held past the demand ceiling (client/layerpool.py, client/prefetcher.py). A wrong
guess never costs a demand hit, a right one is promoted by a swap of rows without a read or a copy, a row that
left demand takes no guess before the next synchronize, and the budget counts the side rows."""

from __future__ import annotations

import random
from dataclasses import astuple, fields

import pytest

from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool, TierCounts
from moe_l2.client.prefetcher import side_rows
from moe_l2.lm.streamed_lm import StreamedLM

from .conftest import assert_resident_exact, budget_for, greedy, stats, wait_for


def tally(counts: TierCounts) -> tuple[int, ...]:
    """The counts of lookups and bytes, without the timings (which differ from run to run)."""
    return tuple(v for f, v in zip(fields(counts), astuple(counts)) if not f.name.endswith("_s"))


def residents(pool: ExpertPool) -> dict[int, frozenset[int]]:
    n = pool.files.n_experts
    return {layer: frozenset(e for e in range(n) if lp.holds(e)) for layer, lp in pool.layers.items()}


def demand_rows(pool: ExpertPool, layer: int) -> set[int]:
    """The rows demand residents hold: the layer's (per-layer rows are numbered per layer), or every layer's
    with a shared L0."""
    held = residents(pool)
    return {row for other in (pool.layers if pool.shared_l0 else [layer])
            for row in pool.layers[other].rows_for(sorted(held[other]))}


def tokens(files, n: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    # A skewed choice, so that L0 has hits to lose.
    weights = [1 / (1 + e) for e in range(files.n_experts)]
    out = []
    for _ in range(n):
        token = []
        for _ in range(files.n_layers):
            picks: set[int] = set()
            while len(picks) < files.top_k:
                picks.add(rng.choices(range(files.n_experts), weights)[0])
            token.append(sorted(picks))
        out.append(token)
    return out


@pytest.mark.parametrize("shared,grow", [(False, False), (True, False), (False, True), (True, True)])
def test_a_guess_that_is_always_wrong_never_evicts_a_demand_row(model_files, shared, grow):
    """An adversary that knows the next layer's picks and guesses anything else: the demand residents and the
    tiers of every lookup are those of the same pool without prefetch, step by step."""
    k, n = model_files.top_k, model_files.n_experts
    capacity = 2 * k if shared else k + 2
    off = ExpertPool(model_files, capacity, shared_l0=shared, grow=grow)
    on = ExpertPool(model_files, capacity, shared_l0=shared, grow=grow, prefetch=True)
    try:
        assert on.ceiling == off.ceiling + side_rows(k) * (1 if shared else model_files.n_layers)
        for token in tokens(model_files, 40, seed=7):
            for layer, experts in enumerate(token):
                assert tally(on.fetch(layer, experts)) == tally(off.fetch(layer, experts))
                assert residents(on) == residents(off)
                if layer + 1 < len(token):
                    wrong = [e for e in range(n) if e not in token[layer + 1]]
                    random.Random(layer).shuffle(wrong)
                    on.prefetch(layer + 1, wrong[:k])
                    on.wait_prefetches()
        c = on.prefetch_counts
        assert c.issued > 0 and c.useful == 0 and c.right == 0
        assert c.issued == c.wasted + sum(len(lp.prefetched()) for lp in on.layers.values())
        assert tally(on.counts) == tally(off.counts)
        assert on.rows_held() == off.rows_held()
        for layer, held in residents(on).items():
            assert_resident_exact(on, model_files, layer, held)
    finally:
        on.close()
        off.close()


def promote_and_check(pool: ExpertPool, files, layer: int, guesses: list[int]) -> set[int]:
    """Prefetch right guesses into `layer` and fetch them: L0 hits, no read, no copy, their side rows now the
    demand rows. Returns the rows that left demand."""
    lp = pool.layers[layer]
    pool.prefetch(layer, guesses)
    pool.wait_prefetches()
    side = [lp.row_of(e) for e in guesses]
    before = demand_rows(pool, layer)
    counts = pool.fetch(layer, guesses)
    assert (counts.l0_hits, counts.l2_hits, counts.l3_reads, counts.bytes_copied, counts.bytes_read) == \
        (len(guesses), 0, 0, 0, 0)
    assert lp.rows_for(guesses) == side  # swapped into demand, not copied
    assert_resident_exact(pool, files, layer, guesses)
    return before - demand_rows(pool, layer)


@pytest.mark.parametrize("shared", [False, True])
def test_a_right_guess_is_promoted_by_a_swap_and_the_rows_it_freed_wait_for_a_synchronize(model_files, shared):
    k = model_files.top_k
    pool = ExpertPool(model_files, k, shared_l0=shared, prefetch=True)
    try:
        pool.fetch(0, list(range(k)))
        pool.fetch(1, list(range(k)))
        demoted = promote_and_check(pool, model_files, 1, list(range(k, 2 * k)))
        assert len(demoted) == k and pool.prefetch_counts.useful == k
        # Read once, by the worker: the fetch that promoted them read nothing (promote_and_check).
        assert pool.prefetch_counts.bytes_read == k * model_files.layout.nbytes
        # The rows that left demand may still be read by work queued before it: the next guesses go elsewhere.
        pool.prefetch(1, list(range(2 * k, 3 * k)))
        pool.wait_prefetches()
        lp = pool.layers[1]
        assert not {lp.row_of(e) for e in range(2 * k, 3 * k)} & demoted
        pool.fetch(0, list(range(k, 2 * k)))  # misses: the pool synchronizes
        assert promote_and_check(pool, model_files, 1, list(range(2 * k, 3 * k)))
        pool.prefetch(1, list(range(3 * k, 4 * k)))
        pool.wait_prefetches()
        assert {lp.row_of(e) for e in range(3 * k, 4 * k)} == demoted  # synchronized since: writable again
        assert_resident_exact(pool, model_files, 1, range(3 * k, 4 * k))
    finally:
        pool.close()


def test_with_a_daemon_a_right_guess_is_copied_once_by_the_worker_and_never_by_the_fetch(daemon_factory, model_dir,
                                                                                        model_files):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    k = model_files.top_k
    client = L2Client(model_files, daemon.socket, wait_s=5)
    warm = ExpertPool(model_files, k, client)
    copying = ExpertPool(model_files, k, client, lend=False, prefetch=True)
    try:
        for expert in range(0, model_files.n_experts, k):  # every expert read once: the daemon loads it into L2
            warm.fetch(1, list(range(expert, expert + k)))
        guesses = list(range(k, 2 * k))
        copying.fetch(0, list(range(k)))
        # Layer 1's experts (warm's reads) and layer 0's first k (copying's): the guesses are in L2.
        wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == model_files.n_experts + k, what="L2 loads")
        promote_and_check(copying, model_files, 1, guesses)
        pf = copying.prefetch_counts
        assert (pf.issued, pf.bytes_copied, pf.bytes_read) == (k, k * model_files.layout.nbytes, 0)
    finally:
        copying.close()
        warm.close()
        client.close()


@pytest.mark.parametrize("with_daemon", [False, True])
def test_tokens_are_the_whole_models_with_a_shared_l0_and_side_rows(daemon_factory, model_dir, model_files, whole,
                                                                    landing, with_daemon):
    model, tokenizer = whole
    expected = greedy(model, tokenizer)
    socket = None
    if with_daemon:  # L2 for half the experts, computed on in place: the guesses it lacks go to side rows
        socket = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts // 2))).socket
    with StreamedLM(model_dir, l0_slots=2 * model_files.top_k, shared_l0=True, daemon=with_daemon, socket=socket,
                    client_wait_s=5, prefetch="router", load_through_ms=5.0) as lm:
        assert greedy(lm.model, lm.tokenizer) == expected
        c = lm.pool.prefetch_counts
        assert c.issued > 0 and c.useful > 0
        assert c.issued == c.useful + c.wasted + sum(len(lp.prefetched()) for lp in lm.pool.layers.values())


def test_the_side_rows_come_out_of_the_l0_budget(model_dir, model_files):
    per_slot = model_files.layout.stride * model_files.n_layers
    budget = 12 * per_slot
    side = side_rows(model_files.top_k)
    with StreamedLM(model_dir, l0_budget=budget, daemon=False, shared_l0=False, prefetch="router") as lm:
        assert lm.pool.capacity == 12 - side and lm.pool.side_rows == side
        assert lm.pool.ceiling_bytes == budget == lm.pool.nbytes
    with pytest.raises(ValueError, match="side rows"):
        StreamedLM(model_dir, l0_budget=(side + model_files.top_k - 1) * per_slot, daemon=False, shared_l0=False,
                   prefetch="router")
