"""Budgets that size themselves: the plan arithmetic, `moe-l2 plan`, `moe-l2d --budget auto` and the clients'
default L0.

This machine cannot be made short of memory on purpose, so where a test needs a given amount of memory it
writes a fake reading to the file that MOE_L2_TEST_MEMORY names (moe_l2.plan.read_memory, the documented
test hook); everything else is real: the daemon, its shared memory, the model, the trace replay.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2 import cli
from moe_l2.cache.replay import order_sequences
from moe_l2.cache.trace import read_traces
from moe_l2.lm.streamed_lm import StreamedLM, l0_slots_for
from moe_l2.layout import Geometry, record_stride
from moe_l2.plan import (DEFAULT_KV_BYTES, GiB, MEMORY_FILE_ENV, Memory, ModelSizes, default_l0_slots, os_headroom,
                         plan)
from moe_l2.sizes import parse_size

from .conftest import budget_for, stats, synthetic_trace

SIZES = ModelSizes(n_layers=4, n_experts=32, top_k=4, record_bytes=3 * 4096 + 100, non_expert_bytes=50 << 20)


def fits(p, sizes: ModelSizes) -> bool:
    used = p.os_headroom + p.processes * (sizes.non_expert_bytes + p.kv_per_process + p.l0_per_process) + p.l2_budget
    return used <= p.available


@pytest.fixture
def fake_memory(tmp_path, monkeypatch):
    path = tmp_path / "memory.json"
    monkeypatch.setenv(MEMORY_FILE_ENV, str(path))

    def write(total: int, available: int) -> None:
        path.write_text(json.dumps({"total": total, "available": available}))
    return write


def test_plenty_of_memory_caches_every_expert_with_the_default_l0():
    p = plan(Memory(64 * GiB, 48 * GiB), SIZES, processes=3, shared_l0=False)
    assert p.l2_slots == SIZES.n_experts
    assert p.l2_budget == SIZES.l2_budget_for(SIZES.n_experts)
    assert p.l0_slots == default_l0_slots(SIZES) == 8 and not p.l0_shared
    # L0's rows lie as L2's slots, each record on a page: that, not the record, is what a row takes.
    row = record_stride(SIZES.record_bytes)
    assert p.l0_per_process == 8 * SIZES.n_layers * row and row > SIZES.record_bytes
    # A daemon's clients computing in place (the default): rows in all layers, as many as every layer's default
    # where L2 holds every expert beside them.
    shared = plan(Memory(64 * GiB, 48 * GiB), SIZES, processes=3)
    assert (shared.l0_shared, shared.l0_slots, shared.l0_per_process) == (True, 8 * SIZES.n_layers, 32 * row)
    assert shared.l2_slots == SIZES.n_experts
    assert p.os_headroom == os_headroom(64 * GiB) == int(6.4 * GiB)
    assert p.kv_per_process == DEFAULT_KV_BYTES
    assert fits(p, SIZES)


@pytest.mark.parametrize("shared_l0", [False, True])
@pytest.mark.parametrize("processes", [1, 2, 5])
def test_short_memory_gives_l2_every_byte_left_after_l0_and_never_overcommits(processes, shared_l0):
    fixed = os_headroom(16 * GiB) + processes * (SIZES.non_expert_bytes + DEFAULT_KV_BYTES)
    previous = None
    for extra_slots in range(0, 40, 3):
        available = fixed + extra_slots * SIZES.n_layers * 4 * 4096
        p = plan(Memory(16 * GiB, available), SIZES, processes, shared_l0=shared_l0)
        assert p.l0_slots >= SIZES.top_k  # a token needs all its experts
        if shared_l0 and p.l2_slots < SIZES.n_experts:
            assert p.l0_slots == SIZES.top_k  # L2 first: L0's copies of its records would cost it records
        if p.l2_slots:
            assert fits(p, SIZES)
        if p.l2_slots < SIZES.n_experts:
            # L2 is as large as the rest allows: one more slot per layer would not fit.
            bigger = SIZES.l2_budget_for(p.l2_slots + 1)
            assert available - fixed - processes * p.l0_per_process < bigger
        if previous is not None:  # more memory never shrinks L0, nor L2 but where L0 took a step
            assert p.l0_slots >= previous.l0_slots
            assert p.l2_budget >= previous.l2_budget or p.l0_slots > previous.l0_slots
            assert p.l2_budget + processes * p.l0_per_process >= previous.l2_budget + processes * previous.l0_per_process
        previous = p
    assert previous.l2_slots > 0


def test_no_room_leaves_l2_empty_and_more_processes_leave_less():
    squeezed = plan(Memory(8 * GiB, os_headroom(8 * GiB) + DEFAULT_KV_BYTES), SIZES, processes=1, shared_l0=False)
    assert squeezed.l2_slots == 0 and squeezed.l2_budget == 0 and squeezed.l0_slots == SIZES.top_k
    big = ModelSizes(n_layers=4, n_experts=32, top_k=4, record_bytes=1 << 20, non_expert_bytes=50 << 20)
    memory = Memory(16 * GiB, os_headroom(16 * GiB) + 4 * (big.non_expert_bytes + DEFAULT_KV_BYTES) + (100 << 20))
    one, four = plan(memory, big, 1, shared_l0=False), plan(memory, big, 4, shared_l0=False)
    assert one.l2_slots == big.n_experts and one.l0_slots == default_l0_slots(big)
    assert 0 < four.l2_slots < one.l2_slots and four.l0_slots == big.top_k and fits(four, big)
    # Shared, top-k rows in all: the four processes leave L2 more than top-k rows in every layer do.
    shared = plan(memory, big, 4)
    assert four.l2_slots < shared.l2_slots < one.l2_slots and fits(shared, big)
    with pytest.raises(ValueError, match="at least 1"):
        plan(memory, SIZES, processes=0)


def test_model_sizes_split_the_files_into_experts_and_the_rest(model_files):
    sizes = ModelSizes.of(model_files)
    on_disk = sum(os.path.getsize(p) for p in model_files.files)
    assert sizes.expert_bytes == model_files.n_layers * model_files.n_experts * model_files.layout.nbytes
    assert sizes.non_expert_bytes == on_disk - sizes.expert_bytes > 0


def plan_json(capsys, *args) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def lru_hits(stream, capacity: int) -> int:
    cache, hits = OrderedDict(), 0
    for token in stream:
        for e in token:
            if e in cache:
                hits += 1
                cache.move_to_end(e)
        for e in token:
            if e not in cache:
                cache[e] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def test_plan_command_prints_the_split_and_each_tiers_hit_rate(capsys, fake_memory, model_dir, model_files,
                                                                tmp_path):
    fake_memory(32 * GiB, 20 * GiB)
    out = plan_json(capsys, "--model", str(model_dir), "--processes", "3")
    expected = plan(Memory(32 * GiB, 20 * GiB), ModelSizes.of(model_files), 3)
    assert out["plan"] == expected.to_dict() and out["hit_rates"] is None
    assert (out["plan"]["available_bytes"], out["plan"]["l2_budget_bytes"]) == (20 * GiB, expected.l2_budget)
    trace = synthetic_trace(tmp_path / "t.jsonl", n_layers=model_files.n_layers, n_experts=model_files.n_experts,
                            top_k=model_files.top_k)
    rates = plan_json(capsys, "--model", str(model_dir), "--trace", str(trace))["hit_rates"]
    # Ground truth, computed here: the shared L0 is counted no hits; with every expert in L2
    # (plenty of memory), only each layer's first touch of an expert goes to disk.
    sequences = order_sequences(read_traces([trace]).sequences, "interleave", 0)
    lookups = first = 0
    for layer in range(model_files.n_layers):
        stream = [tuple(token[layer]) for s in sequences for token in s.experts]
        lookups += sum(len(t) for t in stream)
        first += len({e for t in stream for e in t})
    assert rates["l0"] == 0 and rates["l3"] == pytest.approx(first / lookups)
    assert rates["l2"] == pytest.approx(1 - first / lookups)
    assert cli.main(["plan", "--model", str(model_dir), "--trace", str(trace)]) == 0
    table = capsys.readouterr().out
    assert f"L0 {expected.l0_slots} rows in all layers, shared" in table
    assert "expected hit rate" in table
    # The printed budget is a size people read, and buys the daemon exactly the planned slots.
    printed = re.search(r"moe-l2d --budget (\S+)\)", table).group(1)
    assert re.fullmatch(r"[0-9.]+[KMGT]iB", printed), printed
    files = model_files
    bought = Geometry.for_budget(files.n_layers, files.n_experts, files.layout.nbytes, parse_size(printed))
    assert (bought.n_slots, bought.n_short) == (expected.l2_slots, expected.l2_short)


def test_plan_command_replays_l0_at_its_per_layer_ceilings(capsys, fake_memory, model_dir, model_files, tmp_path):
    fake_memory(32 * GiB, 20 * GiB)
    trace = synthetic_trace(tmp_path / "t.jsonl", n_layers=model_files.n_layers, n_experts=model_files.n_experts,
                            top_k=model_files.top_k)
    ceilings = (model_files.top_k, 9, model_files.top_k + 1)
    out = plan_json(capsys, "--model", str(model_dir), "--trace", str(trace),
                    "--l0-ceilings", ",".join(map(str, ceilings)))
    assert out["l0_ceilings"] == list(ceilings)
    # Ground truth: each layer's L0 an LRU of its own ceiling, not of the planned uniform size.
    sequences = order_sequences(read_traces([trace]).sequences, "interleave", 0)
    lookups = hits = 0
    for layer, rows in enumerate(ceilings):
        stream = [tuple(token[layer]) for s in sequences for token in s.experts]
        lookups += sum(len(t) for t in stream)
        hits += lru_hits(stream, rows)
    assert out["hit_rates"]["l0"] == pytest.approx(hits / lookups)
    uniform = plan_json(capsys, "--model", str(model_dir), "--trace", str(trace))["hit_rates"]["l0"]
    assert uniform != pytest.approx(hits / lookups)  # the ceilings changed what L0 is expected to hit


def test_plan_command_refuses_a_trace_of_another_model(capsys, model_dir, tmp_path):
    trace = synthetic_trace(tmp_path / "t.jsonl", n_layers=2, n_experts=8)
    assert cli.main(["plan", "--model", str(model_dir), "--trace", str(trace)]) == 1
    assert "give a trace of this model" in capsys.readouterr().err


def auto_memory(model_files, processes: int = 1, pool: int = 600_000) -> Memory:
    """Just enough memory for the OS, the processes' weights and KV, and `pool` bytes for L0 and L2."""
    sizes = ModelSizes.of(model_files)
    total = 16 * GiB
    return Memory(total, os_headroom(total) + processes * (sizes.non_expert_bytes + DEFAULT_KV_BYTES) + pool)


