"""`moe-l2 demo`: the whole system on a small built-in model, in about a minute.

Creates the demo model in the user cache dir (once), starts a private moe-l2d for it, generates from a few
prompts twice (L2 cold, then warm, each with a fresh L0 as a new process would have), shows where the
experts came from side by side, checks the tokens against the model loaded whole, and stops the daemon.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from moe_l2.model.location import path_arg

DEMO_NAME = "demo-qwen3-moe-v1"
# Small enough to run in about a minute on two CPU cores (MLX's CPU float16 kernels are slow).
DEMO_MODEL = dict(arch="qwen3_moe", layers=4, experts=32, top_k=4, hidden_size=128, moe_hidden_size=128, bits=4,
                  seed=7)
PROMPTS = (
    "Explain how a cache hierarchy keeps the hot data close.",
    "Write a short story about a lighthouse keeper.",
    "What is a mixture of experts model?",
)


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("moe-l2"))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    parser.add_argument("--l0-slots", type=int, default=None,
                        help="experts in each run's L0, one set of rows for all layers as moe-l2 generate has "
                             "with a daemon (default: moe-l2 plan's for this machine)")
    parser.add_argument("--cache-dir", type=path_arg, default=None,
                        help="where the demo model lives (default: the user cache dir)")
    return parser


def ensure_demo_model(cache_dir: Path | None = None, out=sys.stderr) -> Path:
    """The demo model's directory, made (with a progress bar) if it is not there yet."""
    from tqdm import tqdm

    from moe_l2.generator import make_model

    cache_dir = cache_dir or default_cache_dir()
    path = cache_dir / DEMO_NAME
    if (path / "config.json").exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Built beside its final place and renamed, so that an interrupted build leaves no half model.
    work = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=cache_dir))
    try:
        with tqdm(total=4, desc="creating the demo model", unit="step", file=out, leave=True) as bar:
            def step(message: str) -> None:
                bar.set_postfix_str(message[:60])
                bar.update(1)

            make_model(work / "model", progress=step, **DEMO_MODEL)
            bar.n = bar.total
            bar.refresh()
        os.replace(work / "model", path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def _run_prompts(model: Path, socket: str | None, l0_slots: int | None, max_tokens: int) -> dict:
    from moe_l2.client.mlx_lm import StreamedLM
    from moe_l2.client.pool import TierCounts
    from moe_l2.client.generation import encode_prompt, generate_streamed

    counts = TierCounts()
    tokens, texts = [], []
    prompt_n = gen_n = 0
    prompt_s = gen_s = 0.0
    with StreamedLM(model, l0_slots=l0_slots, socket=socket, daemon=socket is not None, client_wait_s=5.0) as lm:
        attached = lm.client.attached if lm.client is not None else False
        for prompt in PROMPTS:
            r = generate_streamed(lm, encode_prompt(lm.tokenizer, prompt), max_tokens)
            counts.add(r.counts)
            tokens.append(r.tokens)
            texts.append(r.text)
            prompt_n += r.prompt_tokens
            gen_n += r.generation_tokens
            prompt_s += r.prompt_tokens / r.prompt_tps
            gen_s += r.generation_tokens / r.generation_tps
        slots = f"{lm.pool.capacity} experts {'in all layers' if lm.pool.shared_l0 else 'per layer'}"
    return {"counts": counts, "tokens": tokens, "texts": texts, "attached": attached, "l0_slots": slots,
            "prompt_tps": prompt_n / prompt_s, "generation_tps": gen_n / gen_s}


def _whole_model_tokens(model: Path, max_tokens: int) -> list[list[int]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    from moe_l2.client.generation import encode_prompt

    whole, tokenizer = load(str(model))
    return [[r.token for r in stream_generate(whole, tokenizer, mx.array(encode_prompt(tokenizer, p)),
                                              max_tokens=max_tokens)] for p in PROMPTS]


def render_table(cold: dict, warm: dict) -> str:
    from moe_l2.client.mlx_lm import hit_rates
    from moe_l2.sizes import format_pct, format_size

    def rows(run):
        c = run["counts"]
        rates = hit_rates(c)
        return [f"{rates['lookups']}", format_pct(rates["l0"]), format_pct(rates["l2"]),
                format_pct(rates["daemon_disk"]), format_pct(rates["own_disk"]), format_size(c.bytes_read),
                format_size(c.bytes_copied), f"{run['prompt_tps']:.1f}", f"{run['generation_tps']:.1f}"]

    # Each lookup by where its bytes came from: a miss the daemon loads while the process waits (load-through)
    # is read from disk once, by the daemon, and is no cache hit.
    labels = ["expert lookups", "L0 hits (this process)", "L2 hits (shared memory)", "disk, read by moe-l2d",
              "disk, read by this process", "this process read", "copied from L2", "prefill tok/s", "decode tok/s"]
    lines = [f"{'':26s}{'run 1: L2 cold':>16s}{'run 2: L2 warm':>16s}"]
    lines += [f"{label:26s}{a:>16s}{b:>16s}" for label, a, b in zip(labels, rows(cold), rows(warm))]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from moe_l2.client.connection import wait_idle
    from moe_l2.daemon.process import DaemonProcess
    from moe_l2.layout import Geometry
    from moe_l2.model import ModelFiles
    from moe_l2.sizes import format_size

    if args.max_tokens < 1:
        print("moe-l2 demo: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    model = ensure_demo_model(args.cache_dir)
    files = ModelFiles.open(model)
    print(f"demo model: {model}\n  {files.model_type}, {files.n_layers} MoE layers x {files.n_experts} experts "
          f"(top {files.top_k}), {format_size(files.layout.nbytes)} per expert")
    every_expert = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, files.n_experts)
    daemon = DaemonProcess.serving([model], every_expert)
    print("starting moe-l2d for it ...", flush=True)
    try:
        daemon.start()
    except RuntimeError as exc:
        daemon.cleanup()
        print(f"moe-l2 demo: cannot start moe-l2d: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"  serving on {daemon.socket}")
        print("run 1 (L2 cold: experts come from the model file, and the daemon loads what was missed) ...",
              flush=True)
        cold = _run_prompts(model, daemon.socket, args.l0_slots, args.max_tokens)
        wait_idle(daemon.socket)
        print("run 2 (L2 warm: a fresh process, its L0 empty, finds the experts in shared memory) ...", flush=True)
        warm = _run_prompts(model, daemon.socket, args.l0_slots, args.max_tokens)
    finally:
        code = daemon.stop()
        left = daemon.cleanup()

    print("checking against the model loaded whole ...", flush=True)
    whole = _whole_model_tokens(model, args.max_tokens)
    same = [a == b == c for a, b, c in zip(cold["tokens"], warm["tokens"], whole)]

    print()
    for prompt, text in zip(PROMPTS, cold["texts"]):
        print(f"> {prompt}\n{text.strip()[:200]}\n")
    print("(random weights: the text is noise; what matters is where the experts came from)\n")
    print(f"L0: {cold['l0_slots']} in each process (a layer has {files.n_experts} experts); "
          f"L2: every expert fits the daemon's shared memory")
    print(render_table(cold, warm))
    print()
    print(f"attached to the daemon: run 1 {'yes' if cold['attached'] else 'NO'}, "
          f"run 2 {'yes' if warm['attached'] else 'NO'}")
    print(f"tokens identical to the whole model: {sum(same)}/{len(same)} prompts")
    print(f"daemon stopped (exit {code}); shared memory "
          f"{'cleaned up' if not left else 'left behind and now removed: ' + ', '.join(left)}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    ok = all(same) and cold["attached"] and warm["attached"] and not left and code == 0
    return 0 if ok else 1
