"""moe-l2 replay and the trace format: the daemon's store over traces, Belady's MIN, determinism, errors."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import random

import pytest

from moe_l2.cache import replay as rp
from moe_l2.cache.policy import BeladyMIN
from moe_l2.cache.profile import Profile
from moe_l2.cache.trace import TraceError, TraceSet, TraceWriter, iter_traces, read_traces
from moe_l2.cli import replay as replay_cmd

from .conftest import shared_trace, synthetic_trace


# ---- the trace format --------------------------------------------------------------------------------


def test_trace_writer_round_trip_whole_and_per_layer(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    with TraceWriter(path, model="m", n_layers=2, n_experts=4, top_k=2) as w:
        w.write([[[0, 1], [2, 3]], [[1, 2], [0, 3]]], seq="a", domain="x", prompt="hi")
        w.begin(seq="b")
        w.add_layer(0, [[3, 0], [1, 2]])  # a prefill of two tokens, layer by layer
        w.add_layer(1, [[1, 0], [2, 3]])
        w.add_layer(0, [0, 1])            # then one decode token
        w.add_layer(1, [2, 3])
        w.end()
    traces = read_traces(path)
    assert (traces.model, traces.n_layers, traces.n_experts, traces.top_k) == ("m", 2, 4, 2)
    a, b = traces.sequences
    assert (a.seq, a.domain, a.prompt, a.experts) == ("a", "x", "hi", [[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    assert (b.domain, b.prompt) == (None, None)
    assert b.experts == [[[3, 0], [1, 0]], [[1, 2], [2, 3]], [[0, 1], [2, 3]]]


def test_trace_writer_refuses_bad_input(tmp_path):
    with TraceWriter(tmp_path / "t.jsonl", model="m", n_layers=2, n_experts=4, top_k=2) as w:
        w.begin(seq="a")
        with pytest.raises(ValueError, match="2 layers"):
            w.add_token([[0, 1]])
        with pytest.raises(ValueError, match="out of range"):
            w.add_token([[0, 9], [1, 2]])
        with pytest.raises(ValueError, match="out of order"):
            w.add_layer(1, [0, 1])


@pytest.mark.parametrize("line, words", [
    ("not json", "line 2: not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"model": "m", "n_layers": 2, "n_experts": 4}', "missing field(s) experts"),
    ('{"model": "m", "n_layers": 0, "n_experts": 4, "experts": []}', "n_layers must be a positive integer"),
    ('{"model": "m", "n_layers": 2, "n_experts": 4, "experts": [[[0, 1]]]}', "each of the 2 layers"),
    ('{"model": "m", "n_layers": 2, "n_experts": 4, "experts": [[[0, 4], [1, 2]]]}', "expert 4 is not an id in 0..3"),
    ('{"model": "m", "n_layers": 2, "n_experts": 4, "experts": [[[1, 1], [1, 2]]]}', "listed twice"),
    ('{"model": "other", "n_layers": 2, "n_experts": 4, "experts": [[[0, 1], [1, 2]]]}', "one file holds one model"),
])
def test_bad_traces_name_the_file_line_and_problem(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    good = {"model": "m", "n_layers": 2, "n_experts": 4, "top_k": 2, "experts": [[[0, 1], [2, 3]]]}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        read_traces(path)
    assert words in str(info.value) and str(path) in str(info.value)


def test_unreadable_and_empty_traces(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_traces(tmp_path / "absent.jsonl.gz")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceError, match="holds no sequence"):
        read_traces(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl.gz").write_bytes(gzip.compress(b'{"model": "m"}\n')[:-12])
    with pytest.raises(TraceError):
        read_traces(tmp_path / "broken.jsonl.gz")


# ---- Belady's MIN ------------------------------------------------------------------------------------


def min_hits(batches, n_experts, slots) -> int:
    return rp.replay_layer(rp.Task(0, slots, "min", batches, n_experts))["hits"]


def brute_force_hits(batches, slots) -> int:
    """The most hits any eviction choices can get, trying them all: hits are counted when a token's experts
    are looked up, then its misses are loaded one by one in any order, each evicting any resident when the
    layer is full (so a later load may evict an earlier one of the same token)."""
    from functools import lru_cache

    def after_loads(cache: frozenset, misses: tuple) -> set[frozenset]:
        finals = set()

        def load(order, i, cache):
            if i == len(order):
                finals.add(cache)
                return
            e = order[i]
            if len(cache) < slots:
                load(order, i + 1, cache | {e})
                return
            for victim in cache:
                load(order, i + 1, (cache - {victim}) | {e})

        for order in itertools.permutations(misses):
            load(order, 0, cache)
        return finals

    @lru_cache(maxsize=None)
    def best(t: int, cache: frozenset) -> int:
        if t == len(batches):
            return 0
        misses = tuple(e for e in batches[t] if e not in cache)
        hits = len(batches[t]) - len(misses)
        return hits + max(best(t + 1, c) for c in after_loads(cache, misses))

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_belady_min_matches_brute_force_on_tiny_traces(seed):
    rng = random.Random(seed)
    n_experts = rng.choice([4, 5, 6])
    slots = rng.choice([2, 3])
    k = rng.choice([1, 2])
    batches = [tuple(rng.sample(range(n_experts), k)) for _ in range(rng.choice([7, 9]))]
    assert min_hits(batches, n_experts, slots) == brute_force_hits(batches, slots)


def test_belady_evicts_the_farthest_next_use():
    policy = BeladyMIN([(0,), (1,), (2,), (1,), (0,), (3,)])
    policy.at(2)
    assert policy.victim([0, 1]) == 0  # 1 comes back at t=3, 0 only at t=4
    assert policy.victim([0, 1, 2]) == 2  # never again
    policy.at(5)
    assert policy.victim([1, 0]) == 0  # neither returns: lowest id, deterministic


def test_replay_layer_runs_a_policy_made_already_instead_of_the_tasks():
    rng = random.Random(3)
    batches = [tuple(rng.sample(range(8), 2)) for _ in range(200)]
    task = rp.Task(0, 3, "lru", batches, 8)
    lru = rp.replay_layer(task)["hits"]
    assert rp.replay_layer(task, BeladyMIN(batches))["hits"] == min_hits(batches, 8, 3) > lru


# ---- replay ------------------------------------------------------------------------------------------


def args_for(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    argv = []
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return parser.parse_args(argv)


def test_replay_is_deterministic_for_a_seed_and_min_is_the_ceiling(tmp_path):
    traces = read_traces(synthetic_trace(tmp_path / "t.jsonl.gz"))
    one = rp.replay(traces, slots=[2, 4], order="interleave", seed=3)
    two = rp.replay(traces, slots=[2, 4], order="interleave", seed=3)
    assert one == two
    other = rp.replay(traces, slots=[2, 4], order="interleave", seed=4)
    assert other.capacities[0].policies["lru"] != one.capacities[0].policies["lru"]
    for entry in one.capacities:
        ceiling = entry.policies["min"].hit_rate
        for name in ("learned", "adaptive", "lru", "lfu"):
            assert entry.policies[name].hit_rate <= ceiling
            assert len(entry.policies[name].per_layer) == traces.n_layers
    assert one.capacities[1].policies["min"].hit_rate >= one.capacities[0].policies["min"].hit_rate


def test_parallel_replay_gives_the_same_numbers(tmp_path):
    traces = read_traces(synthetic_trace(tmp_path / "t.jsonl.gz", seqs=4, tokens=20))
    assert rp.replay(traces, slots=[3], jobs=2) == rp.replay(traces, slots=[3], jobs=1)


def test_blocked_order_groups_domains():
    class S:
        def __init__(self, d):
            self.domain = d

    seqs = [S(d) for d in "abab"]
    assert [s.domain for s in rp.order_sequences(seqs, "blocked")] == list("aabb")
    with pytest.raises(rp.ReplayError, match="interleave or blocked"):
        rp.order_sequences(seqs, "random")


def test_file_order_keeps_the_trace_and_processes_take_turns_token_by_token():
    class S:
        def __init__(self, experts):
            self.experts = experts

    seqs = [S([1, 2, 3]), S([4]), S([5, 6]), S([7, 8])]
    assert rp.order_sequences(seqs, "file") == seqs
    # Client 1 ends its sequence at once and takes the third; client 0 the fourth once its own ends.
    assert rp.take_turns(seqs, 2) == ([1, 4, 2, 5, 3, 6, 7, 8], [0, 1, 0, 1, 0, 1, 0, 0])
    assert rp.take_turns(seqs, 9) == ([1, 4, 5, 7, 2, 6, 8, 3], [0, 1, 2, 3, 0, 2, 3, 0])


def test_loads_are_set_against_mins_and_as_bytes(tmp_path, capsys):
    traces = read_traces(synthetic_trace(tmp_path / "t.jsonl.gz", seqs=4, tokens=30))
    result = rp.replay(traces, slots=[2], compare=("lru",), record_bytes=1000)
    ps = result.capacities[0].policies
    assert ps["min"].misses_vs_min == 1.0 and ps["lru"].misses_vs_min == ps["lru"].loads / ps["min"].loads > 1
    assert ps["lru"].bytes_per_token == 1000 * ps["lru"].loads / result.tokens
    assert rp.replay(traces, slots=[2], compare=("lru",)).capacities[0].policies["lru"].bytes_per_token is None
    with pytest.raises(rp.ReplayError, match="--processes"):
        rp.replay(traces, slots=[2], processes=2, ceilings=True)
    # The gpt-oss-20b trace's records are MXFP4 experts of 2880 x 2880: bytes per token in the table.
    real = tmp_path / "g.jsonl.gz"
    with TraceWriter(real, model="gpt-oss-20b", n_layers=1, n_experts=32, top_k=4) as w:
        w.write([[[0, 1, 2, 3]], [[4, 5, 6, 7]]], seq="s")
    assert replay_cmd.run(args_for(trace=[real], slots="4", jobs=1, compare="lru")) == 0
    assert "disk read per token at 12.6 MiB a record" in capsys.readouterr().out


def test_hints_preload_the_domain_and_help_after_switches(tmp_path):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", n_experts=16, top_k=2, seqs=8, tokens=30)
    traces = read_traces(path)
    profile = Profile.from_traces(traces)
    # The adaptive policy: a hint's domain prior goes into its scores.
    plain = rp.replay(traces, slots=[8], policy="adaptive", order="interleave", seed=1, profile=profile,
                      compare=("lru",))
    hinted = rp.replay(traces, slots=[8], policy="adaptive", order="interleave", seed=1, profile=profile,
                       hints="prompt", compare=("lru",))
    p, h = plain.capacities[0].policies["adaptive"], hinted.capacities[0].policies["adaptive"]
    assert hinted.hint_stats["hints_sent"] == 8 and hinted.hint_stats["predicted_correctly"] == 8
    assert h.preloads > 0 and p.preloads == 0
    assert h.switch_hit_rate > p.switch_hit_rate
    # The comparison policies never get hints.
    assert hinted.capacities[0].policies["lru"] == plain.capacities[0].policies["lru"]


def test_replay_command_prints_a_table_and_json(tmp_path, capsys):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=4, tokens=20)
    assert replay_cmd.run(args_for(trace=[path], slots="2,4", jobs=1, order="blocked")) == 0
    out = capsys.readouterr().out
    assert "hit rate (%) per capacity" in out and "per layer hit rate" in out and "order blocked" in out
    assert replay_cmd.run(args_for(trace=[path], slots="2", jobs=1, json=True, compare="lru")) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["capacities"][0]["policies"]) == {"learned", "lru", "min"}


def test_warm_scores_the_rest_after_a_restart_that_followed_the_train_share(tmp_path, capsys):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=8, tokens=20)
    assert replay_cmd.run(args_for(trace=[path], slots="2,4", jobs=1, warm=True, train=0.25, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["warm"] and data["trained_on"] == {"sequences": 2, "tokens": 40}
    assert data["sequences"] == 6 and data["tokens"] == 120
    for entry in data["capacities"]:
        # Every store but MIN's starts with what it held before the restart, at most a slot each.
        assert entry["policies"]["min"]["preloads"] == 0
        assert all(entry["policies"][n]["preloads"] == 2 * entry["slots"] for n in ("learned", "lru", "adaptive"))


@pytest.mark.parametrize("kw, words, status", [
    ({"slots": "0"}, "a layer holds 1..8 experts", 2),
    ({"slots": "a,b"}, "integers separated by commas", 2),
    ({"hints": True}, "--hints needs --profile", 2),
    ({"moe_layers": "7"}, "layer 7 out of range", 2),
    ({"compare": "fifo"}, "unknown comparison policy", 2),
    ({"warm": True, "autopin": True}, "--warm scores the policies alone", 2),
    ({"profile": "/nonexistent/p.json"}, "cannot read profile", 1),  # the flags are fine, the file is not
])
def test_replay_command_errors(tmp_path, capsys, kw, words, status):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=2, tokens=5)
    assert replay_cmd.run(args_for(trace=[path], jobs=1, **kw)) == status
    assert words in capsys.readouterr().err


def test_replay_moe_layers_and_its_old_name_layers(tmp_path, capsys):
    """--moe-layers (MoE layer numbers, ranges as --layers takes them elsewhere); --layers, its old name, still
    works for one release and says so on stderr; a value that is no layer list is a wrong command line."""
    from moe_l2.cli import main

    path = synthetic_trace(tmp_path / "t.jsonl.gz", n_layers=3, seqs=2, tokens=5)
    base = ["replay", "--trace", str(path), "--slots", "2", "--jobs", "1", "--json"]
    assert main([*base, "--moe-layers", "0,2"]) == 0
    new = capsys.readouterr()
    assert json.loads(new.out)["layers"] == [0, 2] and new.err == ""
    assert main([*base, "--moe-layers", "1-2"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == [1, 2]
    assert main([*base, "--layers", "0,2"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert "--layers is deprecated: use --moe-layers" in old.err
    for bad in (["--moe-layers", "x"], ["--moe-layers", "2-1"], ["--layers", "0", "--moe-layers", "0"]):
        with pytest.raises(SystemExit) as exit:
            main([*base, *bad])
        assert exit.value.code == 2
    assert "MoE layer numbers as ranges" in capsys.readouterr().err


def test_replay_refuses_a_profile_of_another_model(tmp_path, capsys):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=2, tokens=5)
    other = synthetic_trace(tmp_path / "o.jsonl.gz", n_experts=16, seqs=2, tokens=5)
    Profile.from_traces(read_traces(other)).save(tmp_path / "p.json")
    assert replay_cmd.run(args_for(trace=[path], jobs=1, profile=tmp_path / "p.json")) == 1
    assert "2 layers x 16 experts" in capsys.readouterr().err


def test_replay_on_a_slice_of_the_real_traces():
    path = shared_trace("gpt-oss-20b.jsonl.gz")
    seqs = list(itertools.islice(iter_traces(path), 8))
    traces = TraceSet(seqs[0].model, seqs[0].n_layers, seqs[0].n_experts, seqs[0].top_k, seqs, [str(path)])
    result = rp.replay(traces, slots=[8, 16], layers=[0], order="interleave", seed=0)
    for entry in result.capacities:
        ps = entry.policies
        assert all(ps[n].hit_rate <= ps["min"].hit_rate for n in ("learned", "adaptive", "lru", "lfu"))
        assert 0.3 < ps["lru"].hit_rate < 1.0
