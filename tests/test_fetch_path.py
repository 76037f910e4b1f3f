"""The pool's fetch path (client/pool.py): the experimental options' code (growth, autopin, next-layer prefetch) runs
only where they are on, and each fetch is one lookup, reported to the daemon once."""

from __future__ import annotations

import pytest

from moe_l2.cache.heat import Heat
from moe_l2.client.connection import L2Client
from moe_l2.client.layerpool import AutopinLayerPool, LayerPool, Rows
from moe_l2.client.pool import ExpertPool
from moe_l2.client.prefetcher import Prefetcher

from .conftest import assert_resident_exact

# What the experimental options run; none of it may run on the fetch path while they are off.
EXPERIMENTAL = [(Prefetcher, "before_fetch"), (Prefetcher, "take_rows"), (Prefetcher, "settle_all"),
                (LayerPool, "prefetched"), (LayerPool, "has_guess"), (LayerPool, "promote"),
                (LayerPool, "drop_guesses"), (Rows, "would_grow"), (Rows, "_resize"), (Heat, "add")]


@pytest.fixture
def experiments_forbidden(monkeypatch):
    def forbid(cls, name):
        def called(*args, **kwargs):
            raise AssertionError(f"{cls.__name__}.{name} ran on the fetch path with the experimental options off")
        monkeypatch.setattr(cls, name, called)

    return lambda: [forbid(cls, name) for cls, name in EXPERIMENTAL]


def _spy_reports(monkeypatch, client) -> list[tuple]:
    reports = []
    real = client.report

    def report(layer, hits, misses, routed, now=False, given=(), folded=False):
        reports.append((layer, sorted(hits), sorted(misses), now))
        real(layer, hits, misses, routed, now, given, folded)

    monkeypatch.setattr(client, "report", report)
    return reports


def test_with_the_experimental_options_off_a_fetch_runs_none_of_their_code(model_files, experiments_forbidden):
    with ExpertPool(model_files, model_files.top_k + 2) as pool:
        assert pool._ahead is None and all(type(lp) is LayerPool for lp in pool.layers.values())
        experiments_forbidden()
        for layer in range(model_files.n_layers):
            for start in range(0, model_files.n_experts, 3):  # misses that evict, and hits
                batch = [(start + i) % model_files.n_experts for i in range(model_files.top_k)]
                pool.fetch(layer, batch)
                pool.fetch(layer, batch[:2])
                assert_resident_exact(pool, model_files, layer, batch)


def test_with_them_off_a_borrow_is_one_lookup_reported_once(running_daemon, model_files, monkeypatch,
                                                             experiments_forbidden):
    """Load-through reports the misses at once and waits for them: that report is the lookup's only one."""
    with L2Client(model_files, running_daemon.socket, wait_s=5) as client, \
            ExpertPool(model_files, model_files.top_k, client, load_through_s=5.0, shared_l0=True) as pool:
        assert pool.lend and client._prefetch.source is None  # no prefetch counts to send with every report
        experiments_forbidden()
        reports = _spy_reports(monkeypatch, client)
        counts, loan = pool.borrow(0, [0, 1])
        assert reports == [(0, [], [0, 1], True)]
        assert counts.l2_awaited == 2 and sorted(loan.experts) == [0, 1]
        counts, loan = pool.borrow(0, [0, 1, 1])  # lent at once
        assert reports[1:] == [(0, [0, 1], [], False)] and counts.l2_lent == 2 and counts.l2_awaited == 0
        counts = pool.fetch(1, [2, 3])  # copied once loaded through
        assert reports[2:] == [(1, [], [2, 3], True)] and counts.l2_awaited == 2
        assert_resident_exact(pool, model_files, 1, [2, 3])
        pool.fetch(1, [2, 3])
        assert reports[3:] == [(1, [], [], False)]


def test_with_them_on_the_pool_is_built_with_their_parts(model_files):
    k = model_files.top_k
    with ExpertPool(model_files, 2 * k, grow=True, autopin=True, prefetch=True) as pool:
        lp = pool.layers[0]
        assert pool._ahead is pool._prefetcher and type(lp) is AutopinLayerPool and lp.rows.grows
        pool.fetch(0, list(range(k)))
        pool.prefetch(0, list(range(k, 2 * k)))
        pool.wait_prefetches(0)
        assert pool.fetch(0, list(range(k, 2 * k))).l0_hits == k  # the guesses, promoted
        assert pool.prefetch_counts.useful == k and lp.rows.held == 2 * k and not lp.rows.grows
        assert_resident_exact(pool, model_files, 0, range(2 * k))