def test_daemon_budget_auto_serves_the_planned_l2(daemon_factory, fake_memory, model_dir, model_files):
    memory = auto_memory(model_files)
    fake_memory(memory.total, memory.available)
    expected = plan(memory, ModelSizes.of(model_files), 1)
    assert 1 < expected.l2_slots < model_files.n_experts  # the fake memory really limits L2
    daemon = daemon_factory([model_dir], "auto", "--processes", "1")
    m = stats(daemon)["models"][0]
    assert m["slots_per_layer"] == expected.l2_slots
    assert m["shm_bytes"] <= expected.l2_budget
    assert "budget auto" in daemon.log()


def test_daemon_budget_auto_refuses_when_nothing_is_left_for_l2(daemon_factory, fake_memory, model_dir,
                                                                 model_files):
    memory = auto_memory(model_files)
    fake_memory(memory.total, memory.available)
    with pytest.raises(RuntimeError, match="exited with 1") as failed:
        daemon_factory([model_dir], "auto", "--processes", "2")
    assert "leaves nothing for L2" in str(failed.value)
    assert "give --budget SIZE or fewer --processes" in str(failed.value)


def test_budget_auto_needs_one_model(daemon_factory, model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="with several models give each a size"):
        daemon_factory([model_dir, tmp_path], "auto")


