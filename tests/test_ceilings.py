"""Per-layer L0 ceilings (src/moe_l2/cache/ceilings.py): hit curves against a real pool's hits, the split, the
profile's curves, the option end to end (tokens against the model loaded whole) and replay --ceilings."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from moe_l2.cache.ceilings import hit_curves, split_rows
from moe_l2.cache.profile import Profile, ProfileError
from moe_l2.cache.replay import replay
from moe_l2.cache.trace import read_traces
from moe_l2.cli import main
from moe_l2.lm.generation import encode_prompt
from moe_l2.client.options import OptionError
from moe_l2.client.pool import ExpertPool
from moe_l2.lm.streamed_lm import StreamedLM

from .conftest import synthetic_trace


def test_hit_curves_are_a_real_lru_pools_hits_at_every_capacity(model_files):
    rng = random.Random(3)
    # Skewed, one expert a token: L0's LRU is then exactly a stack algorithm.
    stream = [[min(int(rng.expovariate(0.25)), model_files.n_experts - 1)] for _ in range(300)]
    curve = hit_curves([stream], model_files.n_experts)[0]
    assert curve == sorted(curve) and 0 < curve[0] < curve[-1] < len(stream)
    for capacity in (1, 2, 5, 9, model_files.n_experts):
        with ExpertPool(model_files, capacity) as pool:
            for picked in stream:
                pool.fetch(0, picked)
            assert pool.counts.l0_hits == curve[capacity - 1], capacity


def test_hit_curves_of_several_experts_a_token_stay_within_a_percent_of_the_pools(model_files):
    rng = random.Random(4)
    stream = [rng.sample(range(model_files.n_experts), model_files.top_k) if rng.random() < 0.3 else
              rng.sample(range(6), model_files.top_k) for _ in range(200)]
    curve = hit_curves([stream], model_files.n_experts)[0]
    for capacity in (model_files.top_k, 7, 10):
        with ExpertPool(model_files, capacity) as pool:
            for picked in stream:
                pool.fetch(0, picked)
            assert abs(pool.counts.l0_hits - curve[capacity - 1]) <= 0.01 * curve[capacity - 1], capacity


def test_split_rows_follows_the_gains_and_keeps_floor_ceiling_and_total():
    flat = [list(range(1, 9))] * 3
    assert split_rows(flat, 12, 2, 8) == [4, 4, 4]  # curves that gain alike split alike
    steep, none = [10 * c for c in range(1, 9)], [5] * 8
    assert split_rows([none, steep, none], 12, 2, 8) == [2, 8, 2]
    # Gains that come only after a few rows (lookahead): layer 0 gains 60 at 5 rows, layer 1 one a row.
    late, gentle = [0, 0, 0, 0, 60, 60, 60, 60], list(range(1, 9))
    assert split_rows([late, gentle], 8, 2, 8) == [5, 3]
    assert split_rows([steep, steep], 100, 2, 8) == [8, 8]  # no more than the layers hold
    with pytest.raises(ValueError, match="cannot give each"):
        split_rows(flat, 5, 2, 8)


def test_a_profile_from_traces_keeps_its_curves_and_refuses_bad_ones(tmp_path):
    traces = read_traces([synthetic_trace(tmp_path / "t.jsonl", n_layers=2, n_experts=8, top_k=2)])
    profile = Profile.from_traces(traces)
    assert profile.l0_curves == hit_curves([[t[layer] for s in traces.sequences for t in s.experts]
                                            for layer in range(2)], 8)
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.l0_curves == profile.l0_curves
    rows = again.l0_ceilings([0, 1], 4)
    assert sum(rows.values()) == 8 and all(2 <= n <= 8 for n in rows.values())
    data = json.loads((tmp_path / "p.json").read_text())
    data["l0_curves"][1][3] = data["l0_curves"][1][2] - 1
    with pytest.raises(ProfileError, match="must not fall"):
        Profile.from_json(data)
    del data["l0_curves"]
    with pytest.raises(ProfileError, match="no L0 hit curves"):
        Profile.from_json(data).l0_ceilings([0, 1], 4)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    from mlx_lm import load

    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, "Per-layer ceilings hold what each layer needs.")
    return ids, [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=12)]


def test_per_layer_ceilings_hold_and_give_the_whole_models_tokens(model_dir, model_files, expected, capsys):
    ids, want = expected
    ceilings = (model_files.top_k, 9, model_files.top_k + 1)
    with StreamedLM(model_dir, l0_ceilings=ceilings, daemon=False, l0_grow=True) as lm:
        assert not lm.pool.shared_l0 and lm.pool.capacities == dict(enumerate(ceilings))
        tokens = [r.token for r in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=12)]
        assert tokens == want
        held = lm.pool.rows_held()
        assert all(held[layer] <= ceilings[layer] for layer in held)
        assert lm.pool.ceiling == sum(ceilings) and lm.pool.capacity == 9
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "3", "--no-daemon",
                 "--l0-ceilings", ",".join(map(str, ceilings)), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["l0_layer_slots"] == list(ceilings) and s["l0_ceiling_bytes"] == sum(ceilings) * lm.pool.row_bytes


def test_a_profiles_ceilings_split_the_budgets_rows(model_dir, model_files, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompt", "a trace of this model", "--max-tokens", "30",
                 "--no-daemon", "--trace-out", str(trace)]) == 0
    assert main(["profile", "--traces", str(trace), "--out", str(tmp_path / "p.json"), "--no-predictor"]) == 0
    profile = Profile.load(tmp_path / "p.json")
    with StreamedLM(model_dir, l0_slots=6, l0_ceilings=tmp_path / "p.json", daemon=False) as lm:
        layers = list(range(model_files.n_layers))
        assert lm.pool.capacities == profile.l0_ceilings(layers, 6)
        assert sum(lm.pool.capacities.values()) == 6 * model_files.n_layers
    capsys.readouterr()
    assert main(["plan", "--model", str(model_dir), "--l0-ceilings", str(tmp_path / "p.json"), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    l0 = planned["plan"]["l0_slots"]
    assert planned["l0_ceilings"] == list(profile.l0_ceilings(layers, l0).values())


@pytest.mark.parametrize("fields, message", [
    ({"l0_ceilings": (4, 4)}, "gives 2 ceilings"),
    ({"l0_ceilings": (4, 99, 4)}, "gets 99 experts"),
    ({"l0_ceilings": (4, 4, 4), "l0_slots": 4}, "without l0_slots"),
    ({"l0_ceilings": (4, 4, 4), "shared_l0": True}, "needs per-layer rows"),
    ({"l0_ceilings": (0, 4, 4)}, "1 or more"),
    ({"l0_ceilings": "/nonexistent/p.json"}, "cannot read profile"),
])
def test_bad_ceilings_say_what_to_give(model_dir, fields, message):
    with pytest.raises(OptionError, match=message):
        StreamedLM(model_dir, daemon=False, **fields).close()


def test_replay_scores_the_split_on_held_out_sequences(tmp_path, capsys):
    traces = read_traces([synthetic_trace(tmp_path / "t.jsonl", n_layers=3, n_experts=8, top_k=2, seqs=10)])
    r = replay(traces, slots=[3], policy="lru", compare=(), belady=False, ceilings=True, train=0.5)
    assert r.sequences == 5 and r.trained_on["sequences"] == 5
    rows = r.ceilings[3]
    assert sum(rows) == 9 and all(2 <= n <= 8 for n in rows)
    split = r.capacities[0].policies["lru+ceilings"]
    assert split.lookups == r.capacities[0].policies["lru"].lookups
    for layer, n in enumerate(rows):  # each layer as a plain LRU of its rows on the same held-out sequences
        alone = replay(traces, slots=[n], policy="lru", compare=(), belady=False, ceilings=True, train=0.5,
                       layers=[layer])
        assert split.per_layer[layer] == alone.capacities[0].policies["lru"].per_layer[0]
    assert main(["replay", "--trace", str(tmp_path / "t.jsonl"), "--slots", "3", "--ceilings", "--jobs", "1"]) == 0
    assert "lru+ceilings" in capsys.readouterr().out
