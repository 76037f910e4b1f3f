"""`moe-l2 demo`: the whole system on a small built-in model, in about a minute.

Creates the demo model in the user cache dir (once) and generates from a few prompts five times, the model's
pages dropped from the page cache (Linux) before the first, the second and the last: with no daemon; with a
private moe-l2d, L2 cold, then warm (each with a fresh L0); in a second process started against the warm daemon;
and in a third process once the daemon was stopped and started again (it preloads what it held). It shows side by
side where the experts came from, the bytes read from disk, the time spent waiting for experts per token and the
time to the first token, says whether compute or the experts dominate on this machine and what the daemon changed
for one process, checks the tokens against the model loaded whole, and stops the daemon.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_l2.model.location import path_arg

DEMO_NAME = "demo-qwen3-moe-v2"
# Small enough to run in about a minute on two CPU cores (MLX's CPU float16 kernels are slow: a token's compute
# grows with the expert size), with many experts, so that a cold run reads many records from disk.
DEMO_MODEL = dict(arch="qwen3_moe", layers=4, experts=128, top_k=4, hidden_size=128, moe_hidden_size=128, bits=4,
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
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt (default 16)")
    parser.add_argument("--l0-slots", type=int, default=None,
                        help="experts in each run's L0, one set of rows for all layers as moe-l2 generate has "
                             "with a daemon (default: moe-l2 plan's for this machine)")
    parser.add_argument("--cache-dir", type=path_arg, default=None,
                        help="where the demo model lives (default: the user cache dir)")
    return parser


def ensure_demo_model(cache_dir: Path | None = None, out=sys.stderr) -> Path:
    """The demo model's directory, made (with a progress bar) if it is not there yet."""
    from tqdm import tqdm

    from moe_l2.lab.random_models import make_model

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
        # On disk before the rename, and so cleanly cached: the page cache can drop only written-back pages.
        for file in (work / "model").iterdir():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(work / "model", path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def _run_prompts(model: Path, socket: str | None, l0_slots: int | None, max_tokens: int) -> dict:
    """Generate from every prompt with a fresh L0 in this process; what `render_table` shows of one run."""
    from moe_l2.lm.streamed_lm import StreamedLM
    from moe_l2.client.pool import TierCounts
    from moe_l2.lm.generation import encode_prompt, generate_streamed

    counts = TierCounts()
    tokens, texts = [], []
    generated = 0
    wall_s = stall_s = 0.0
    first_token_s = None
    with StreamedLM(model, l0_slots=l0_slots, socket=socket, daemon=socket is not None, client_wait_s=5.0) as lm:
        attached = lm.client.attached if lm.client is not None else False
        for prompt in PROMPTS:
            start = time.perf_counter()
            r = generate_streamed(lm, encode_prompt(lm.tokenizer, prompt), max_tokens)
            wall_s += time.perf_counter() - start
            # The streamed forward's time in the pool's fetches and loans: waiting for experts, prefill included.
            stall_s += r.stats["fetch_s"]
            if first_token_s is None:  # mlx-lm's prompt time ends with the first token
                first_token_s = r.prompt_tokens / r.prompt_tps
            counts.add(r.counts)
            tokens.append(r.tokens)
            texts.append(r.text)
            generated += r.generation_tokens
        slots = f"{lm.pool.capacity} experts {'in all layers' if lm.pool.shared_l0 else 'per layer'}"
    return {"counts": counts, "tokens": tokens, "texts": texts, "attached": attached, "l0_slots": slots,
            "generated": generated, "wall_s": wall_s, "stall_s": stall_s, "first_token_s": first_token_s}


def _run_in_second_process(model: Path, socket: str, l0_slots: int | None, max_tokens: int) -> dict:
    """`_run_prompts` in a fresh Python process (python -m moe_l2.cli.demo), as another user's would be."""
    from moe_l2.client.pool import TierCounts

    job = json.dumps({"model": str(model), "socket": socket, "l0_slots": l0_slots, "max_tokens": max_tokens})
    # -P: a source checkout in the working directory must not shadow the installed package.
    done = subprocess.run([sys.executable, "-P", "-m", __name__, job], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the second process exited with {done.returncode}: {last}")
    result = json.loads(done.stdout.splitlines()[-1])
    result["counts"] = TierCounts(**result["counts"])
    return result


def _daemon_figures(socket: str) -> tuple[int, int, int]:
    """(bytes moe-l2d has read from the model files, experts it holds in L2, experts processes gave it), once its
    loads and fills are done."""
    from moe_l2 import protocol
    from moe_l2.client.connection import request, wait_idle

    wait_idle(socket)
    served = request(socket, protocol.Stats(id=1)).payload["models"][0]
    return (served["loaded_bytes"], sum(layer["resident"] for layer in served["layers"]),
            served["fills"]["donated"])


def _whole_model_tokens(model: Path, max_tokens: int) -> list[list[int]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    from moe_l2.lm.generation import encode_prompt

    whole, tokenizer = load(str(model))
    return [[r.token for r in stream_generate(whole, tokenizer, mx.array(encode_prompt(tokenizer, p)),
                                              max_tokens=max_tokens)] for p in PROMPTS]


# The runs, in order: a name, and the state of L2 as each began.
RUNS = (("alone", "no daemon"), ("run 1", "L2 cold"), ("run 2", "L2 warm"), ("process 2", "L2 warm"),
        ("process 3", "restart"))
LABEL_WIDTH, COLUMN_WIDTH = 32, 20


def _per_token_ms(run: dict, seconds: float) -> float:
    return 1e3 * seconds / run["generated"]


def render_table(*runs: dict) -> str:
    """The runs side by side (RUNS names them); each has `_run_prompts`' figures and `daemon_read`, the bytes
    moe-l2d read from the model files meanwhile."""
    from moe_l2.lm.streamed_lm import hit_rates
    from moe_l2.sizes import format_pct, format_size

    def rows(run):
        c = run["counts"]
        rates = hit_rates(c)
        return [f"{rates['lookups']}", format_pct(rates["l0"]), format_pct(rates["l2"]),
                format_pct(rates["daemon_disk"]), format_pct(rates["own_disk"]), format_size(run["daemon_read"]),
                format_size(c.bytes_read), format_size(c.bytes_copied),
                f"{_per_token_ms(run, run['stall_s']):.2f}", f"{1e3 * run['first_token_s']:.0f}"]

    # Each lookup by where its bytes came from: a miss the daemon loads while the process waits (load-through)
    # is read from disk once, by the daemon, and is no cache hit.
    labels = ["expert lookups", "L0 hits (this process)", "L2 hits (shared memory)", "disk, read by moe-l2d",
              "disk, read by this process", "read from disk by moe-l2d", "read from disk by this process",
              "copied from L2", "waiting for experts, ms/token", "time to first token, ms"]
    lines = ["".ljust(LABEL_WIDTH) + "".join(f"{f'{name}: {l2}':>{COLUMN_WIDTH}s}" for name, l2 in RUNS[:len(runs)])]
    lines += [f"{label:{LABEL_WIDTH}s}" + "".join(f"{v:>{COLUMN_WIDTH}s}" for v in values)
              for label, *values in zip(labels, *map(rows, runs))]
    return "\n".join(lines)


def render_verdict(cold: dict, *warm: dict) -> str:
    """What dominates a token's time on this machine, computing or waiting for experts, and what L2 changed."""
    compute = _per_token_ms(cold, cold["wall_s"] - cold["stall_s"])
    stall = _per_token_ms(cold, cold["stall_s"])
    after = ", ".join(f"{_per_token_ms(run, run['stall_s']):.2f} ms ({name})" for (name, _), run in zip(RUNS[2:], warm))
    return (f"on this machine {'compute' if compute >= stall else 'waiting for experts'} dominates: run 1 spent "
            f"{compute:.1f} ms per token computing and {stall:.2f} ms waiting for experts; with L2 warm, the wait "
            f"was {after}")


def render_gains(alone: dict, *runs: dict) -> str:
    """What moe-l2d changed for one process: each run's wait for experts and disk reads against the run alone."""
    from moe_l2.sizes import format_size

    def wait(run: dict) -> float:
        return _per_token_ms(run, run["stall_s"])

    def read(run: dict) -> int:
        return run["counts"].bytes_read + run["daemon_read"]

    parts = [f"{name} ({l2}) {wait(run):.2f} ms and {format_size(read(run))}"
             for (name, l2), run in zip(RUNS[1:], runs)]
    return (f"one process against none: alone (no daemon, nothing cached) waited {wait(alone):.2f} ms a token for "
            f"experts and read {format_size(read(alone))} from disk; with moe-l2d, " + ", ".join(parts))


def _await_preload(socket: str, timeout_s: float = 60.0) -> int:
    """Until a restarted moe-l2d has preloaded what its predecessor held (its warm start has nothing pending:
    queued or being read); returns how many experts it preloaded."""
    from moe_l2 import protocol
    from moe_l2.client.connection import request

    deadline = time.monotonic() + timeout_s
    while (warm := request(socket, protocol.Stats(id=1)).payload["models"][0]["warm_start"] or {}).get("pending"):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"moe-l2d on {socket} had not preloaded what it held after {timeout_s:g} s")
        time.sleep(0.05)
    return warm.get("preloaded", 0)


def _runs_with_daemon(model: Path, files, args: argparse.Namespace, out: dict) -> tuple[int, list[str]]:
    """Run 1, run 2 and process 2 against a private moe-l2d, then process 3 against it stopped and started again
    (in the same state dir: it preloads what it held), the model's pages dropped before it. Fills `out`; returns
    the daemons' exit status (the first non-zero) and the shared memory they left."""
    from moe_l2.lab.bench import drop_page_cache
    from moe_l2.lab.daemon_process import DaemonProcess
    from moe_l2.layout import Geometry

    every_expert = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, files.n_experts)
    first = DaemonProcess.serving([model], every_expert)
    second = DaemonProcess.serving([model], every_expert, runtime_dir=first.runtime_dir)
    print("starting moe-l2d for it ...", flush=True)
    try:
        first.start()
        print(f"  serving on {first.socket}")

        def measured(daemon, run_prompts) -> dict:
            before = _daemon_figures(daemon.socket)[0]
            one = run_prompts()
            read, resident, given = _daemon_figures(daemon.socket)
            return dict(one, daemon_read=read - before, resident=resident, given=given)

        print("run 1 (L2 cold: experts come from the model file, read by this process, which gives them to L2) ...",
              flush=True)
        out["run 1"] = measured(first, lambda: _run_prompts(model, first.socket, args.l0_slots, args.max_tokens))
        print("run 2 (L2 warm: a fresh L0 in this process finds the experts in shared memory) ...", flush=True)
        out["run 2"] = measured(first, lambda: _run_prompts(model, first.socket, args.l0_slots, args.max_tokens))
        print("process 2 (L2 warm: a second process, started now, finds them there too) ...", flush=True)
        out["process 2"] = measured(
            first, lambda: _run_in_second_process(model, first.socket, args.l0_slots, args.max_tokens))
        print("process 3 (moe-l2d stopped and started again: it preloads what it held, then a third process) ...",
              flush=True)
        first.stop()
        drop_page_cache(files)
        second.start()
        preloaded = _await_preload(second.socket)
        out["process 3"] = dict(measured(
            second, lambda: _run_in_second_process(model, second.socket, args.l0_slots, args.max_tokens)),
            preloaded=preloaded)
    finally:
        codes = [first.stop(), second.stop()]
        left = second.cleanup() + first.cleanup()
    return next((c for c in codes if c), 0), left


def run(args: argparse.Namespace) -> int:
    from moe_l2.lab.bench import drop_page_cache
    from moe_l2.model import ModelFiles
    from moe_l2.sizes import format_size

    if args.max_tokens < 1:
        print("moe-l2 demo: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    model = ensure_demo_model(args.cache_dir)
    files = ModelFiles.open(model)
    record = files.layout.nbytes
    print(f"demo model: {model}\n  {files.model_type}, {files.n_layers} MoE layers x {files.n_experts} experts "
          f"(top {files.top_k}), {format_size(record)} per expert")
    # So that the first runs read the disk, not what the last run (or the model's creation) left in memory.
    dropped = hasattr(os, "posix_fadvise")
    drop_page_cache(files)
    print("alone (no daemon: what L0 lacks is read from the model file by this process) ...", flush=True)
    by_name = {"alone": dict(_run_prompts(model, None, args.l0_slots, args.max_tokens), daemon_read=0)}
    drop_page_cache(files)
    try:
        code, left = _runs_with_daemon(model, files, args, by_name)
    except RuntimeError as exc:
        print(f"moe-l2 demo: {exc}", file=sys.stderr)
        return 1

    print("checking against the model loaded whole ...", flush=True)
    whole = _whole_model_tokens(model, args.max_tokens)
    runs = [by_name[name] for name, _ in RUNS]
    same = [all(run["tokens"][i] == tokens for run in runs) for i, tokens in enumerate(whole)]
    alone, cold = runs[0], runs[1]

    print()
    for prompt, text in zip(PROMPTS, cold["texts"]):
        print(f"> {prompt}\n{text.strip()[:200]}\n")
    print("(random weights: the text is noise; what matters is where the experts came from)\n")
    print(f"L0: {cold['l0_slots']} in each process with the daemon, {alone['l0_slots']} alone (a layer has "
          f"{files.n_experts} experts); L2: every expert fits the daemon's shared memory")
    print(render_table(*runs))
    print()
    print(f"run 1: L2 took in {cold['resident']} experts of {format_size(record)} "
          f"({format_size(cold['resident'] * record)}): {cold['given']} read by this process and given to it, "
          f"{cold['resident'] - cold['given']} read by moe-l2d; "
          + ("from disk: the model's pages were dropped from the page cache first" if dropped else
             "perhaps from the page cache: nothing drops one file's cached pages here"))
    print(f"process 3: the restarted moe-l2d read {runs[4]['preloaded']} experts "
          f"({format_size(runs[4]['preloaded'] * record)}) from disk before it started, what its predecessor held")
    print("ms/token: over the tokens generated, prefill included; waiting for experts: the forward's time in L0 "
          "fills, L2 copies and loans, disk reads and load-through; time to first token: the first prompt's")
    print(render_verdict(*runs[1:]))
    print(render_gains(*runs))
    print("attached to the daemon: " + ", ".join(f"{name} {'yes' if r['attached'] else 'NO'}"
                                                 for (name, _), r in zip(RUNS[1:], runs[1:])))
    print(f"tokens identical to the whole model: {sum(same)}/{len(same)} prompts")
    print(f"daemon stopped (exit {code}); shared memory "
          f"{'cleaned up' if not left else 'left behind and now removed: ' + ', '.join(left)}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    ok = all(same) and all(r["attached"] for r in runs[1:]) and not left and code == 0
    return 0 if ok else 1


def _second_process(job: str) -> int:
    """The second process' side of `_run_in_second_process`: one JSON line of its figures."""
    options = json.loads(job)
    result = _run_prompts(Path(options["model"]), options["socket"], options["l0_slots"], options["max_tokens"])
    result["counts"] = dataclasses.asdict(result["counts"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_second_process(sys.argv[1]))