def test_default_l0_comes_from_the_plan_and_tokens_stay_identical(fake_memory, model_dir, model_files):
    tokenizer_text = "The cache keeps the experts that the router picks most often close to the model. " * 3
    whole, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(tokenizer_text)[:40]
    expected = [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=8)]
    sizes = ModelSizes.of(model_files)
    roomy = Memory(64 * GiB, 32 * GiB)
    fake_memory(roomy.total, roomy.available)
    assert l0_slots_for(model_files) == plan(roomy, sizes, shared_l0=False).l0_slots == default_l0_slots(sizes)
    short = auto_memory(model_files, pool=200_000)
    fake_memory(short.total, short.available)
    assert l0_slots_for(model_files) == plan(short, sizes, shared_l0=False).l0_slots == model_files.top_k
    with StreamedLM(model_dir, daemon=False) as lm:
        assert lm.pool.capacity == model_files.top_k
        assert [r.token for r in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=8)] == expected


def test_a_client_with_a_daemon_at_load_holds_top_k_rows_in_all_where_memory_is_short(
        daemon_factory, fake_memory, model_dir, model_files, tmp_path):
    """Computing on L2's records in place, L0 holds only the misses being read where L2 cannot hold every expert:
    the memory is L2's. A process that found no daemon at load caches in L0 alone, as the plan's rows in every
    layer; with memory to spare, a daemon's client holds that many rows in all."""
    whole, tokenizer = load(str(model_dir))
    ids = tokenizer.encode("The router picks the experts; the cache keeps them close. " * 3)[:40]
    expected = [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=8)]
    sizes = ModelSizes.of(model_files)
    short = auto_memory(model_files, pool=600_000)
    assert plan(short, sizes).l2_slots < model_files.n_experts  # the fake memory really limits L2
    fake_memory(short.total, short.available)
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    nobody = f"ipc://{tmp_path / 'nobody.sock'}"
    per_layer = plan(short, sizes, shared_l0=False).l0_slots
    for socket, rows in ((daemon.socket, model_files.top_k), (nobody, per_layer * model_files.n_layers)):
        with StreamedLM(model_dir, socket=socket, client_wait_s=5 if socket == daemon.socket else 0.2) as lm:
            assert lm.pool.shared_l0 and lm.pool.capacity == rows
            assert [r.token for r in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=8)] == expected
    fake_memory(64 * GiB, 32 * GiB)
    with StreamedLM(model_dir, socket=daemon.socket, client_wait_s=5) as lm:
        assert lm.pool.capacity == default_l0_slots(sizes) * model_files.n_layers
