"""Streamed experts in one process vs a two-stage pipeline (mlx.launch, ring backend, two local ranks) at the
same total L0 + L2 budget: per decoded token, where the time goes, and each rank's peak memory.

    python bench/bench_pipeline.py [--model DIR] [--tokens 32] [--l0-slots 8] [--l2-slots 16]

Without --model it makes a random-weight qwen3_moe checkpoint in a temp dir. The budget is the same in both
setups: L0 holds --l0-slots experts per MoE layer (one rank: every layer; two ranks: each its own half, so the
same bytes in total), and one moe-l2d on this host (one host: one daemon, docs/distributed.md) holds
--l2-slots experts per layer for both. Each setup runs twice, "warm L2" against the daemon after a warm-up
generation, and "files" without a daemon (misses read from the page cache). Sampling at temperature 1 with a
fixed seed (greedy decoding of random weights routes to a handful of experts); both setups draw the same tokens.
The reference, "mlx-lm whole", is mlx-lm's own model with every weight in memory, in one process and pipelined
the same way (model.model.pipeline), nothing streamed: what a pipeline costs without moe-l2.

Per decoded token (decode only: the prompt's forward is left out), in ms:
- total: the wall time from the first token to the last over the tokens in between, on rank 0;
- expert stall: the time spent in ExpertPool.fetch (L2 copies and file reads), summed over the ranks: in
  one sequence's decode the stages run one after the other, so their stalls add up;
- transfer: the inter-rank traffic of one token, timed on its own in the same processes: the pipeline's
  send / recv of the hidden state from each stage to the next and the all_gather that hands it to every rank,
  for one token's hidden state, averaged over 200 rounds;
- compute: the rest (attention, routers, expert matmuls, sampling, and the graph's host overhead).
and the experts copied from L2 and read from the files per token (the whole run's, prompt included, over
the decoded tokens). Per rank: peak resident set (VmHWM) and MLX's peak memory, and the process' CPU time
over the wall time of the decode (how busy the rank was). Ratios: two ranks over one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(arch="qwen3_moe", layers=8, experts=32, top_k=4, hidden_size=256, moe_hidden_size=256, bits=4, seed=5)
PROMPT = "Explain how a pipeline of two machines shares the layers of one mixture-of-experts model."
TRANSFER_ROUNDS = 200


def transfer_seconds(group, hidden_size: int, dtype) -> float:
    """One token's inter-rank traffic, as mlx-lm's pipelined models issue it, averaged over rounds."""
    import mlx.core as mx

    rank, size = group.rank(), group.size()
    h = mx.zeros((1, 1, hidden_size), dtype=dtype)
    mx.eval(h)
    start = time.perf_counter()
    for _ in range(TRANSFER_ROUNDS):
        x = h
        if rank < size - 1:
            x = mx.distributed.recv_like(x, rank + 1, group=group, stream=mx.cpu)
        if rank != 0:
            x = mx.distributed.send(x, rank - 1, group=group, stream=mx.cpu)
        mx.eval(mx.distributed.all_gather(x, group=group, stream=mx.cpu))
    return (time.perf_counter() - start) / TRANSFER_ROUNDS


def decode(model, tokenizer, ids: list[int], tokens: int, lm=None) -> dict:
    """Sample `tokens` tokens; the wall time, CPU time and (streamed: `lm` given) the expert stall from the first
    token on (the prompt's forward left out), and where the experts came from."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from moe_l2.client.pool import TierCounts

    fetch_s = (lambda: lm.stats.fetch_s) if lm is not None else (lambda: 0.0)
    counts = (lambda: lm.pool.counts) if lm is not None else TierCounts
    mx.random.seed(0)
    out, first = [], None
    before = counts()
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=tokens, sampler=make_sampler(1.0)):
        out.append(response.token)
        if first is None:
            first = (time.perf_counter(), fetch_s(), time.process_time())
    after = counts()
    return {"tokens": out, "decode_s": time.perf_counter() - first[0], "decode_fetch_s": fetch_s() - first[1],
            "decode_cpu_s": time.process_time() - first[2],
            "l0_hits": after.l0_hits - before.l0_hits, "l2_hits": after.l2_hits - before.l2_hits,
            "l3_reads": after.l3_reads - before.l3_reads}


def worker(args) -> int:
    """One rank's part: load the stage (streamed, or mlx-lm's whole model with --whole), warm up, generate,
    and report; rank 0 prints every rank's figures."""
    import mlx.core as mx
    from mlx_lm import load

    from moe_l2.lm.distributed import gather_json
    from moe_l2.lm.generation import encode_prompt
    from moe_l2.lm.streamed_lm import StreamedLM, peak_rss_bytes

    group = mx.distributed.init()
    pipelined = group.size() > 1
    if args.whole:  # the reference: mlx-lm's own pipeline over the whole model's weights, nothing streamed
        model, tokenizer = load(str(args.model), lazy=True)
        if pipelined:
            model.model.pipeline(group)
        mx.eval(model.parameters())
        ids = encode_prompt(tokenizer, PROMPT)
        decode(model, tokenizer, ids, args.tokens)  # the same warm-up as the streamed runs get
        run = decode(model, tokenizer, ids, args.tokens)
        mine = {"rank": group.rank(), **run}
    else:
        with StreamedLM(args.model, l0_slots=args.l0_slots, socket=args.socket, daemon=args.socket is not None,
                        client_wait_s=5.0, group=group if pipelined else None) as lm:
            model = lm.model
            ids = encode_prompt(lm.tokenizer, PROMPT)
            if args.socket is not None:
                decode(model, lm.tokenizer, ids, args.tokens, lm)  # warm L2: the daemon loads what this run misses
                time.sleep(1.0)
            run = decode(model, lm.tokenizer, ids, args.tokens, lm)
            mine = {"rank": group.rank(), **run}
    dtype = model.model.embed_tokens(mx.array([[0]])).dtype  # the hidden state's, sent between stages
    transfer = transfer_seconds(group, model.args.hidden_size, dtype) if pipelined else 0.0
    mine.update(transfer_s=transfer, peak_rss=peak_rss_bytes(), peak_mlx=mx.get_peak_memory())
    ranks = gather_json(group, mine) if pipelined else [mine]
    if group.rank() == 0:
        print(json.dumps(ranks), flush=True)
    return 0


