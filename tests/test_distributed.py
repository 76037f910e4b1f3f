"""Pipeline-parallel streaming under mlx.distributed: two ranks on this host with `mlx.launch --backend ring`,
each streaming its own stage's experts, checked against the model loaded whole in one process
(docs/distributed.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2.cache.profile import Profile
from moe_l2.cache.trace import read_traces
from moe_l2.lm.generation import encode_prompt
from moe_l2.lm.streamed_lm import l0_slots_for
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.lab.random_models import make_model

from .conftest import budget_for, stats, synthetic_trace, wait_for

PROMPT = "what is the integral of this derivative"
TOKENS = 16
BIN = Path(sys.executable).parent
# The subject is conftest's model_dir: qwen3_moe (mlx-lm pipelines it) with 3 MoE layers. mlx-lm's split over
# two ranks gives the extra layer to the low rank and the last layers to rank 0: rank 0 runs 1-2, rank 1 runs 0.
# Each rank's daemon serves its rank's layers (moe-l2d --layers).
RANK_LAYERS = ("1-2", "0-0")


def whole_tokens(model_dir, max_tokens: int, chat: bool = True) -> list[int]:
    """Greedy tokens of the model loaded whole by mlx-lm, in this process, for the prompt as generate sends it
    (chat) or as a completion request gives it (not chat)."""
    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, PROMPT, chat)
    return [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    return whole_tokens(model_dir, TOKENS)


@pytest.fixture
def profile_path(tmp_path, model_files) -> str:
    """A profile over the model's shape, so that the daemons accept and count hints."""
    files = model_files
    trace = synthetic_trace(tmp_path / "toy.jsonl.gz", n_layers=files.n_layers, n_experts=files.n_experts,
                            top_k=files.top_k, seqs=6, tokens=40)
    profile = Profile.from_traces(read_traces(trace))
    profile.save(tmp_path / "toy.json")
    return str(tmp_path / "toy.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_two_ranks(*command: str) -> list[str]:
    """`moe-l2 COMMAND` on two local ranks over the ring backend."""
    return [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--starting-port", str(free_port()), "--",
            str(BIN / "moe-l2"), *command]


def launch_command(model_dir, *args: str, max_tokens: int = TOKENS) -> list[str]:
    """`moe-l2 generate --json` on two ranks."""
    return on_two_ranks("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", str(max_tokens),
                        "--l0-slots", "6", "--json", *args)


def launch(model_dir, *args: str, max_tokens: int = TOKENS) -> dict:
    done = subprocess.run(launch_command(model_dir, *args, max_tokens=max_tokens), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return one_summary(done.stdout)


def one_summary(stdout: str) -> dict:
    """Rank 0 alone prints: exactly one JSON line."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


@pytest.fixture
def rank_dirs():
    """Runtime dirs base/0 and base/1, and the --socket that names each rank's daemon through {rank}."""
    base = short_tempdir()
    for rank in (0, 1):
        (base / str(rank)).mkdir(mode=0o700)
    yield base, f"ipc://{base}/{{rank}}/moe-l2d.sock"
    shutil.rmtree(base, ignore_errors=True)


def test_a_pool_for_a_stage_holds_only_its_layers(model_files):
    files = model_files
    pool = ExpertPool(files, capacity=4, layers=[2, 1])
    try:
        assert sorted(pool.layers) == [1, 2]
        assert pool.nbytes == 2 * 4 * files.layout.stride
        pool.fetch(2, [0, 1, 2, 3])
        assert pool.layers[2].record(2) == files.read_record(2, 2)
        with pytest.raises(KeyError):
            pool.fetch(0, [0])
    finally:
        pool.close()
    with pytest.raises(ValueError, match="non-empty subset"):
        ExpertPool(files, capacity=4, layers=[3])
    # A budget buys slots over the stage's layers only: a third of the layers, three times the slots.
    budget = files.n_layers * files.layout.stride * files.top_k
    assert l0_slots_for(files, budget=str(budget), n_layers=1) == 3 * files.top_k
    assert l0_slots_for(files, budget=str(budget)) == files.top_k


@pytest.mark.slow
@pytest.mark.parametrize("daemon", ["none", "down"])
def test_two_ranks_without_daemons_give_the_whole_models_tokens(model_dir, model_files, expected, tmp_path, daemon):
    if daemon == "none":
        s = launch(model_dir, "--no-daemon")
    else:  # each rank's daemon socket names a daemon that is not running; L0 rows in every layer, as without one
        s = launch(model_dir, "--socket", f"ipc://{tmp_path}/{{rank}}.sock", "--l0", "per-layer")
    assert s["tokens"] == expected
    assert [r["layers"] for r in s["ranks"]] == [[1, 2], [0]]  # mlx-lm's split: rank 0 runs the last layers
    for rank, r in enumerate(s["ranks"]):
        if daemon == "none":
            assert r["daemon"] is None
        else:
            assert r["daemon"]["address"] == f"ipc://{tmp_path}/{rank}.sock" and not r["daemon"]["attached"]
        assert r["l2_hits"] == 0 and r["l3_reads"] > 0
        assert r["l0_ceiling_bytes"] == len(r["layers"]) * 6 * model_files.layout.stride  # L0 for its own layers only
    assert s["expert_lookups"] == sum(r["expert_lookups"] for r in s["ranks"])


@pytest.mark.slow
def test_two_ranks_each_with_its_own_daemon(daemon_factory, rank_dirs, model_dir, model_files, expected,
                                            profile_path):
    files = model_files
    base, address = rank_dirs
    daemons = [daemon_factory([model_dir], str(budget_for(files, files.n_experts)), "--profile", profile_path,
                              "--layers", RANK_LAYERS[rank], runtime_dir=base / str(rank)) for rank in (0, 1)]
    first = launch(model_dir, "--socket", address)
    assert first["tokens"] == expected
    for r, daemon in zip(first["ranks"], daemons):
        assert r["daemon"]["attached"] and r["daemon"]["address"] == daemon.socket
        # Each daemon hears one hint for the request, and the lookups of its rank's layers, all of them served.
        wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="demand loads")
        m = stats(daemon)["models"][0]
        assert m["hints"] == 1
        assert m["served_layers"] == r["layers"] and all(info["hits"] + info["misses"] > 0 for info in m["layers"])
    second = launch(model_dir, "--socket", address)
    assert second["tokens"] == expected
    assert all(r["l2_hits"] > 0 for r in second["ranks"])  # the first run's misses were loaded into each L2
    assert [stats(d)["models"][0]["hints"] for d in daemons] == [2, 2]


@pytest.mark.slow
def test_ranks_sharing_a_daemon_send_its_hint_once(daemon_factory, model_dir, model_files, expected,
                                                   profile_path):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)), "--profile", profile_path)
    s = launch(model_dir, "--socket", daemon.socket)
    assert s["tokens"] == expected
    assert all(r["daemon"]["attached"] for r in s["ranks"])
    assert stats(daemon)["models"][0]["hints"] == 1
    # Both ranks looked their own layers up in it.
    assert all(info["hits"] + info["misses"] > 0 for info in stats(daemon)["models"][0]["layers"])


