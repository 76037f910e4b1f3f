"""Autopin (src/moe_l2/cache/heat.py, client/layerpool.py): each layer's hottest experts pinned in L0, so that a burst
of cold experts cannot flush them; chosen again as heat decays; no device sync of its own; tokens as the model
loaded whole; replay --autopin models it."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from moe_l2.cache.heat import Heat, pin_limit
from moe_l2.cache.replay import replay
from moe_l2.cache.trace import TraceWriter, read_traces
from moe_l2.cli import main
from moe_l2.client.options import OptionError
from moe_l2.client.pool import ExpertPool
from moe_l2.lm.streamed_lm import StreamedLM

from .conftest import PREFETCH_TEXT, assert_resident_exact


def _warm_then_burst(pool: ExpertPool, files, rng: random.Random) -> None:
    """Experts 0 and 1 in every token with two others for a while, then every other expert, two at a time."""
    for _ in range(200):
        pool.fetch(0, [0, 1, *rng.sample(range(2, files.n_experts), files.top_k - 2)])
    cold = list(range(2, files.n_experts))
    for i in range(0, len(cold), 2):
        pool.fetch(0, cold[i:i + 2])


def test_pinned_experts_survive_a_burst_of_cold_ones(model_files):
    held = {}
    for autopin in (False, True):
        with ExpertPool(model_files, 8, autopin=autopin, layers=[0]) as pool:
            _warm_then_burst(pool, model_files, random.Random(5))
            lp = pool.layers[0]
            held[autopin] = {e for e in (0, 1) if lp.holds(e)}
            if autopin:
                assert lp.autopinned == {0, 1} and len(lp.autopinned) <= pin_limit(8, model_files.top_k)
                assert_resident_exact(pool, model_files, 0, [0, 1])
    assert held == {False: set(), True: {0, 1}}  # LRU alone lets the burst flush them


def test_autopin_releases_experts_as_they_cool(model_files):
    with ExpertPool(model_files, 8, autopin=True, layers=[0]) as pool:
        rng = random.Random(6)
        _warm_then_burst(pool, model_files, rng)
        lp = pool.layers[0]
        assert {0, 1} <= lp.autopinned
        for _ in range(1500):  # eight half-lives without 0 or 1: others take the heat, spread evenly
            pool.fetch(0, rng.sample(range(2, model_files.n_experts), model_files.top_k))
        assert not lp.autopinned & {0, 1}
        assert len(lp.autopinned) <= pin_limit(8, model_files.top_k)


def test_autopins_give_way_to_a_batch_that_needs_their_rows(model_files):
    with ExpertPool(model_files, 6, autopin=True, layers=[0]) as pool:
        for _ in range(64):
            pool.fetch(0, [0, 1, 2, 3])
        lp = pool.layers[0]
        assert lp.autopinned  # pin_limit(6, 4) = 1
        pool.fetch(0, [10, 11, 12, 13, 14, 15])  # the whole pool: autopin's pin is evicted, no PoolTooSmall
        assert_resident_exact(pool, model_files, 0, [10, 11, 12, 13, 14, 15])
        assert not lp.autopinned


def test_heat_pins_only_experts_well_above_an_even_share():
    heat = Heat(8, limit=3, half_life=64, every=4)
    chose = [heat.add(range(8)) for _ in range(16)]
    assert chose == [False, False, False, True] * 4 and heat.hot == frozenset()  # a flat layer pins nothing
    for _ in range(64):
        heat.add([5, 6])
    assert heat.hot == {5, 6}


@pytest.fixture(scope="module")
def expected(model_dir):
    from mlx_lm import load

    whole, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(PREFETCH_TEXT)[:24]
    return ids, [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=16,
                                                  prefill_step_size=8)]


def _syncs_and_tokens(model_dir, ids, monkeypatch, **fields):
    """Tokens of a streamed run and how often it asked MLX to wait for the device (eval, async_eval,
    synchronize; the router's host copy is one per layer either way)."""
    calls = {"n": 0}
    for name in ("eval", "async_eval", "synchronize"):
        real = getattr(mx, name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mx, name, counted)
    with StreamedLM(model_dir, daemon=False, record=True, **fields) as lm:
        calls["n"] = 0
        tokens = [r.token for r in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=16,
                                                   prefill_step_size=8)]
        pinned = sum(len(lp.autopinned) for lp in lm.pool.layers.values())
    monkeypatch.undo()
    return tokens, calls["n"], pinned


def test_autopin_adds_no_sync_and_gives_the_whole_models_tokens(model_dir, model_files, expected, monkeypatch):
    ids, want = expected
    # Every expert fits: the residents, hence the pool's own waits, are the same with autopin on and off.
    off = _syncs_and_tokens(model_dir, ids, monkeypatch, l0_slots=model_files.n_experts)
    on = _syncs_and_tokens(model_dir, ids, monkeypatch, l0_slots=model_files.n_experts, l0_autopin=True)
    assert off[0] == on[0] == want
    assert on[1] == off[1] > 0
    assert off[2] == 0 and on[2] > 0  # autopin counted heat and pinned, at no sync of its own
    # Tight, so that pins decide evictions: still the whole model's tokens.
    tight = _syncs_and_tokens(model_dir, ids, monkeypatch, l0_slots=model_files.top_k + 2, l0_autopin=True)
    assert tight[0] == want


def test_autopin_needs_per_layer_rows(model_dir, model_files):
    with pytest.raises(OptionError, match="needs per-layer"):
        StreamedLM(model_dir, daemon=False, l0_autopin=True, shared_l0=True).close()
    with pytest.raises(ValueError, match="l0_autopin needs per-layer rows"):
        ExpertPool(model_files, 8, shared_l0=True, autopin=True)


def test_replay_models_autopin_as_the_pool_runs_it(tmp_path, model_files, capsys):
    """Replay's LRU+autopin over one layer's stream hits as often as a real pool with autopin, one expert a
    token (where L0's LRU and replay's loads are the same process); both pin one expert (pin_limit of 6 rows)."""
    rng = random.Random(2)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, model="toy", n_layers=1, n_experts=model_files.n_experts, top_k=1) as w:
        for i in range(4):
            w.begin(seq=f"s{i}", domain="d", prompt=f"question {i}")
            for t in range(150):
                # Expert 0 hot throughout; runs of cold experts between.
                w.add_token([[0 if t % 10 < 2 else rng.randrange(1, model_files.n_experts)]])
            w.end()
    traces = read_traces([path])
    r = replay(traces, slots=[6], policy="lru", compare=(), belady=False, autopin=True, order="blocked")
    assert pin_limit(6, 1) == pin_limit(6, model_files.top_k) == 1
    with ExpertPool(model_files, 6, autopin=True, layers=[0]) as pool:
        for s in traces.sequences:
            for token in s.experts:
                pool.fetch(0, token[0])
        assert r.capacities[0].policies["lru+autopin"].hits == pool.counts.l0_hits
    # Pinned, expert 0 never misses again: more hits than LRU's.
    assert r.capacities[0].policies["lru+autopin"].hits > r.capacities[0].policies["lru"].hits
    assert main(["replay", "--trace", str(path), "--slots", "6", "--autopin", "--jobs", "1"]) == 0
    assert "lru+autopin" in capsys.readouterr().out