def run_setup(model: Path, ranks: int, socket: str | None, args, whole: bool = False) -> list[dict]:
    here = Path(__file__).resolve()
    bin_dir = Path(sys.executable).parent
    worker_cmd = [sys.executable, "-P", str(here), "--worker", "--model", str(model), "--tokens", str(args.tokens),
                  "--l0-slots", str(args.l0_slots), *(["--socket", socket] if socket else []),
                  *(["--whole"] if whole else [])]
    cmd = worker_cmd if ranks == 1 else [str(bin_dir / "mlx.launch"), "-n", str(ranks), "--backend", "ring", "--",
                                         *worker_cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[0])


def split(ranks: list[dict], tokens: int) -> dict:
    """Per decoded token, in ms: total, expert stall, transfer, compute."""
    steps = tokens - 1  # the forwards after the first token's
    total = 1000.0 * ranks[0]["decode_s"] / steps
    stall = 1000.0 * sum(r["decode_fetch_s"] for r in ranks) / steps
    transfer = 1000.0 * max(r["transfer_s"] for r in ranks)
    return {"total": total, "stall": stall, "transfer": transfer, "compute": total - stall - transfer}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an mlx-lm MoE checkpoint (default: a random qwen3_moe)")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per run (default 32)")
    parser.add_argument("--l0-slots", type=int, default=8, help="L0 experts per MoE layer (default 8)")
    parser.add_argument("--l2-slots", type=int, default=16, help="L2 experts per MoE layer (default 16)")
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    from moe_l2.lab.daemon_process import DaemonProcess
    from moe_l2.lab.random_models import make_model
    from moe_l2.layout import Geometry
    from moe_l2.model import ModelFiles

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "model"
            make_model(model, **MODEL)
        files = ModelFiles.open(model)
        budget = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, args.l2_slots)
        print(f"model {model.name}: {files.n_layers} MoE layers x {files.n_experts} experts of "
              f"{files.layout.nbytes / 1024:.0f} KiB, top-{files.top_k}; L0 {args.l0_slots} and L2 {args.l2_slots} "
              f"experts per layer in both setups; {args.tokens} decoded tokens")
        results = {}
        for tier in ("mlx-lm whole", "warm L2", "files"):
            for ranks in (1, 2):
                if tier != "warm L2":
                    results[tier, ranks] = run_setup(model, ranks, None, args, whole=tier == "mlx-lm whole")
                    continue
                with DaemonProcess.serving([model], budget) as daemon:
                    results[tier, ranks] = run_setup(model, ranks, daemon.socket, args)
        header = (f"{'setup':<22}{'total':>9}{'compute':>9}{'transfer':>9}{'stall':>9}{'L2/tok':>8}{'L3/tok':>8}"
                  "  per rank: peak RSS / MLX, CPU time over wall time in decode")
        print(header)
        print("-" * len(header))
        for (tier, ranks), per_rank in results.items():
            s = split(per_rank, args.tokens)
            peaks = ", ".join(f"r{r['rank']} {r['peak_rss'] / 2**20:.0f} / {r['peak_mlx'] / 2**20:.1f} MiB, "
                              f"CPU {r['decode_cpu_s'] / r['decode_s']:.0%}" for r in per_rank)
            name = f"{tier}, {ranks} rank{'s' if ranks > 1 else ''}"
            per_token = [sum(r[k] for r in per_rank) / args.tokens for k in ("l2_hits", "l3_reads")]
            print(f"{name:<22}{s['total']:>7.1f}ms{s['compute']:>7.1f}ms{s['transfer']:>7.2f}ms{s['stall']:>7.2f}ms"
                  f"{per_token[0]:>8.1f}{per_token[1]:>8.1f}  {peaks}")
        for tier in ("mlx-lm whole", "warm L2", "files"):
            one, two = (split(results[tier, n], args.tokens) for n in (1, 2))
            same = results[tier, 1][0]["tokens"] == results[tier, 2][0]["tokens"]
            peak = {k: max(r[k] for r in results[tier, 2]) / results[tier, 1][0][k] for k in ("peak_rss", "peak_mlx")}
            print(f"{tier}: 2 ranks / 1 rank: total {two['total'] / one['total']:.2f}x, compute "
                  f"{two['compute'] / one['compute']:.2f}x, stall {two['stall'] / max(one['stall'], 1e-9):.2f}x; "
                  f"largest rank's peak RSS {peak['peak_rss']:.2f}x, MLX {peak['peak_mlx']:.2f}x; "
                  f"same tokens: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