@pytest.mark.slow
def test_a_daemon_killed_mid_generation_leaves_its_rank_on_the_files(daemon_factory, rank_dirs, model_dir,
                                                                     model_files):
    files = model_files
    max_tokens = 96
    want = whole_tokens(model_dir, max_tokens)
    base, address = rank_dirs
    daemons = [daemon_factory([model_dir], str(budget_for(files, 8)), "--layers", RANK_LAYERS[rank],
                              runtime_dir=base / str(rank)) for rank in (0, 1)]
    run = subprocess.Popen(launch_command(model_dir, "--socket", address, max_tokens=max_tokens),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Rank 1's daemon dies once it has served that rank (L2 took what the rank missed: given by the rank, which
        # runs as the daemon's user, or loaded by the daemon).
        wait_for(lambda: (lambda m: m["loads_done"] + m["fills"]["donated"])(stats(daemons[1])["models"][0]) > 0,
                 timeout=120, what="rank 1's misses in L2")
        daemons[1].kill9()
        killed_at = time.monotonic()
        stdout, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, stderr
    s = one_summary(stdout)
    assert s["tokens"] == want
    rank0, rank1 = s["ranks"]
    assert rank0["daemon"]["attached"]
    # The kill came before the end of the run: rank 1 noticed it and went on from the model files.
    assert not rank1["daemon"]["attached"] and rank1["daemon"]["last_error"], (time.monotonic() - killed_at, rank1)
    assert rank1["daemon"]["attaches"] == 1 and rank1["l3_reads"] > 0


@pytest.mark.slow
def test_a_model_without_pipeline_support_is_refused_clearly(tmp_path):
    model = tmp_path / "mixtral"
    make_model(model, arch="mixtral", layers=2, experts=8, top_k=2, hidden_size=128, moe_hidden_size=64,
               bits=4, seed=1)
    done = subprocess.run(launch_command(model, "--no-daemon"), capture_output=True, text=True, timeout=300)
    assert "exited with code 1" in done.stderr  # mlx.launch itself exits 0 whatever its ranks do
    assert "mlx-lm has no pipeline parallelism for the mixtral model" in done.stderr
    assert "qwen3_moe" in done.stderr and "deepseek_v3" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_serve_on_two_ranks_answers_with_the_whole_models_tokens(daemon_factory, rank_dirs, model_dir,
                                                                 model_files, profile_path, tmp_path):
    files = model_files
    want = whole_tokens(model_dir, TOKENS, chat=False)
    base, address = rank_dirs
    daemons = [daemon_factory([model_dir], str(budget_for(files, 8)), "--profile", profile_path,
                              "--layers", RANK_LAYERS[rank], runtime_dir=base / str(rank)) for rank in (0, 1)]
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        # Its own session: mlx.launch does not pass SIGTERM on to its ranks, so the test signals them all.
        server = subprocess.Popen(on_two_ranks("serve", "--model", str(model_dir), "--port", str(port),
                                               "--socket", address, "--l0-slots", "6", "--log-level", "WARNING"),
                                  stdout=log, stderr=log, start_new_session=True)
    try:
        def healthy() -> bool:
            assert server.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, timeout=120, what="the server's /health")
        body = json.dumps({"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0, "logprobs": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        assert [entry["id"] for entry in answer["choices"][0]["logprobs"]["content"]] == want
        # Rank 0 alone received the request; both daemons got its hint, once.
        wait_for(lambda: [stats(d)["models"][0]["hints"] for d in daemons] == [1, 1], what="one hint per daemon")
        for daemon, layers in zip(daemons, ([1, 2], [0])):
            clients = stats(daemon)["daemon"]["client_list"]
            assert [(c["layer_ids"], c["unserved_layer_ids"]) for c in clients] == [(layers, [])]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    log = log_path.read_text()
    assert "rank 1, MoE layers 0-0" in log and "rank 0, MoE layers 1-2" in log, log
