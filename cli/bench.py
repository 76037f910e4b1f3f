"""`moe-l2 bench`: a routing trace through the real data path at real expert sizes, moe-l2 against the page
cache and against pread-only streaming at the same memory (docs/architecture.md, "The bench"): its flags, its
table and plot; moe_l2.lab.bench runs the configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import threading
from pathlib import Path

import platformdirs


from moe_l2.cache.prefetch import Score
from moe_l2.cache.trace import TraceError, read_traces
from moe_l2.client import options
from moe_l2.cli.flags import add_renamed
from moe_l2.model import ModelFiles
from moe_l2.model.location import path_arg, resolve_model
from moe_l2.lab.busy import busy_cores
from moe_l2.lab.synthetic import GEOMETRIES, SyntheticError, build
from moe_l2.sizes import format_pct, format_size
from moe_l2.lab.bench import (BASES, CONFIGS, DEFAULT_COMPUTE_MS, DEFAULT_CONFIGS, HIT_RATES, PHASES, STREAMING, VARIED,
                              BenchError, BenchResult, ConfigResult, Skipped, bases, loaded_text, run_config,
                              trace_parts)

class Terminated(Exception):
    """SIGTERM, raised where the bench is, so that what it started is stopped and removed on the way out."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, type=path_arg, metavar="FILE",
                        help="routing trace to replay (the shared traces' JSON Lines format, .gz or not)")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES),
                        help="expert shapes and sizes of this model, built once as random bytes (default: the "
                             "trace's model)")
    parser.add_argument("--model", metavar="DIR|ID", help="use this real checkpoint instead of a built geometry")
    add_renamed(parser, "--first-layers", "--layers", type=int, metavar="N",
                help="only the first N MoE layers of the geometry and the trace (default: all)")
    parser.add_argument("--tokens", type=int, metavar="N", help="replay at most N tokens over all processes")
    parser.add_argument("--warmup", type=float, default=0.2, metavar="SHARE",
                        help="share of each process' tokens that warms the caches before measuring (default 0.2)")
    parser.add_argument("--compute-ms", type=float, default=DEFAULT_COMPUTE_MS, metavar="MS",
                        help=f"model compute per layer, during which background work may run (default "
                             f"{DEFAULT_COMPUTE_MS}: decode on an M2 Max, see docs/architecture.md)")
    parser.add_argument("--busy-cores", type=int, default=0, metavar="N",
                        help="keep N cores busy with CPU-bound programs while the configurations run, as on a "
                             "machine doing other work (default 0)")
    add_renamed(parser, "--budget-share", "--budget", default="25%,50%", metavar="SHARE[,SHARE...]",
                help="memory for experts, as shares of all experts' bytes (default 25%%,50%%)")
    parser.add_argument("--processes", default="1,3", metavar="N[,N...]",
                        help="concurrent client processes, each replaying its share of the sequences (default 1,3)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), metavar="NAME[,NAME...]",
                        help=f"configurations to run, of {', '.join(CONFIGS)} (moe-l2+autopin: moe-l2 with "
                             "--l0-autopin, per-layer L0; moe-l2+load-through: moe-l2 with --no-fill-l2, as a "
                             "process of another user runs; moe-l2+POLICY: moe-l2 with moe-l2d's --policy POLICY) "
                             f"(default {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--scenario", choices=("cold-warm",),
                        help="cold-warm: the demo's scenario, each configuration's clients replaying their tokens "
                             "cold (nothing cached, a fresh daemon), again warm, then as new processes against what "
                             "the first left warm (no --warmup)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="runs of each configuration at each point, taking turns (A B A B ...): each figure is "
                             "the median of its runs, with min-max, and each ratio the median of the ratios of "
                             "runs side by side (default 1)")
    options.add_arguments(parser, STREAMING, "moe-l2 and moe-l2+prefetch: streaming, as moe-l2 generate")
    parser.add_argument("--l0-share", type=float, metavar="F",
                        help="moe-l2: share of a process' part of the budget that its L0 gets, at least top-k rows "
                             "(a layer's, or in all for a shared L0: twice that with --fill-l2); one daemon's L2 "
                             "gets the rest (default: 0 with in-place reads, 0.5 with copies)")
    parser.add_argument("--cache-dir", type=path_arg, metavar="DIR",
                        help="where built geometries are kept and reused (default: the user cache dir)")
    parser.add_argument("--plot", type=path_arg, metavar="FILE.png", help="also draw tok/s and stall to a PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _shares(text: str) -> list[float]:
    shares = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise BenchError("--budget-share takes shares like 25% or 0.25, separated by commas, "
                             f"not {part!r}") from None
        if not 0 < value <= 1:
            raise BenchError(f"--budget-share {part} must be above 0 and at most 100%")
        shares.append(value)
    return shares


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise BenchError(f"{flag} takes whole numbers separated by commas, not {text!r}") from None
    if not values or min(values) < 1:
        raise BenchError(f"{flag} needs numbers of at least 1, not {text!r}")
    return values


def _model(args, traces) -> tuple[Path, str]:
    """The model directory to read, and what to call it."""
    if args.model:
        if args.geometry or args.first_layers:
            raise BenchError("--model uses a real checkpoint as it is: leave out --geometry and --first-layers")
        return Path(resolve_model(args.model)), args.model
    name = args.geometry or traces.model
    if name not in GEOMETRIES:
        raise BenchError(f"the trace's model is {traces.model!r}, which is no known geometry: pass --geometry "
                         f"({', '.join(sorted(GEOMETRIES))}) or --model")
    geometry = GEOMETRIES[name]
    if (geometry.n_experts, geometry.top_k) != (traces.n_experts, traces.top_k):
        raise BenchError(f"the trace routes {traces.n_experts} experts, top-{traces.top_k} ({traces.model}); "
                         f"{name} has {geometry.n_experts}, top-{geometry.top_k}: pass the geometry of the "
                         "trace's model, or another trace")
    layers = min(args.first_layers or geometry.n_moe_layers, traces.n_layers)
    cache = args.cache_dir or Path(platformdirs.user_cache_dir("moe-l2")) / "bench"
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    return build(geometry, layers, cache, say=say), f"{name}, {layers} MoE layers"


def render(result: BenchResult) -> str:
    lines = [f"{result.model}: record {format_size(result.record_bytes)}, experts "
             f"{format_size(result.expert_bytes)}; trace {result.trace}; compute "
             f"{result.compute_s_per_layer * 1e3:g} ms per layer; L2 reads {result.l2_reads}; {result.machine}"
             + (f", {result.busy_cores} kept busy beside the runs" if result.busy_cores else "")
             + (f"; load average {result.load_average:.1f} at the end" if result.load_average is not None else ""),
             ""]
    phases = any(c.phase for c in result.configs)
    lines.append(f"{'config':<16}{'budget':>7}{'procs':>6}" + (f"  {'phase':<12}" if phases else "")
                 + f"{'stall ms/tok':>13}{'1st tok ms':>11}{'tok/s':>8}{'vs page-cache':>14}"
                 f"{'vs pread':>9}{'vs moe-l2':>10}{'L0 hit':>8}{'L2 hit':>8}{'pc hit':>8}{'files':>6}{'disk MB/tok':>12}{'peak':>11}")
    for c in result.configs:
        head = (f"{c.name:<16}{format_pct(c.budget_share, 0, sign=False):>7}{c.processes:>6}"
                + (f"  {c.phase:<12}" if phases else ""))
        if c.skipped is not None:
            lines.append(f"{head}  skipped: {c.skipped}")
            continue
        ratios = []
        for base in BASES + (VARIED,):
            ratio = result.ratio(c, base) if base in bases(c.name) else None
            ratios.append(f"{ratio.median:.2f}x" if ratio else "-")
        tiers = c.counts().by_source()
        files = (tiers["daemon_disk"] + tiers["own_disk"]) / max(1, sum(tiers.values()))
        lines.append(f"{head}{c.median('stall_s_per_token') * 1e3:>13.2f}{c.median('first_token_s') * 1e3:>11.1f}"
                     f"{c.median('tok_s_projected'):>8.1f}"
                     f"{ratios[0]:>14}{ratios[1]:>9}{ratios[2]:>10}"
                     + "".join(f"{format_pct(c.hit_rate(t), 0, sign=False):>8}" for t in HIT_RATES)
                     + f"{format_pct(files, 0, sign=False):>6}{c.median('disk_bytes_per_token') / 1e6:>12.1f}"
                     f"{format_size(c.median('peak_bytes')):>11}")
    for c in result.done():
        pf = c.prefetch()
        if pf:
            score = Score(pf["guessed"], pf["picked"], pf["right"])
            tokens = sum(r.tokens for r in c.runs)
            lines.append(f"{c.name} at {format_pct(c.budget_share, 0)}, {c.processes} processes"
                         + (f", {c.phase}" if c.phase else "") + ": guesses "
                         f"{format_pct(score.precision)} right (precision), "
                         f"{format_pct(score.recall)} of picks guessed "
                         f"(recall); {pf['issued']} loaded ahead {loaded_text(pf, tokens)}, {pf['useful']} promoted, "
                         f"{pf['wasted']} dropped")
    if result.repeat > 1:
        lines += ["", f"Over {result.repeat} runs of each, taking turns: the figures above are medians; min-max, and "
                      "the ratios of the runs side by side:"]
        for c in result.done():
            (lo, hi), (tlo, thi) = c.spread("stall_s_per_token"), c.spread("tok_s_projected")
            against = [f"vs {r.against} {r.median:.2f}x ({min(r.pairs):.2f}-{max(r.pairs):.2f}, {len(r.pairs)} pairs)"
                       for base in bases(c.name) if c.name != base and (r := result.ratio(c, base))]
            lines.append(f"  {c.name} at {format_pct(c.budget_share, 0)}, {c.processes} processes"
                         + (f", {c.phase}" if c.phase else "") + ": stall "
                         f"{lo * 1e3:.2f}-{hi * 1e3:.2f} ms/tok, tok/s {tlo:.1f}-{thi:.1f}"
                         + "".join(f"; {a}" for a in against))
    if phases:
        lines += ["", "Phases (--scenario cold-warm): cold, each client's first pass, nothing cached (page cache "
                      "dropped, a fresh daemon); warm, the same clients again; new process, fresh clients once the "
                      "first have exited, against what they left warm (the daemon's L2, the page cache)"]
    lines += ["", "tok/s = 1 / (compute + stall) for the layers replayed; stall: fetch time compute did not hide; "
              "1st tok: the first token's stall and compute; vs moe-l2: a variant's (moe-l2+X) tok/s over moe-l2's; "
              "L2 hit: held in L2 when looked up, over L0 misses; pc hit: page-cache hits (from the kernel's "
              "disk-read count); files: lookups read from the model files, by the client or by the daemon while it "
              "waited; "
              "peak: the processes' anonymous memory, the daemon's segments and, for page-cache, the cgroup's peak "
              "(page cache included)"]
    return "\n".join(lines)


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = result.done()
    points = list(dict.fromkeys(c.point for c in done))  # in the order they ran
    names = [n for n in CONFIGS if any(c.name == n for c in done)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        by_point = {c.point: c for c in done if c.name == name}
        xs = [j + i * width for j, p in enumerate(points) if p in by_point]
        for ax, key, scale in zip(axes, ("tok_s_projected", "stall_s_per_token"), (1, 1e3)):
            ax.bar(xs, [by_point[p].median(key) * scale for p in points if p in by_point], width, label=name)
    labels = [f"{100 * s:g}%, {n} proc" + (f", {phase}" if phase else "") for s, n, phase in points]
    for ax, title in zip(axes, ("projected tok/s (higher is better)", "stall ms per token (lower is better)")):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(points))], labels)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"moe-l2 bench: {result.model}, compute {result.compute_s_per_layer * 1e3:g} ms/layer")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    # Ctrl-C (KeyboardInterrupt) and SIGTERM unwind through run_config, which stops what it started.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args)
    except (KeyboardInterrupt, Terminated) as exc:
        signum = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
        print(f"moe-l2 bench: stopped by {signal.Signals(signum).name}; its daemon, client processes and cgroup "
              "are gone", file=sys.stderr)
        return 128 + signum
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run_points(result: BenchResult, files: ModelFiles, shares: list[float], counts: list[int],
                configs: list[str], traces, args: argparse.Namespace) -> None:
    """Run each configuration at each point (budget share, processes) into `result`."""
    for share in shares:
        for n in counts:
            # cold-warm: no warm-up, the first pass is the cold one; the second round's clients are new.
            parts = trace_parts(traces, files.n_layers, n, args.tokens, 0 if args.scenario else args.warmup)
            rounds = [(parts, 2), (parts, 1)] if args.scenario else [(parts, 1)]
            phases = PHASES if args.scenario else (None,)
            by_config = {config: [ConfigResult(config, share, n, phase) for phase in phases] for config in configs}
            result.configs += [c for point in by_config.values() for c in point]
            # Interleaved, so that the disk's drift between runs falls on every configuration alike.
            for _ in range(args.repeat):
                for config, point in by_config.items():
                    if point[0].skipped is not None:
                        continue
                    try:
                        plan, runs = run_config(files, config, share, rounds, args)
                    except Skipped as exc:
                        for c in point:
                            c.skipped = str(exc)
                        continue
                    for c, run in zip(point, runs):
                        c.l0_experts, c.l0_shared, c.l2_slots, c.budget_bytes = (
                            plan["capacity"], plan["shared_l0"], plan["slots"], plan["budget"])
                        c.runs.append(run)


