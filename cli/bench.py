"""`moe-l2 bench`: a routing trace through the real data path at real expert sizes, moe-l2 against the page
cache and against pread-only streaming at the same memory (docs/architecture.md, "Measured against the page
cache").

Each configuration runs N client processes (moe_l2.lab.replayer), each replaying its share of the trace's
sequences through a real ExpertPool: `page-cache` (buffered reads, the smallest L0, the processes and their
page cache held to the budget by a memory cgroup), `pread` (the budget as L0, split across the processes,
direct reads) and `moe-l2` (a per-process L0 and one real moe-l2d's L2 holding the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from moe_l2 import protocol

from moe_l2.lab import lifeline
from moe_l2.cache.prefetch import Score
from moe_l2.cache.trace import TraceError, read_traces
from moe_l2.lab.cgroup import MemoryCgroup
from moe_l2.client import options
from moe_l2.client.connection import request
from moe_l2.client.donor import SHARED_ROWS
from moe_l2.client.pool import TierCounts
from moe_l2.client.prefetcher import side_rows
from moe_l2.lab.replayer import anon_bytes, disk_read_bytes
from moe_l2.cli.flags import add_renamed
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.layout import BudgetError, Geometry
from moe_l2.model import ModelFiles
from moe_l2.model.location import path_arg, resolve_model
from moe_l2.lab.synthetic import GEOMETRIES, SyntheticError, build
from moe_l2.sizes import format_pct, format_size

CONFIGS = ("page-cache", "pread", "moe-l2", "moe-l2+prefetch", "moe-l2+autopin", "moe-l2+load-through")
# moe-l2+autopin and moe-l2+load-through are asked for by name: autopin is off by default
# (docs/policy-report.md, "Autopin"), and load-through is what a process of another user than the daemon's gets
# (moe-l2 with --no-fill-l2: docs/benchmarks.md, "Fills").
DEFAULT_CONFIGS = CONFIGS[:4]
# The streaming options the moe-l2 configurations take, as `generate` and `serve` do (client/options.py).
STREAMING = ("shared_l0", "l2_reads", "load_through_ms", "l0_grow", "fill_l2")
# Decode on Apple Silicon, per MoE layer: gpt-oss-20b (24 layers), MLX 4-bit, 91.5 tok/s on an M2 Max
# (docs/architecture.md, "The bench", cites the measurement): 1000 / 91.5 / 24 ms.
DEFAULT_COMPUTE_MS = 0.45
# page-cache: room per client process for its heap to grow past what it held warm, inside the cgroup's limit.
HEAP_ROOM = 16 << 20


class BenchError(ValueError):
    """Input the bench cannot run with; the message says what to do."""


class Skipped(BenchError):
    """One configuration cannot run at one point (the message says why); the others still run."""


class BudgetTooSmall(Skipped):
    """One point's budget cannot hold what the configuration needs."""


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
    add_renamed(parser, "--budget-share", "--budget", default="25%,50%", metavar="SHARE[,SHARE...]",
                help="memory for experts, as shares of all experts' bytes (default 25%%,50%%)")
    parser.add_argument("--processes", default="1,3", metavar="N[,N...]",
                        help="concurrent client processes, each replaying its share of the sequences (default 1,3)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), metavar="NAME[,NAME...]",
                        help=f"configurations to run, of {', '.join(CONFIGS)} (moe-l2+autopin: moe-l2 with "
                             "--l0-autopin, per-layer L0; moe-l2+load-through: moe-l2 with --no-fill-l2, as a "
                             f"process of another user runs) (default {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--scenario", choices=("cold-warm",),
                        help="cold-warm: the demo's scenario, each configuration's clients replaying their tokens "
                             "cold (nothing cached, a fresh daemon), again warm, then as new processes against what "
                             "the first left warm (no --warmup)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="runs of each configuration at each point, taking turns (A B A B ...): each figure is "
                             "the median of its runs, with min-max, and each ratio the median of the ratios of "
                             "runs side by side (default 1)")
    options.add_arguments(parser.add_argument_group("moe-l2 and moe-l2+prefetch: streaming, as moe-l2 generate"),
                          STREAMING)
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


