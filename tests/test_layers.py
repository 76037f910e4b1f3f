"""moe-l2d --layers: a daemon that serves only some decoder layers of a model (issue 11, point 2).

The subject is deepseek_v3 with 4 decoder layers: layer 0 is dense, so its MoE layers 0, 1, 2 are decoder
layers 1, 2, 3. `--layers 0-2` serves decoder layers 1 and 2 (MoE layers 0 and 1; the dense layer 0 in the
range is simply not a MoE layer); MoE layer 2 (decoder layer 3) is read from the model file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate

from moe_l2 import protocol
from moe_l2.cache.profile import Profile
from moe_l2.cache.trace import read_traces
from moe_l2.cli import main as cli
from moe_l2.client.connection import L2Client, request
from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.client.pool import ExpertPool
from moe_l2.daemon.config import ConfigError, build_parser, resolve
from moe_l2.daemon.metrics import families
from moe_l2.lab.random_models import make_model
from moe_l2.layout import Geometry, align, page_size
from moe_l2.model import ModelFiles
from moe_l2.plan import DEFAULT_KV_BYTES, MEMORY_FILE_ENV, Memory, ModelSizes, os_headroom, plan
from moe_l2.sizes import size_arg

from .conftest import (assert_resident_exact, assert_same_as_whole, budget_for, daemon_segments, segment_exists,
                       stats, synthetic_trace, wait_for)

SERVED, UNSERVED = [0, 1], 2  # MoE layers of --layers 0-2
TEXT = "The cache keeps the experts that the router picks most often close to the model. " * 3


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> ModelFiles:
    out = tmp_path_factory.mktemp("layers") / "deepseek"
    make_model(out, arch="deepseek_v3", layers=4, experts=16, top_k=4, hidden_size=128, moe_hidden_size=64,
               bits=4, seed=3)
    return ModelFiles.open(out)


@pytest.fixture
def daemon(daemon_factory, files):
    """--layers 0-2 with the budget that buys 4 slots per layer for all 3 MoE layers."""
    return daemon_factory([files.path], str(budget_for(files, 4)), "--layers", "0-2")


def test_the_daemon_holds_only_the_served_layers_segments_and_slots(daemon, files):
    assert files.layer_ids == [1, 2, 3]
    index, data = daemon_segments(daemon, files)
    assert segment_exists(index)
    assert [bool(name) and segment_exists(name) for name in data] == [True, True, False]
    (m,) = stats(daemon)["models"]
    assert (m["served_layers"], m["served_layer_ids"]) == (SERVED, [1, 2])
    assert [(layer["layer"], layer["layer_id"]) for layer in m["layers"]] == [(0, 1), (1, 2)]
    # The same budget buys more slots per served layer: what 3 layers x 4 slots cost holds 6 per layer for 2.
    assert m["slots_per_layer"] == 6 > 4
    geometry = Geometry.for_budget(files.n_layers, files.n_experts, files.layout.nbytes, budget_for(files, 4), 2)
    assert m["shm_bytes"] == geometry.shm_bytes == stats(daemon)["daemon"]["shm_bytes"] <= budget_for(files, 4)
    assert [layer["slots"] for layer in m["layers"]] == [6, 6]


def test_the_budget_per_served_layer_is_larger_with_auto_budgets_too(files):
    """--budget auto (moe_l2.plan) sizes L2 for the served layers only."""
    sizes = ModelSizes.of(files)
    # Room for the weights, an L0 of 8 slots and an L2 of 8 slots in every MoE layer (L0 in every layer: a client
    # without a daemon at load).
    memory = Memory(total=64 << 20, available=sizes.non_expert_bytes + 8 * sizes.l0_slot_bytes + budget_for(files, 8))
    every = plan(memory, sizes, kv_bytes=0, headroom=0, shared_l0=False)
    served = plan(memory, ModelSizes.of(files, len(SERVED)), kv_bytes=0, headroom=0, shared_l0=False)
    assert (every.l0_slots, every.l2_slots, served.l0_slots, served.l2_slots) == (8, 8, 8, 12)
    assert served.l2_budget == Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, 12,
                                                   len(SERVED)) <= every.l2_budget


def test_budget_auto_and_moe_l2_plan_size_l2_for_the_served_layers(daemon_factory, files, tmp_path, monkeypatch,
                                                                   capsys):
    sizes = ModelSizes.of(files)
    total = 16 << 30  # available: the OS, one process' weights, KV and 8 L0 slots, and 8 L2 slots in every layer
    memory = Memory(total, os_headroom(total) + sizes.non_expert_bytes + DEFAULT_KV_BYTES + 8 * sizes.l0_slot_bytes
                    + budget_for(files, 8))
    (tmp_path / "memory.json").write_text(json.dumps({"total": memory.total, "available": memory.available}))
    monkeypatch.setenv(MEMORY_FILE_ENV, str(tmp_path / "memory.json"))
    expected = plan(memory, ModelSizes.of(files, len(SERVED)))
    assert expected.l2_slots > plan(memory, sizes).l2_slots
    daemon = daemon_factory([files.path], "auto", "--layers", "0-2")
    assert stats(daemon)["models"][0]["slots_per_layer"] == expected.l2_slots
    assert cli(["plan", "--model", str(files.path), "--layers", "0-2"]) == 0
    assert (f"{expected.l2_slots} of 16 experts per layer of the 2 MoE layers in decoder layers 0-2 "
            f"(moe-l2d --budget {size_arg(expected.l2_budget, align(files.layout.nbytes, page_size()))} --layers 0-2)"
            ) in capsys.readouterr().out


def test_tokens_match_the_model_loaded_whole(daemon, files):
    whole, tokenizer = load(str(files.path))
    ids = mx.array(tokenizer.encode(TEXT)[:24])
    expected = [r.token for r in stream_generate(whole, tokenizer, ids, max_tokens=8)]
    runs = []
    for _ in range(2):
        with StreamedLM(files.path, l0_slots=files.top_k + 1, socket=daemon.socket, client_wait_s=5) as lm:
            assert lm.client.attached and lm.client.attachment.layers == frozenset(SERVED)
            assert [r.token for r in stream_generate(lm.model, lm.tokenizer, ids, max_tokens=8)] == expected
            assert_same_as_whole(lm.model(ids[None]), whole(ids[None]), chunked=True)
            runs.append(lm.pool.counts)
        wait_for(lambda: stats(daemon)["daemon"]["loads_in_flight"] == 0, what="loads")
    assert runs[1].l2_hits > 0 and runs[1].l3_reads > 0


def test_unserved_layers_come_from_the_file_without_asking_the_daemon(daemon, files):
    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, capacity=4, client=client)
    experts = [8, 9, 10, 11]
    try:
        for layer, warm in ((SERVED[1], (0, 4)), (UNSERVED, (4, 0))):
            cold = pool.fetch(layer, experts)
            assert (cold.l3_reads, cold.l2_hits) == (4, 0)
            wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 4, what="the served layer's loads")
            for expert in experts:
                pool.evict(layer, expert)
            got = pool.fetch(layer, experts)
            assert (got.l3_reads, got.l2_hits) == warm
            assert_resident_exact(pool, files, layer, experts)
    finally:
        pool.close()
        client.close()
    # Only the served layer's picks reached the daemon: 4 misses, then 4 hits; it loaded those 4 only.
    wait_for(lambda: stats(daemon)["models"][0]["picks"] == 8, what="reports")
    m = stats(daemon)["models"][0]
    assert (m["hits"], m["misses"], m["loads_done"], m["load_errors"]) == (4, 4, 4, 0)
    assert [layer["experts"] for layer in m["layers"]] == [[], experts]


def test_requests_for_an_unserved_layer_are_refused_and_reports_ignored(daemon, files):
    fp = files.fingerprint
    for message in (protocol.Prefetch(id=1, model=fp, layer=UNSERVED, experts=[1]),
                    protocol.Pin(id=2, model=fp, layer=UNSERVED, experts=[1]),
                    protocol.Unpin(id=3, model=fp, layer=UNSERVED, experts=[1])):
        reply = request(daemon.socket, message)
        assert not reply.ok and reply.ename == "OutOfRange"
        assert "decoder layer 3" in reply.evalue and "serves decoder layers 1-2" in reply.evalue
    # A report naming the unserved layer beside a served one: the served part counts, the rest is ignored.
    report = protocol.Report(id=4, model=fp, layers={SERVED[0]: [[], [5]], UNSERVED: [[], [6, 7]]},
                             routed={SERVED[0]: [5], UNSERVED: [6, 7]})
    assert request(daemon.socket, report).ok
    wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 1, what="the served layer's load")
    m = stats(daemon)["models"][0]
    assert (m["misses"], m["picks"]) == (1, 1)
    assert [layer["experts"] for layer in m["layers"]] == [[5], []]
    assert request(daemon.socket, protocol.Prefetch(id=5, model=fp, layer=files.n_layers, experts=[1])).ename \
        == "OutOfRange"


def test_a_hint_pins_and_loads_in_the_served_layers_only(daemon_factory, files, tmp_path):
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", n_layers=files.n_layers, n_experts=files.n_experts, top_k=4,
                            seqs=6, tokens=40)
    Profile.from_traces(read_traces(trace)).save(tmp_path / "p.json")
    daemon = daemon_factory([files.path], str(budget_for(files, 4)), "--layers", "0-2", "--profile",
                            str(tmp_path / "p.json"))
    reply = request(daemon.socket, protocol.Hint(id=1, model=files.fingerprint, domain="alpha"))
    assert reply.ok and sorted(reply.payload["pinned"]) == SERVED
    assert all(reply.payload["pinned"][layer] for layer in SERVED)
    wait_for(lambda: stats(daemon)["daemon"]["loads_in_flight"] == 0, what="preloads")
    m = stats(daemon)["models"][0]
    assert [sorted(layer["domain_pins"]) for layer in m["layers"]] == [sorted(reply.payload["pinned"][layer])
                                                                        for layer in SERVED]
    assert m["loads_done"] == sum(map(len, reply.payload["pinned"].values())) and m["load_errors"] == 0


def test_stats_show_the_served_layers(daemon, files, capsys):
    assert cli(["stats", "--socket", daemon.socket]) == 0
    table = capsys.readouterr().out
    assert "serves decoder layers 1-2: 2 of 3 MoE layers" in table
    assert "occupancy 0/12 slots" in table
    rows = table.split("decoder layer\n")[1].splitlines()
    assert [row.split()[0] for row in rows] == ["0", "1"] and [row.split()[-1] for row in rows] == ["1", "2"]
    assert cli(["stats", "--socket", daemon.socket, "--watch", "--count", "1"]) == 0
    assert "serves decoder layers 1-2" in capsys.readouterr().out
    metrics = {f.name: f for f in families(stats(daemon))}
    assert [s.value for s in metrics["moe_l2_served_layers"].samples] == [2]
    assert {s.labels["layer"] for s in metrics["moe_l2_layer_slots"].samples} == {"0", "1"}


def test_clients_say_which_layers_they_stream_and_stats_show_it(daemon, files, capsys):
    rank = L2Client(files, daemon.socket, wait_s=5, layers=[1, 2])  # decoder layers 2-3: 3 is not served
    plain = L2Client(files, daemon.socket, wait_s=5)
    try:
        assert rank.attached and plain.attached
        clients = {c["name"]: c for c in stats(daemon)["daemon"]["client_list"]}
        assert (clients[rank.name]["layer_ids"], clients[rank.name]["unserved_layer_ids"]) == ([2, 3], [3])
        assert clients[plain.name]["layer_ids"] is None and clients[plain.name]["model"] == str(files.path)
        assert cli(["stats", "--socket", daemon.socket]) == 0
        table = capsys.readouterr().out
        assert f"{rank.name}  {os.getpid()}" in table and "layers 2-3 (3 from its files)" in table
        assert f"{plain.name}  {os.getpid()}" in table and "all layers" in table
    finally:
        rank.close()
        plain.close()
    # A hello naming a layer the model does not have is refused, and the daemon keeps serving.
    reply = request(daemon.socket, protocol.Hello(id=1, model=str(files.path), fingerprint=files.fingerprint,
                                                  client="x:1:y", layers=[files.n_layers]))
    assert not reply.ok and reply.ename == "BadField" and "has MoE layers 0..2" in reply.evalue
    assert stats(daemon)["daemon"]["errors"] == 1


@pytest.mark.parametrize("value, status, words", [
    ("2-9", 1, "has decoder layers 0-3; its MoE layers are decoder layers 1-3"),
    ("0", 1, "layers 0 hold no MoE layer"),
    ("3-1", 2, "the range 3-1 is empty"),
    ("", 2, "must be decoder layer ranges such as 0-23"),
    ("a-b", 2, "must be decoder layer ranges"),
])
def test_bad_layers_fail_with_the_reason(tmp_path, files, value, status, words):
    result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(files.path),
                             "--budget", str(budget_for(files, 4)), "--runtime-dir", str(tmp_path / "rt"),
                             "--layers", value], capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert words in result.stderr


def test_layers_flags_and_toml(tmp_path):
    def load_config(*argv):
        return resolve(build_parser().parse_args(list(argv)))

    one = load_config("--model", "/a", "--model", "/b", "--budget", "1G", "--layers", "0-3,8")
    assert [m.layers for m in one.models] == [((0, 3), (8, 8))] * 2
    assert load_config("--model", "/a", "--budget", "1G").models[0].layers is None
    with pytest.raises(ConfigError, match="--layers once, or once per --model"):
        load_config("--model", "/a", "--model", "/b", "--model", "/c", "--budget", "1G", "--layers", "1",
                    "--layers", "2")
    toml = tmp_path / "c.toml"
    toml.write_text('[[model]]\npath = "/m"\nbudget = "1GiB"\nlayers = "0-11"\n\n[[model]]\npath = "/n"\n'
                    'budget = "1GiB"\n')
    assert [m.layers for m in load_config("--config", str(toml)).models] == [((0, 11),), None]
    toml.write_text('[[model]]\npath = "/m"\nbudget = "1GiB"\nlayers = 5\n')
    with pytest.raises(ConfigError, match="layers of /m must be a string"):
        load_config("--config", str(toml))
