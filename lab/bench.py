"""The bench's engine (`moe-l2 bench`, cli/bench.py): each configuration's memory plan, its client processes
(moe_l2.lab.replayer) and daemon at one point, and the records of what they measured (docs/architecture.md, "The
bench").

Each configuration runs N client processes, each replaying its share of the trace's sequences through a real
ExpertPool: `page-cache` (buffered reads, the smallest L0, the processes and their page cache held to the budget by a
memory cgroup), `pread` (the budget as L0, split across the processes, direct reads) and `moe-l2` (a per-process L0
and one real moe-l2d's L2 holding the rest).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
from dataclasses import dataclass, field


from moe_l2 import protocol
from moe_l2.cache.policy import POLICIES

from moe_l2.lab import lifeline
from moe_l2.lab.cgroup import MemoryCgroup
from moe_l2.client import options
from moe_l2.client.connection import request, wait_idle
from moe_l2.client.lookup import TierCounts
from moe_l2.client.prefetcher import side_rows
from moe_l2.lab.replayer import anon_bytes, disk_read_bytes
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.layout import BudgetError, Geometry
from moe_l2.model import ModelFiles
from moe_l2.sizes import format_pct, format_size

# moe-l2+POLICY: moe-l2 with moe-l2d evicting by POLICY (its --policy) instead of the default.
POLICY_CONFIGS = tuple(f"moe-l2+{name}" for name in POLICIES)
CONFIGS = ("page-cache", "pread", "moe-l2", "moe-l2+prefetch", "moe-l2+autopin", "moe-l2+load-through") + POLICY_CONFIGS
# moe-l2+autopin, moe-l2+load-through and the policies are asked for by name: autopin is off by default
# (docs/benchmarks.md, "Experimental options"), and load-through is what a process of another user than the
# daemon's gets (moe-l2 with --no-fill-l2: docs/benchmarks.md, "Fills").
DEFAULT_CONFIGS = CONFIGS[:4]
# The streaming options the moe-l2 configurations take, as `generate` and `serve` do (client/options.py).
STREAMING = ("shared_l0", "l2_reads", "load_through_ms", "l0_grow", "fill_l2")
# Decode on Apple Silicon, per MoE layer: gpt-oss-20b (24 layers), MLX 4-bit, 91.5 tok/s on an M2 Max
# (docs/decisions.md, "The bench's compute per layer", cites the measurement): 1000 / 91.5 / 24 ms.
DEFAULT_COMPUTE_MS = 0.45
# page-cache: room per client process for its heap to grow past what it held warm, inside the cgroup's limit.
HEAP_ROOM = 16 << 20


class BenchError(ValueError):
    """Input the bench cannot run with; the message says what to do."""


class Skipped(BenchError):
    """One configuration cannot run at one point (the message says why); the others still run."""


class BudgetTooSmall(Skipped):
    """One point's budget cannot hold what the configuration needs."""


def trace_parts(traces, n_layers: int, processes: int, tokens: int | None, warmup: float) -> list[tuple[list, int]]:
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


def plan_memory(files: ModelFiles, config: str, share: float, processes: int, l0_share: float,
          shared_l0: bool = False) -> dict:
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
        capacity = max(top_k, min(most, int(l0_share * budget / processes) // row - side))
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


def drop_page_cache(files: ModelFiles) -> None:
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


def loaded_text(pf: dict, tokens: int) -> str:
    """What the prefetches loaded into the side rows, per token, and from where."""
    return (f"into side rows ({format_size(pf['bytes_read'] / tokens)} read, "
            f"{format_size(pf['bytes_copied'] / tokens)} copied from L2 per token)")


def run_config(files: ModelFiles, config: str, share: float, rounds: list[tuple[list, int]],
               args) -> tuple[dict, list[Run]]:
    """One configuration at one point: start its daemon / cgroup, then for each round its clients (one per part,
    each replaying the part's measured tokens `passes` times), and sum what they saw in each pass. One daemon and
    cgroup serve every round: a later round's clients are fresh processes against what the earlier left warm.
    Returns its plan (plan_memory) and its runs, a round's passes in turn."""
    stream = options.from_args(args)
    in_place = stream.lend
    l0_share = args.l0_share if args.l0_share is not None else 0.0 if in_place else 0.5
    # moe-l2+prefetch is moe-l2 with next-layer prefetch into side rows, out of the same budget (plan_memory). Its L0
    # is laid out as a process of generate's with a daemon would lay it out.
    shared_l0 = config.startswith("moe-l2") and stream.l0_shared
    if config == "moe-l2+autopin" and shared_l0:
        # Against moe-l2 with the same L0 layout, autopin alone decides the ratio.
        raise Skipped("moe-l2+autopin pins in per-layer L0 rows, and moe-l2's L0 is shared here: run it with "
                      "--no-l0-shared and --l0-share above 0, or with --l2-reads copy")
    fills = stream.fill_l2 and config != "moe-l2+load-through"
    plan = plan_memory(files, config, share, len(rounds[0][0]), l0_share, shared_l0)
    drop_page_cache(files)
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
            policy = ("--policy", config.removeprefix("moe-l2+")) if config in POLICY_CONFIGS else ()
            daemon = DaemonProcess.serving([files.path], plan["l2_budget"], "--log-level", "warning", *policy).start()
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
        _settle(daemon)
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
            _settle(daemon)
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


def _settle(daemon) -> None:
    """Until the daemon copied and loaded what the clients' last pass gave and asked for (they answer once it took
    their gives): the pass's reads all count, and the next pass, or process, finds them in L2."""
    if daemon is not None:
        wait_idle(daemon.socket)


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
    waits: dict = field(default_factory=dict)  # WaitCounts' fields (client/slot_waits.py)


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

    def waits(self) -> dict:
        """The clients' waits for records on their way into L2, over every run (client/slot_waits.py)."""
        return {k: sum(r.waits[k] for r in self.runs) for k in self.runs[0].waits} if self.runs else {}

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
                    waits=self.waits(), torn_lookups=sum(r.torn_lookups for r in self.runs))


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
    busy_cores: int = 0  # CPU-bound programs beside the runs (--busy-cores)
    load_average: float | None = None  # the machine's, over the last minute, when the runs ended
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
    waits = {k: sum(r["waits"][k] for r in results) for k in results[0]["waits"]}
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
               prefetch=ahead if ahead["requests"] else None, waits=waits,
               torn_lookups=sum(r["torn_lookups"] for r in results))