def _parts(traces, n_layers: int, processes: int, tokens: int | None, warmup: float) -> list[tuple[list, int]]:
    """Per process: its tokens (sequences p, p + N, ... in order, cut to the layers) and how many warm up."""
    cap = None if tokens is None else tokens // processes
    parts = []
    for p in range(processes):
        mine = [[list(layer) for layer in token[:n_layers]]
                for s in traces.sequences[p::processes] for token in s.experts]
        mine = mine[:cap]
        warm = int(warmup * len(mine))
        if len(mine) - warm < 1:
            raise BenchError(f"process {p + 1} of {processes} has {len(mine)} tokens to replay: pass a larger "
                             "--tokens, a smaller --warmup or fewer --processes")
        parts.append((mine, warm))
    return parts


def _plan(files: ModelFiles, config: str, share: float, processes: int, l0_share: float,
          shared_l0: bool = False, fills: bool = False) -> dict:
    """L0 rows per layer (or in all, shared_l0) and process, and L2's budget and slots (in all layers): the same
    memory for experts in every config. moe-l2+prefetch's side rows (client/prefetcher.py) come out of it too:
    out of L0's share where L0 has one, else out of L2's."""
    layers = files.n_layers
    budget = int(share * layers * files.n_experts * files.layout.nbytes)
    # One L0 row, in all or in every layer: the memory it takes, as L2's budget counts its slots.
    row = files.layout.stride * (1 if shared_l0 else layers)
    top_k = files.top_k
    side = side_rows(top_k) if config == "moe-l2+prefetch" else 0
    l2_budget = slots = 0
    if config == "page-cache":
        capacity = top_k
    elif config == "pread":
        capacity = min(files.n_experts, budget // processes // row)
    else:
        most = files.n_experts * (layers if shared_l0 else 1)
        # A shared L0 whose misses are given to L2 holds them while the next layer reads (client/donor.py).
        least = top_k * (SHARED_ROWS if fills and shared_l0 else 1)
        capacity = max(least, min(most, int(l0_share * budget / processes) // row - side))
        # The daemon spends all of it: a remainder short of a slot in every layer buys slots in some layers.
        l2_budget = budget - processes * (capacity + side) * row
        try:
            slots = Geometry.for_budget(layers, files.n_experts, files.layout.nbytes, l2_budget).total_slots
        except BudgetError:
            raise BudgetTooSmall(f"{config} at {format_pct(share)} with {processes} processes: the L0s take the "
                                 f"whole budget ({format_size(budget)}), leaving no L2 slot in every layer: lower "
                                 "--l0-share or raise --budget-share") from None
    if capacity < top_k or processes * (capacity + side) * row > budget:
        beside = f" and {side} side rows for prefetch" if side else ""
        raise BudgetTooSmall(f"{config} at {format_pct(share)} ({format_size(budget)}) with {processes} processes: "
                             f"each process needs L0 rows for top-{top_k} experts{beside} "
                             f"{'in all' if shared_l0 else 'in every layer'} ({format_size((top_k + side) * row)}): "
                             "raise --budget-share or run fewer --processes")
    return {"budget": budget, "capacity": capacity, "side_rows": side, "l2_budget": l2_budget, "slots": slots,
            "shared_l0": shared_l0, "row_bytes": row}


def _drop_page_cache(files: ModelFiles) -> None:
    if not hasattr(os, "posix_fadvise"):
        return  # macOS: nothing drops one file's cached pages short of `purge`
    for path in files.files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_line(worker: subprocess.Popen, expect: str) -> dict:
    line = worker.stdout.readline()
    if not line:
        raise BenchError(f"a client process exited with {worker.wait()} before saying {expect!r}")
    message = json.loads(line)
    if "error" in message:
        raise BenchError(message["error"])
    return message


def _all(workers, expect: str) -> list[dict]:
    return [_read_line(w, expect) for w in workers]


def _go(workers) -> None:
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()


def _daemon_loaded(daemon: DaemonProcess, record: int) -> int:
    """Bytes the daemon read from the model files: the kernel's count where there is one, else its loads."""
    measured = disk_read_bytes(daemon.proc.pid)
    if measured is not None:
        return measured
    return request(daemon.socket, protocol.Stats(id=1)).payload["models"][0]["loads_done"] * record


def _loaded(pf: dict, tokens: int) -> str:
    """What the prefetches loaded into the side rows, per token, and from where."""
    return (f"into side rows ({format_size(pf['bytes_read'] / tokens)} read, "
            f"{format_size(pf['bytes_copied'] / tokens)} copied from L2 per token)")


def run_config(files: ModelFiles, config: str, share: float, rounds: list[tuple[list, int]],
               args) -> tuple[dict, list[Run]]:
    """One configuration at one point: start its daemon / cgroup, then for each round its clients (one per part,
    each replaying the part's measured tokens `passes` times), and sum what they saw in each pass. One daemon and
    cgroup serve every round: a later round's clients are fresh processes against what the earlier left warm.
    Returns its plan (_plan) and its runs, a round's passes in turn."""
    stream = options.from_args(args)
    in_place = stream.lend
    l0_share = args.l0_share if args.l0_share is not None else 0.0 if in_place else 0.5
    # moe-l2+prefetch is moe-l2 with next-layer prefetch into side rows, out of the same budget (_plan). Its L0
    # is laid out as a process of generate's with a daemon would lay it out.
    shared_l0 = config.startswith("moe-l2") and stream.l0_shared
    if config == "moe-l2+autopin" and shared_l0:
        # Against moe-l2 with the same L0 layout, autopin alone decides the ratio.
        raise Skipped("moe-l2+autopin pins in per-layer L0 rows, and moe-l2's L0 is shared here: run it with "
                      "--no-l0-shared and --l0-share above 0, or with --l2-reads copy")
    fills = stream.fill_l2 and config != "moe-l2+load-through"
    plan = _plan(files, config, share, len(rounds[0][0]), l0_share, shared_l0, fills)
    _drop_page_cache(files)
    daemon = cgroup = None
    runs: list[Run] = []
    try:
        if config == "page-cache":
            cgroup, why = MemoryCgroup.make(f"moe-l2-bench-{os.getpid()}")
            if cgroup is None:
                raise Skipped(why)
        # The daemon (as every DaemonProcess) and the clients are tied to this process (lab/lifeline.py):
        # killed outright, it leaves no orphan holding segments; the cgroup has its own keeper.
        if plan["slots"]:
            daemon = DaemonProcess.serving([files.path], plan["l2_budget"], "--log-level", "warning").start()
        job = {"model": str(files.path), "capacity": plan["capacity"], "policy": stream.policy,
               "direct": config != "page-cache", "socket": daemon.socket if daemon else None,
               "cgroup": str(cgroup.path) if cgroup else None, "compute_ms": args.compute_ms,
               "load_through_ms": stream.load_through_ms, "prefetch": config == "moe-l2+prefetch",
               "lend": in_place, "shared_l0": shared_l0, "grow": stream.l0_grow,
               "autopin": config == "moe-l2+autopin", "fill_l2": fills}
        for parts, passes in rounds:
            runs += _round(files, config, plan, job, parts, passes, daemon, cgroup, limit=not runs)
    finally:
        if daemon is not None:
            daemon.cleanup()
        if cgroup is not None:
            cgroup.remove()
    return plan, runs


def _round(files, config, plan, job, parts, passes, daemon, cgroup, limit: bool) -> list[Run]:
    """One round of run_config: a client process per part, `passes` measured passes, then the clients end."""
    workers: list[subprocess.Popen] = []
    runs = []
    try:
        for tokens, warm in parts:
            # Its own process group: a Ctrl-C to the bench's terminal reaches the bench, which ends its clients
            # (a client still importing would die of it with a traceback).
            w = subprocess.Popen(lifeline.command("moe_l2.lab.replayer"), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, process_group=0)
            workers.append(w)
            w.stdin.write(json.dumps(dict(job, tokens=tokens, warmup=warm)) + "\n")
            w.stdin.flush()
        _all(workers, "ready")
        _go(workers)
        _all(workers, "warm")
        if cgroup is not None and limit:
            # Warm, the clients' anonymous memory holds their L0 rows, the pool's read scratch and Python's heap;
            # the limit is that, plus what of the budget the L0s leave, plus a little room for the heap to grow
            # (a member past the limit with no page cache left is killed): the page cache gets the rest.
            l0 = len(parts) * plan["capacity"] * plan["row_bytes"]
            cgroup.limit(cgroup.anon() + plan["budget"] - l0 + len(parts) * HEAP_ROOM)
        for _ in range(passes):
            if cgroup is not None:
                cgroup.reset_peak()
            daemon_before = _daemon_loaded(daemon, files.layout.nbytes) if daemon else 0
            _go(workers)
            results = _all(workers, "counts")
            daemon_read = _daemon_loaded(daemon, files.layout.nbytes) - daemon_before if daemon else 0
            if cgroup is not None:
                peak = cgroup.peak()
            else:
                peak = sum(r["anon_bytes"] for r in results)
                if daemon:
                    shm = request(daemon.socket, protocol.Stats(id=1)).payload["daemon"]["shm_bytes"]
                    peak += shm + anon_bytes(daemon.proc.pid)
            runs.append(_run_of(plan, results, daemon_read, peak, files, job["compute_ms"], config))
    except BaseException:
        for w in workers:
            w.terminate()  # interrupted mid-replay: a worker reads its stdin again only at the end
        raise
    finally:
        for w in workers:
            w.stdin.close()
            w.wait()
            w.stdout.close()
    return runs


# What each run measures; a configuration's figure at a point is the median over its runs (--repeat), with min-max.
FIGURES = ("stall_s_per_token", "first_token_s", "tok_s_projected", "disk_bytes_per_token", "peak_bytes")
HIT_RATES = ("L0", "L2", "page_cache")
PHASES = ("cold", "warm", "new process")  # --scenario cold-warm: run_config's passes, in order
BASES = ("page-cache", "pread")  # what each configuration's tok/s is compared with
VARIED = "moe-l2"  # what a variant (moe-l2+X) is compared with too: X alone decides that ratio


def bases(name: str) -> tuple[str, ...]:
    """The configurations that `name`'s tok/s is compared with, pair by pair."""
    return BASES + (VARIED,) if name.startswith(VARIED + "+") else BASES


def _median(values: list):
    # A count of bytes stays a whole number: the lower middle run's for an even count of runs.
    return statistics.median_low(values) if all(isinstance(v, int) for v in values) else statistics.median(values)


@dataclass
class Run:
    """One configuration's run at one point, summed over its processes."""

    stall_s_per_token: float     # the time fetch took that compute did not hide
    first_token_s: float         # the first token's stall and compute (the mean over the processes)
    tok_s_projected: float       # 1 / (compute + stall), for the layers replayed
    disk_bytes_per_token: float  # read from storage by the clients and the daemon
    peak_bytes: int
    hit_rates: dict              # HIT_RATES: L0 over lookups, L2 (held when looked up) over L0 misses, page cache
    tokens: int
    counts: TierCounts
    disk_bytes: int
    prefetch: dict | None        # PrefetchCounts' fields; None without prefetch
    torn_lookups: int


@dataclass
class ConfigResult:
    """One configuration at one point (budget share, processes): its runs, or why it could not run."""

    name: str
    budget_share: float
    processes: int
    phase: str | None = None     # --scenario cold-warm: which of PHASES
    skipped: str | None = None
    l0_experts: int = 0
    l0_shared: bool = False
    l2_slots: int = 0
    budget_bytes: int = 0
    runs: list[Run] = field(default_factory=list)

    @property
    def point(self) -> tuple[float, int, str | None]:
        return self.budget_share, self.processes, self.phase

    def median(self, figure: str):
        return _median([getattr(r, figure) for r in self.runs])

    def spread(self, figure: str) -> tuple:
        values = [getattr(r, figure) for r in self.runs]
        return min(values), max(values)

    def hit_rate(self, tier: str) -> float | None:
        values = [r.hit_rates[tier] for r in self.runs if r.hit_rates[tier] is not None]
        return _median(values) if values else None

    def counts(self) -> TierCounts:
        total = TierCounts()
        for r in self.runs:
            total.add(r.counts)
        return total

    def prefetch(self) -> dict | None:
        done = [r.prefetch for r in self.runs if r.prefetch is not None]
        return {k: sum(p[k] for p in done) for k in done[0]} if done else None

    def to_json(self) -> dict:
        head = {"name": self.name, "budget_share": self.budget_share, "processes": self.processes,
                "phase": self.phase}
        if self.skipped is not None:
            return dict(head, skipped=self.skipped)
        counts = self.counts()
        tiers = counts.by_source()
        lookups = sum(tiers.values())
        return dict(head, **{f: self.median(f) for f in FIGURES},
                    hit_rates={t: self.hit_rate(t) for t in HIT_RATES},
                    spread={f: list(self.spread(f)) for f in FIGURES},
                    runs=[dict({f: getattr(r, f) for f in FIGURES}, hit_rates=r.hit_rates) for r in self.runs],
                    tokens=sum(r.tokens for r in self.runs), l0_experts=self.l0_experts, l0_shared=self.l0_shared,
                    l2_slots=self.l2_slots, budget_bytes=self.budget_bytes,
                    counts=dict(dataclasses.asdict(counts), lookups=lookups, l2_lookups=lookups - tiers["l0"]),
                    tiers=tiers, disk_bytes=sum(r.disk_bytes for r in self.runs), prefetch=self.prefetch(),
                    torn_lookups=sum(r.torn_lookups for r in self.runs))


@dataclass
class Ratio:
    """One configuration's tok/s over a base's at the same point, run by run: run i of each was measured side by
    side (the configurations of a point take turns), so each pair shares the machine's state of that moment."""

    name: str
    against: str
    budget_share: float
    processes: int
    phase: str | None
    pairs: list[float]

    @property
    def median(self) -> float:
        return _median(self.pairs)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"median": self.median, "min": min(self.pairs), "max": max(self.pairs)}


@dataclass
class BenchResult:
    """What `moe-l2 bench` measured; `--json` prints `to_json()`."""

    model: str
    trace: str
    layers: int
    compute_s_per_layer: float
    l2_reads: str
    record_bytes: int
    expert_bytes: int
    machine: str
    repeat: int = 1
    configs: list[ConfigResult] = field(default_factory=list)

    def done(self) -> list[ConfigResult]:
        return [c for c in self.configs if c.skipped is None]

    def ratio(self, config: ConfigResult, against: str) -> Ratio | None:
        base = next((o for o in self.done() if o.name == against and o.point == config.point), None)
        if base is None or config.skipped is not None:
            return None
        pairs = [r.tok_s_projected / b.tok_s_projected for r, b in zip(config.runs, base.runs)]
        return Ratio(config.name, against, config.budget_share, config.processes, config.phase, pairs)

    def ratios(self) -> list[Ratio]:
        return [r for c in self.done() for base in bases(c.name) if c.name != base and (r := self.ratio(c, base))]

    def to_json(self) -> dict:
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "configs"}
        return dict(head, configs=[c.to_json() for c in self.configs], ratios=[r.to_json() for r in self.ratios()])


def _run_of(plan: dict, results: list[dict], daemon_read: int, peak: int, files: ModelFiles,
            compute_ms: float, config: str) -> Run:
    counts = TierCounts()
    for r in results:
        counts.add(TierCounts(**r["counts"]))
    ahead = {k: sum(r["prefetch"][k] for r in results) for k in results[0]["prefetch"]}
    tokens = sum(r["tokens"] for r in results)
    # Each lookup once, by where its bytes came from: a record the daemon read from disk while the lookup waited
    # (load-through) is a disk read, not an L2 hit.
    tiers = counts.by_source()
    lookups = sum(tiers.values())
    misses = lookups - tiers["l0"]
    client_disk = [r["disk_read_bytes"] for r in results]
    # Without /proc (macOS) the clients' reads are taken as all from disk: a bound, not a measurement.
    disk = (counts.bytes_read + ahead["bytes_read"] if None in client_disk else sum(client_disk)) + daemon_read
    stall = sum(r["stall_s"] for r in results) / tokens
    first = sum(r["first_token_s"] for r in results) / len(results)
    compute = compute_ms / 1e3 * files.n_layers
    hit_rates = {"L0": tiers["l0"] / lookups if lookups else None,
                 "L2": tiers["l2"] / misses if plan["slots"] and misses else None,
                 "page_cache": None}
    if config == "page-cache" and counts.bytes_read and None not in client_disk:
        hit_rates["page_cache"] = max(0.0, 1 - sum(client_disk) / counts.bytes_read)
    return Run(stall_s_per_token=stall, first_token_s=first, tok_s_projected=1 / (compute + stall),
               disk_bytes_per_token=disk / tokens, peak_bytes=peak, hit_rates=hit_rates, tokens=tokens, counts=counts, disk_bytes=disk,
               prefetch=ahead if ahead["requests"] else None,
               torn_lookups=sum(r["torn_lookups"] for r in results))


def render(result: BenchResult) -> str:
    lines = [f"{result.model}: record {format_size(result.record_bytes)}, experts "
             f"{format_size(result.expert_bytes)}; trace {result.trace}; compute "
             f"{result.compute_s_per_layer * 1e3:g} ms per layer; L2 reads {result.l2_reads}; {result.machine}", ""]
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
                         f"(recall); {pf['issued']} loaded ahead {_loaded(pf, tokens)}, {pf['useful']} promoted, "
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
                             repeat=args.repeat)
        for share in shares:
            for n in counts:
                # cold-warm: no warm-up, the first pass is the cold one; the second round's clients are new.
                parts = _parts(traces, files.n_layers, n, args.tokens, 0 if args.scenario else args.warmup)
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
        if not result.done():
            raise BenchError("nothing could run: " + "; ".join(c.skipped for c in result.configs))
    except (BenchError, TraceError, SyntheticError, ValueError, OSError) as exc:
        print(f"moe-l2 bench: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result))
    return 0
