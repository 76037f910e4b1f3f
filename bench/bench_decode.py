"""Decode speed of streamed experts against the model loaded whole, and where a streamed token's time goes.

    python bench/bench_decode.py [--model DIR] [--tokens 64] [--repeats 3] [--resident-only]

Without --model it makes a random-weight qwen3_moe checkpoint in a temp dir. Prints, in one run:
- decode tok/s: whole model; streamed with every expert in L0; streamed with L0 = a quarter of the experts,
  first with a warm daemon (misses copied from L2), then without one (misses pread from the file);
- per decode token: time blocked on the router's choice (the routing sync: it includes the compute queued
  before it), in L2 copies, in preads, in the rest of the fetch, and the rest (graph building, final eval).
Each row is the fastest of --repeats runs, each with a fresh pool (cold L0); the configurations take turns,
so that other load on the machine spreads over all of them. Tokens are sampled (temperature 1, fixed seed, the
same tokens in every configuration): greedy decoding of random weights repeats itself and routes to a handful
of experts.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from moe_l2.client.connection import wait_idle
from moe_l2.lm.generation import encode_prompt
from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.random_models import make_model
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles

MODEL = dict(arch="qwen3_moe", layers=6, experts=32, top_k=4, hidden_size=128, moe_hidden_size=128, bits=4, seed=11)
PROMPT = "Summarise how a machine-wide expert cache lets several processes share one copy of the weights."


def decode(model, tokenizer, ids, tokens, stats=None) -> dict:
    """Decode tok/s over the tokens after the first (the prompt is done by then), and the stats' deltas."""
    start = before = None
    n = 0
    mx.random.seed(0)
    for n, _ in enumerate(stream_generate(model, tokenizer, mx.array(ids), max_tokens=tokens,
                                          sampler=make_sampler(1.0)), 1):
        if n == 1:
            start = time.perf_counter()
            before = stats.as_dict() if stats is not None else None
    elapsed = time.perf_counter() - start
    out = {"tps": (n - 1) / elapsed, "ms_per_token": 1000 * elapsed / (n - 1)}
    if stats is not None:
        out.update({k: 1000 * (v - before[k]) / (n - 1) for k, v in stats.as_dict().items() if k.endswith("_s")})
    return out


def streamed(path, ids, tokens, **kwargs) -> dict:
    with StreamedLM(path, client_wait_s=5.0, **kwargs) as lm:
        if kwargs.get("l0_slots") == lm.files.n_experts:  # "every expert resident": fill L0 first
            for layer in range(lm.files.n_layers):
                lm.pool.fetch(layer, list(range(lm.files.n_experts)))
        result = decode(lm.model, lm.tokenizer, ids, tokens, lm.stats)
        if lm.client is not None and not lm.client.attached:
            raise RuntimeError(f"not attached to the daemon: {lm.client.last_error}")
        c = lm.pool.counts
        result["tiers"] = (c.l0_hits, c.l2_hits, c.l3_reads)
    return result


def best(runs: list[dict]) -> dict:
    """The fastest run: other load on the machine only ever slows a run down."""
    return max(runs, key=lambda r: r["tps"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="mlx-lm MoE model (default: make a small random one)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resident-only", action="store_true",
                        help="only the whole model against every expert in L0 (real geometries decode at a few "
                             "tenths of a token a second on a CPU)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="moe-l2-bench-") as tmp:
        path = args.model
        if path is None:
            path = make_model(Path(tmp) / "model", **MODEL)
        files = ModelFiles.open(path)
        quarter = max(files.top_k, files.n_experts // 4)
        whole, tokenizer = load(str(path))
        ids = encode_prompt(tokenizer, PROMPT)
        decode(whole, tokenizer, ids, 8)  # warm-up: first-call costs
        warm = f"streamed, L0 {quarter}/{files.n_experts}, warm L2"
        pread = f"streamed, L0 {quarter}/{files.n_experts}, pread only"
        runs = {"whole model": [], "streamed, every expert in L0": []}
        if not args.resident_only:
            runs.update({warm: [], pread: []})
        every_expert = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, files.n_experts)
        with contextlib.ExitStack() as stack:
            if not args.resident_only:
                daemon = stack.enter_context(DaemonProcess.serving([path], every_expert))
                streamed(path, ids, args.tokens, l0_slots=quarter, socket=daemon.socket)  # fills L2
                wait_idle(daemon.socket)
            for _ in range(args.repeats):
                runs["whole model"].append(decode(whole, tokenizer, ids, args.tokens))
                runs["streamed, every expert in L0"].append(
                    streamed(path, ids, args.tokens, l0_slots=files.n_experts, daemon=False))
                if not args.resident_only:
                    runs[warm].append(streamed(path, ids, args.tokens, l0_slots=quarter, socket=daemon.socket))
                    runs[pread].append(streamed(path, ids, args.tokens, l0_slots=quarter, daemon=False))
        rows = {name: best(r) for name, r in runs.items()}

    base = rows["whole model"]["tps"]
    print(f"model {path}: {files.model_type}, {files.n_layers} MoE layers x {files.n_experts} experts "
          f"(top {files.top_k}), {files.layout.nbytes} bytes per expert")
    print(f"decode, {args.tokens} tokens after a {len(ids)}-token prompt, best of {args.repeats} runs\n")
    print(f"{'':40s}{'tok/s':>8s}{'vs whole':>10s}   per token (ms): {'total':>7s}{'sync':>7s}{'copy':>7s}"
          f"{'pread':>7s}{'fetch*':>7s}{'rest':>7s}   L0/L2/L3 lookups")
    for name, r in rows.items():
        line = f"{name:40s}{r['tps']:8.1f}{r['tps'] / base:9.2f}x   {'':16s}{r['ms_per_token']:7.2f}"
        if "sync_s" in r:
            fetch_other = r["fetch_s"] - r["copy_s"] - r["pread_s"]
            rest = r["ms_per_token"] - r["sync_s"] - r["fetch_s"]
            line += (f"{r['sync_s']:7.2f}{r['copy_s']:7.2f}{r['pread_s']:7.2f}{fetch_other:7.2f}{rest:7.2f}"
                     f"   {'/'.join(map(str, r['tiers']))}")
        print(line)
    print("\nsync: blocked on the router's indices (includes the compute queued before them); copy: L2 -> L0; "
          "pread: file -> L0;\nfetch*: the rest of ExpertPool.fetch; rest: graph building and the token's own eval.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