def _run(args: argparse.Namespace) -> int:
    try:
        shares, counts = _shares(args.budget_share), _ints(args.processes, "--processes")
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown or not configs:
            raise BenchError(f"--configs takes names from {', '.join(CONFIGS)}, not {', '.join(unknown) or 'none'}")
        if args.tokens is not None and args.tokens < 1 or not 0 <= args.warmup < 1 or args.compute_ms < 0:
            raise BenchError("--tokens must be at least 1, --warmup a share below 1, --compute-ms at least 0")
        if args.repeat < 1:
            raise BenchError(f"--repeat must be at least 1, not {args.repeat}")
        if args.busy_cores < 0:
            raise BenchError(f"--busy-cores must be 0 or more, not {args.busy_cores}")
        traces = read_traces(args.trace)
        path, name = _model(args, traces)
        files = ModelFiles.open(path)
        if (files.n_experts, files.top_k) != (traces.n_experts, traces.top_k) or files.n_layers > traces.n_layers:
            raise BenchError(f"{name}: {files.n_layers} MoE layers of {files.n_experts} experts, top-{files.top_k}; "
                             f"the trace has {traces.n_layers} layers of {traces.n_experts}, top-{traces.top_k}")
        result = BenchResult(model=name, trace=str(args.trace), layers=files.n_layers,
                             compute_s_per_layer=args.compute_ms / 1e3, l2_reads=args.l2_reads,
                             record_bytes=files.layout.nbytes,
                             expert_bytes=files.n_layers * files.n_experts * files.layout.nbytes,
                             machine=f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
                             repeat=args.repeat, busy_cores=args.busy_cores)
        with busy_cores(args.busy_cores):
            _run_points(result, files, shares, counts, configs, traces, args)
        result.load_average = os.getloadavg()[0]
        if not result.done():
            raise BenchError("nothing could run: " + "; ".join(c.skipped for c in result.configs))
    except (BenchError, TraceError, SyntheticError, ValueError, OSError) as exc:
        print(f"moe-l2 bench: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result))
    return 0
