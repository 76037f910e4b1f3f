"""L0 grown on demand (client/layerpool.py, Rows): top-k rows at first, growth by GROWTH up to the ceiling the
budget gives, eviction only there; tokens and bytes against the model loaded whole and the model file."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2 import protocol
from moe_l2.cli import main as moe_l2_main
from moe_l2.lm.generation import encode_prompt
from moe_l2.client.layerpool import GROWTH
from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.client.pool import ExpertPool
from moe_l2.serve.metrics import _l0_rows
from moe_l2.cli.stats import render
from moe_l2.control import request

from .conftest import assert_resident_exact, budget_for, stats, wait_for

PROMPT = "Which experts does the router pick for this sentence?"
TOKENS = 24


def test_rows_start_at_top_k_grow_by_half_and_evict_only_at_the_ceiling(model_files):
    top_k, ceiling = model_files.top_k, 12
    with ExpertPool(model_files, capacity=ceiling, grow=True) as pool:
        lp = pool.layers[0]
        assert pool.rows_held() == {layer: top_k for layer in pool.layers}
        assert pool.nbytes == top_k * len(pool.layers) * pool.row_bytes
        assert pool.ceiling_bytes == ceiling * len(pool.layers) * pool.row_bytes
        sizes = [lp.rows.held]
        for expert in range(model_files.n_experts):
            counts = pool.fetch(0, [expert])
            assert counts.l3_reads == 1
            if lp.rows.held != sizes[-1]:
                sizes.append(lp.rows.held)
            assert lp.rows.held <= ceiling
            assert pool.arrays(0)[model_files.layout.pieces[0].key].shape[0] == lp.rows.held
            resident = [e for e in range(expert + 1) if lp.holds(e)]
            # Nothing is evicted below the ceiling; every resident record is the file's, moved rows included.
            assert len(resident) == min(expert + 1, ceiling)
            assert_resident_exact(pool, model_files, 0, resident)
        expected = [top_k]
        while expected[-1] < ceiling:
            expected.append(min(ceiling, math.ceil(expected[-1] * GROWTH)))
        assert sizes == expected == [4, 6, 9, 12]
        assert pool.rows_held()[1] == top_k  # the other layers did not grow
        # What the pool says it holds is the memory its rows take (each a record on a page), within the ceiling.
        held = sum(lp.rows.buffer.nbytes for lp in pool.layers.values())
        assert held == pool.nbytes <= pool.ceiling_bytes
        assert held > sum(lp.rows.total for lp in pool.layers.values()) * model_files.layout.nbytes


def test_a_graph_built_before_the_rows_grow_still_reads_its_rows(model_files):
    """Growth moves the rows into new buffers: a computation queued (or not yet evaluated) on the old arrays reads
    what they held, and the old rows are never written again."""
    piece = model_files.layout.pieces[0]
    with ExpertPool(model_files, capacity=model_files.n_experts, grow=True) as pool:
        pool.fetch(0, list(range(model_files.top_k)))
        before = pool.arrays(0)[piece.key]
        row = int(pool.table(0)[1].item())
        want = np.asarray(before[row]).copy()
        slow = mx.random.normal((1024, 1024), key=mx.random.key(0))
        for _ in range(4):
            slow = slow @ slow / 1024
        late = before[mx.array(row) + (0 * slow.sum()).astype(mx.int32)]
        mx.async_eval(late)
        pool.fetch(0, [model_files.top_k])  # every row taken: the rows grow
        assert pool.arrays(0)[piece.key] is not before
        assert np.array_equal(np.asarray(late), want)
        assert np.array_equal(np.asarray(pool.arrays(0)[piece.key][row]), want)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, PROMPT)[:1]
    return [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=TOKENS)]


def rows_while_generating(lm, ids) -> tuple[list[int], list[int]]:
    """Greedy tokens, and the L0 rows held after each."""
    tokens, rows = [], []
    for r in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=TOKENS):
        tokens.append(r.token)
        rows.append(lm.pool.rows)
    return tokens, rows


# (daemon, L0 shared, l2_reads, prefetch). Per layer, 9 rows of 16 in each of the 3 layers (4, 6, 9); shared,
# 24 in all (4, 8, 12, 18, 24: a one-token prompt takes 4 in each layer). Copies from L2 fill L0 with every
# expert the tokens use; lent ones stay in L2, so an L0 beside lending may hold its top-k rows throughout.
SETUPS = {"files": (False, False, "copy", "off"), "files+prefetch": (False, False, "copy", "router"),
          "daemon-shared-copy": (True, True, "copy", "off"),
          "daemon-per-layer-copy+prefetch": (True, False, "copy", "router"),
          "daemon-shared-in-place": (True, True, "in-place", "off"),
          "daemon-shared-copy+prefetch": (True, True, "copy", "router")}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_tokens_stay_the_whole_models_while_l0_grows_to_its_ceiling(setup, daemon_factory, model_dir, model_files,
                                                                     expected):
    with_daemon, shared, l2_reads, prefetch = SETUPS[setup]
    socket = None
    if with_daemon:  # L2 for half the experts: misses are lent, copied or read through as they come
        socket = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts // 2))).socket
    with StreamedLM(model_dir, l0_slots=24 if shared else 9, l0_grow=True, daemon=with_daemon, socket=socket,
                    client_wait_s=5, shared_l0=shared, l2_reads=l2_reads, prefetch=prefetch,
                    load_through_ms=5.0) as lm:
        # Side rows (prefetch's) are held from the start and never grow.
        assert lm.pool.rows == (model_files.top_k + lm.pool.side_rows) * (1 if shared else model_files.n_layers)
        ids = encode_prompt(lm.tokenizer, PROMPT)[:1]
        tokens, rows = rows_while_generating(lm, ids)
        assert tokens == expected
        ceiling = lm.pool.ceiling
        assert rows == sorted(rows) and rows[-1] <= ceiling  # it only grows, never past the ceiling
        assert lm.pool.nbytes == rows[-1] * lm.pool.row_bytes <= lm.pool.ceiling_bytes
        if l2_reads == "copy":
            assert rows[0] < rows[-1] == ceiling  # grew while decoding, up to the ceiling


def generate_json(capsys, model_dir, prompt: str, *flags: str) -> dict:
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", prompt, "--no-daemon", "--l0-slots",
                        "16", "--max-tokens", "1", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_short_prompt_holds_fewer_l0_rows_than_a_long_one(capsys, model_dir, model_files):
    short = generate_json(capsys, model_dir, "Hi", "--l0-grow")
    long = generate_json(capsys, model_dir, PROMPT * 8, "--l0-grow")
    fixed = generate_json(capsys, model_dir, "Hi")  # the default: the ceiling from the start
    ceiling = 16 * model_files.n_layers
    assert short["l0_slots"] == long["l0_slots"] == 16
    assert short["l0_rows"] < long["l0_rows"] <= ceiling == fixed["l0_rows"]
    assert short["l0_bytes"] < long["l0_bytes"] <= long["l0_ceiling_bytes"] == fixed["l0_bytes"]
    assert short["l0_bytes"] == short["l0_rows"] * model_files.layout.stride
    assert short["tokens"] == fixed["tokens"]


def test_stats_and_metrics_show_the_rows_held_and_the_ceiling(running_daemon, model_dir, model_files):
    with StreamedLM(model_dir, l0_slots=10, l0_grow=True, socket=running_daemon.socket, shared_l0=False,
                    client_wait_s=5) as lm:
        lm.pool.fetch(0, list(range(8)))
        assert lm.pool.rows_held() == {0: 8, 1: 4, 2: 4} and lm.pool.ceiling == 30

        def listed():
            clients = stats(running_daemon)["daemon"]["client_list"]
            return [(c["l0_rows"], c["l0_ceiling"]) for c in clients] == [(16, 30)]
        wait_for(listed, what="the client's L0 rows in stats")
        assert "  16/30  " in render(stats(running_daemon))  # moe-l2 stats' client table
        held, most = _l0_rows(lm.pool)
        assert [(s.labels["layer"], s.value) for s in held.samples] == [("0", 8), ("1", 4), ("2", 4)]
        assert {s.value for s in most.samples} == {10}


def test_a_hello_with_an_impossible_l0_is_refused(running_daemon, model_files):
    hello = protocol.Hello(id=7, model=str(model_files.path), fingerprint=model_files.fingerprint, client="x",
                           l0_rows=5, l0_ceiling=2)
    reply = request(running_daemon.socket, hello)
    assert not reply.ok and reply.ename == "BadField" and "l0_rows" in reply.evalue
