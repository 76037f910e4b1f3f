"""Where a cold miss's time goes, hop by hop, on each of a process's three ways to an expert L0 and L2 lack: its
own read with no daemon (pread), its own read given to moe-l2d's L2 (fills: a pool of the daemon's uid, fill_l2
on, the default), and the daemon's read waited for (load-through: fill_l2 off); and fills as they were before the
donor mapped a slot ahead and copied each record as it landed (fills-after-read), and with each slot mapped once
its record landed, just before the copy, rather than as it was offered, while the read runs (fills-mapped-late);
and pread with one core kept busy by another process for the length of its fetch, spinning in its own cache
(pread, a core spinning) or copying through memory (pread, a core copying; lab/busy.py): what work beside a read
costs it on this machine, where a fill's copy and moe-l2d's check are work beside the reads. Issue 36.

A real moe-l2d serves a packed model of a real geometry (`moe-l2 bench --geometry`'s, lab/synthetic.py: default
DeepSeek-V2-Lite, 4.6 MiB records, with the checksum manifest of every packed model: so each pool checks a record
as its read lands, the donor copies without a CRC, and the daemon checks a donation against the manifest); the
pools take turns, round by round, on a lone miss and on a batch (--batch), each fetch of experts that L0 and
L2 lack, the model file dropped from the page cache first. Timestamps are CLOCK_MONOTONIC, the same clock in both
processes:
  - in this process, from subclasses of the pool's RowLoader and Donor made here (as bench_load_through.py's
    PolledLoader): the read, the report, the copies from L2, the donor's give, offer and copy into the slot;
  - in moe-l2d, from the same daemon started through HOOKS below, which wraps a few of its methods to write a line
    per event (the fill desk's give and filled, the server's report, ServedModel's reserve, fill, take_donation and
    finish_fill; a write(2) each): nothing of this is in the product.
A batch's milestone is when its last record passed it (its first, for "begins"); "per record" rows average each
record's own time over the batch. CPU per miss: this whole process's (time.process_time) and the daemon's (its
CPU clock, clock_gettime), from just before the fetch until L2 held the misses, over the records fetched; both
processes' idle CPU is printed too. Linux only (posix_fadvise, another process's CPU clock).

    python bench/bench_miss_path.py [--geometry deepseek-v2-lite] [--layers 6] [--batch 6] [--rounds 10]
                                    [--slots 8] [--load-through-ms 2000] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from moe_l2.client.connection import L2Client
from moe_l2.client.donor import Donor
from moe_l2.client.options import DEFAULTS
from moe_l2.client.pool import ExpertPool
from moe_l2.client.row_loader import RowLoader
from moe_l2.lab import synthetic
from moe_l2.lab.bench import drop_page_cache
from moe_l2.lab.busy import busy_cores
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles
from moe_l2.sizes import format_size

# moe-l2d as lifeline runs it, with a line written per event of a miss's path (`event layer expert ns`).
HOOKS = r"""
import os, runpy, sys, time
from moe_l2.lab import lifeline
lifeline.tie_to_parent(int(sys.argv[1]))
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
from moe_l2.daemon.fills import FillDesk
from moe_l2.daemon.served import ServedModel
from moe_l2.daemon.server import Server

def mark(event, layer, experts):
    t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    os.write(fd, "".join(f"{event} {layer} {e} {t}\n" for e in experts).encode())

def hook(cls, name, before=None, after=None):
    inner = getattr(cls, name)
    def hooked(self, *args, **kwargs):
        if before:
            before(*args)
        out = inner(self, *args, **kwargs)
        if after:
            after(out, *args)
        return out
    setattr(cls, name, hooked)

def desk_message(donor, m):
    if m.type == "give":
        mark("give_in", m.layer, m.experts)
    elif m.type == "filled":
        mark("filled_in", m.layer, [m.expert])

hook(FillDesk, "_handle", before=desk_message)
hook(Server, "_report", before=lambda identity, req: mark("report_in", -1, [-1]))
hook(ServedModel, "reserve", after=lambda out, layer, *_: mark("reserved", layer, [r.expert for r in out]))
hook(ServedModel, "fill", before=lambda layer, r: mark("load_begin", layer, [r.expert]))
hook(ServedModel, "take_donation", before=lambda layer, r, c: mark("check_begin", layer, [r.expert]))
hook(ServedModel, "finish_fill", before=lambda layer, r, c: mark("finish_begin", layer, [r.expert]))
sys.argv = ["moe_l2.daemon.main", *sys.argv[3:]]
runpy.run_module("moe_l2.daemon.main", run_name="__main__", alter_sys=True)
"""

EVENTS: list[tuple[str, int, int, int]] = []  # this process's (event, layer, expert, ns); list.append is atomic


def now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def mark(event: str, layer: int, experts) -> None:
    t = now()
    EVENTS.extend((event, layer, e, t) for e in experts)


class TimedLoader(RowLoader):
    """The pool's row loader, marking its reads of the model file, its copies from L2 and its report."""

    def read_from_l3(self, layer, lp, todo, landed=None):
        mark("read_begin", layer, [e for e, _ in todo])
        sums = super().read_from_l3(layer, lp, todo, landed)
        mark("read_end", layer, [e for e, _ in todo])
        return sums

    def _copy_from_l2(self, layer, lp, experts, rows):
        mark("l2_copy_begin", layer, experts)
        copied = super()._copy_from_l2(layer, lp, experts, rows)
        mark("l2_copy_end", layer, [e for e, ok in zip(experts, copied) if ok])
        return copied

    def load_rows(self, layer, lp, experts, rows, on_l2_miss=None, *args, **kwargs):
        if on_l2_miss is not None:
            inner = on_l2_miss

            def on_l2_miss(copied, coming):  # load-through's report goes out now, a filling pool's give
                mark("report_sent", layer, [e for e, ok in zip(experts, copied) if not ok])
                return inner(copied, coming)
        return super().load_rows(layer, lp, experts, rows, on_l2_miss, *args, **kwargs)


class TimedDonor(Donor):
    """The pool's donor, marking each give sent, offer taken and copy into a slot (its `filled` follows at once)."""

    def _send_queued(self):
        if not self._queue.empty():  # marked as the thread takes them: it may be descheduled once they are sent
            mark("give_sent", -1, [-1])
        super()._send_queued()

    def _on_offer(self, message):
        mark("offer_in", message.layer, [e for e, _ in message.slots])
        super()._on_offer(message)

    def _copy(self, gift, slot):
        mark("slot_copy_begin", gift.layer, [gift.expert])
        checksum = super()._copy(gift, slot)
        mark("slot_copy_end", gift.layer, [gift.expert])
        return checksum


class AfterReadDonor(TimedDonor):
    """fills-after-read's donor: it maps no slot ahead of its copy, as before 298f822."""

    def _prefault(self, gift):
        pass


class MappedLateDonor(TimedDonor):
    """fills-mapped-late's donor: it maps a slot once its record landed, just before the copy (tried at fdf7b83)."""

    def _prefault(self, gift):
        pass

    def _copy(self, gift, slot):
        super()._prefault(gift)
        return super()._copy(gift, slot)


class AfterReadLoader(TimedLoader):
    """fills-after-read's loader: its reads say nothing as each record lands, so that the donor copies them all
    after the read, as before the read said so."""

    def read_from_l3(self, layer, lp, todo, landed=None):
        return super().read_from_l3(layer, lp, todo)


# Per path, its milestones: (label, event, "first" or "last" of the batch's records) and its hops per record: (label,
# begin event, end event), each record's end minus its begin, averaged over the batch.
PATHS = {
    "pread": ([("read begins", "read_begin", "first"), ("read ends", "read_end", "last"),
               ("fetch returns", "fetch_end", "last")], []),
    "fills": ([("read begins", "read_begin", "first"), ("give queued", "report_sent", "last"),
               ("donor thread sends the give", "give_sent", "last"), ("give received (desk)", "give_in", "last"),
               ("slot reserved", "reserved", "last"), ("offer received (donor)", "offer_in", "last"),
               ("read ends", "read_end", "last"), ("fetch returns", "fetch_end", "last"),
               ("copy into slot begins", "slot_copy_begin", "first"), ("copy into slot ends", "slot_copy_end", "last"),
               ("filled received (desk)", "filled_in", "last"), ("daemon's check begins", "check_begin", "last"),
               ("check ends, publish begins", "finish_begin", "last"),
               ("seen published here", "seen", "last")],
              [("copy into slot (donor)", "slot_copy_begin", "slot_copy_end"),
               ("copy ends -> check begins", "slot_copy_end", "check_begin"),
               ("daemon's check (CRC)", "check_begin", "finish_begin")]),
    "load-through": ([("report sent", "report_sent", "last"), ("report received (server)", "report_in", "first"),
                      ("slot reserved", "reserved", "last"), ("daemon's load begins", "load_begin", "first"),
                      ("load's read ends, publish begins", "finish_begin", "last"),
                      ("copy from L2 begins (woken)", "l2_copy_begin", "last"),
                      ("copy from L2 ends", "l2_copy_end", "last"), ("fetch returns", "fetch_end", "last")],
                     [("daemon's load (read)", "load_begin", "finish_begin")]),
}
PATHS["fills-after-read"] = PATHS["fills-mapped-late"] = PATHS["fills"]
# pread with another process kept busy for the length of each fetch: spinning in its core's cache, or copying
# memory (the value: busy_cores' `copying`).
BUSY = {"pread, a core spinning": False, "pread, a core copying": True}
PATHS.update(dict.fromkeys(BUSY, PATHS["pread"]))


@dataclass
class Sample:
    layer: int
    experts: list[int]
    t0: int
    t1: int = 0
    cpu_self: float = 0.0
    cpu_daemon: float = 0.0
    events: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # event -> [(expert, ns)]


def cpu_clock(pid: int) -> int:
    """The clock id of another process's CPU time (Linux: what clock_getcpuclockid gives, CPUCLOCK_SCHED)."""
    return ((~pid) << 3) | 2


def resume(pid: int, settle_s: float = 0.02) -> None:
    """Let a stopped spinner run, and wait until it has run settle_s of CPU: resumed, it first gets more than its
    share of a core (the scheduler owes it the time it was stopped), which would fall on the start of the fetch."""
    clock = cpu_clock(pid)
    began = time.clock_gettime(clock)
    os.kill(pid, signal.SIGCONT)
    while time.clock_gettime(clock) - began < settle_s:
        time.sleep(0.001)


def wait_published(index, experts: list[int], timeout_s: float) -> bool:
    """Sleep on the experts' slot_of entries until L2 holds them all (True) or timeout_s passed."""
    deadline = time.monotonic() + timeout_s
    while not all(index.slot_of(e) >= 0 for e in experts):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        index.wait(experts, min(left, 0.1), True)
    return True


def one_fetch(name: str, pool: ExpertPool, files: ModelFiles, indexes, daemon_clock: int, batch: int,
              rng: random.Random, spinners: dict) -> Sample | None:
    """Fetch `batch` experts that L0 and L2 lack, cold; the sample, or None where any came another way. A
    busy path's spinner (stopped, in `spinners` by path) runs for the length of its fetch."""
    spinner = spinners.get(name)
    layer = rng.randrange(files.n_layers)
    index = indexes[layer]
    experts = rng.sample([e for e in range(files.n_experts) if index.slot_of(e) == -1], batch)
    if spinner is not None:
        resume(spinner.pid)
    drop_page_cache(files)
    cpu_self, cpu_daemon = time.process_time(), time.clock_gettime(daemon_clock)
    sample = Sample(layer, experts, now())
    counts = pool.fetch(layer, experts)
    mark("fetch_end", layer, experts)
    if spinner is not None:
        os.kill(spinner.pid, signal.SIGSTOP)
    if name == "load-through":
        ok = counts.l2_awaited == batch
    else:  # read by this process; given to L2 where it fills, and then awaited there
        ok = counts.l3_reads == batch and (name in ("pread", *BUSY) or wait_published(index, experts, 5.0))
    mark("seen", layer, experts)
    sample.t1 = now()
    sample.cpu_self = time.process_time() - cpu_self
    sample.cpu_daemon = time.clock_gettime(daemon_clock) - cpu_daemon
    for e in experts:
        pool.evict(layer, e)
    return sample if ok else None


def read_daemon_events(path: Path) -> list[tuple[str, int, int, int]]:
    out = []
    for line in path.read_text().splitlines():
        event, layer, expert, t = line.split()
        out.append((event, int(layer), int(expert), int(t)))
    return out


def attach_events(samples: list[Sample], events: list[tuple[str, int, int, int]]) -> None:
    """Give each sample the events of its window, its layer and its experts (-1: an event that names none)."""
    for event, layer, expert, t in events:
        for s in samples:
            if s.t0 <= t <= s.t1 and layer in (s.layer, -1) and (expert == -1 or expert in s.experts):
                s.events.setdefault(event, []).append((expert, t))


def milestone(s: Sample, event: str, which: str) -> float | None:
    times = [t for _, t in s.events.get(event, [])]
    if not times:
        return None
    return ((min if which == "first" else max)(times) - s.t0) / 1e6


def per_record(s: Sample, begin: str, end: str) -> float | None:
    """Each record's `end` minus its `begin` (its first begin, its last end), averaged over the batch, in ms."""
    began = {}
    for e, t in s.events.get(begin, []):
        began.setdefault(e, t)
    ended = {}
    for e, t in s.events.get(end, []):
        ended[e] = t
    pairs = [(began[e], ended[e]) for e in ended if e in began and ended[e] >= began[e]]
    return sum(b - a for a, b in pairs) / len(pairs) / 1e6 if pairs else None


def cell(values: list[float | None]) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return f"{'-':>22}"
    return f"{statistics.median(got):8.2f} [{got[0]:5.2f}-{got[-1]:6.2f}]"


def print_path(name: str, by_batch: dict[int, list[Sample]]) -> None:
    steps, hops = PATHS[name]
    batches = list(by_batch)
    print(f"\n{name}: ms since the fetch began, median [min-max] of "
          + ", ".join(f"{len(by_batch[b])} x {b}" for b in batches))
    print(f"  {'':38s}" + "".join(f"{str(b) + (' miss' if b == 1 else ' misses'):>24s}" for b in batches))
    for label, event, which in steps:
        print(f"  {label:38s}" + "".join(f"  {cell([milestone(s, event, which) for s in by_batch[b]])}"
                                         for b in batches))
    for label, begin, end in hops:
        print(f"  {'per record: ' + label:38s}" + "".join(
            f"  {cell([per_record(s, begin, end) for s in by_batch[b]])}" for b in batches))
    for label, key in (("CPU per miss: this process", "cpu_self"), ("CPU per miss: moe-l2d", "cpu_daemon")):
        print(f"  {label:38s}" + "".join(
            f"  {cell([getattr(s, key) * 1e3 / b for s in by_batch[b]])}" for b in batches))


def idle_cpu(daemon_clock: int, seconds: float = 1.0) -> tuple[float, float]:
    """ms of CPU per second that this process and the daemon spend with nothing to do."""
    cpu_self, cpu_daemon = time.process_time(), time.clock_gettime(daemon_clock)
    time.sleep(seconds)
    return ((time.process_time() - cpu_self) * 1e3 / seconds,
            (time.clock_gettime(daemon_clock) - cpu_daemon) * 1e3 / seconds)


def make_pools(files: ModelFiles, daemon: DaemonProcess, batch: int, load_through_s: float):
    """{path: pool} (the pread pool without a client, each other with its own L2Client) and the clients."""
    clients = [L2Client(files, daemon.socket, wait_s=5) for _ in range(4)]
    pools = {**{name: ExpertPool(files, batch, lend=False) for name in ("pread", *BUSY)},
             "fills": ExpertPool(files, batch, clients[0], lend=False, fill_l2=True,
                                 load_through_s=DEFAULTS.load_through_s),
             "fills-after-read": ExpertPool(files, batch, clients[2], lend=False, fill_l2=True,
                                            load_through_s=DEFAULTS.load_through_s),
             "fills-mapped-late": ExpertPool(files, batch, clients[3], lend=False, fill_l2=True,
                                             load_through_s=DEFAULTS.load_through_s),
             "load-through": ExpertPool(files, batch, clients[1], lend=False, fill_l2=False,
                                        load_through_s=load_through_s)}
    for pool in pools.values():
        pool.loader.__class__ = TimedLoader
    pools["fills"].donor.__class__ = TimedDonor
    pools["fills-after-read"].loader.__class__ = AfterReadLoader
    pools["fills-after-read"].donor.__class__ = AfterReadDonor
    pools["fills-mapped-late"].donor.__class__ = MappedLateDonor
    for name in ("fills", "fills-after-read", "fills-mapped-late"):
        if not pools[name].donor.wait_accepted(5):
            raise SystemExit(f"moe-l2d's fill desk did not take this process: {pools[name].donor.refused}")
    for pool in pools.values():  # every row touched once: a first write into fresh pages costs faults
        for layer in range(files.n_layers):
            pool.fetch(layer, range(batch))
            for e in range(batch):
                pool.evict(layer, e)
    return pools, clients


def run(files: ModelFiles, args, work: Path, spinners: dict) -> dict[str, dict[int, list[Sample]]]:
    events_path = work / "daemon-events"
    budget = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, args.slots)
    # LRU admits every give, where the learned policy may keep its victim instead of a random record
    # (docs/decisions.md, "Admission"): the fills measured are fills made.
    daemon = DaemonProcess.serving([files.path], budget, "--policy", "lru", "--log-level", "warning", runtime_dir=work,
                                   command=(sys.executable, "-P", "-c", HOOKS, str(os.getpid()),
                                            str(events_path))).start()
    clients = []
    pools = {}
    try:
        pools, clients = make_pools(files, daemon, args.batch, args.load_through_ms / 1e3)
        indexes = clients[0].attachment.slot_indexes
        clock = cpu_clock(daemon.proc.pid)
        idle = idle_cpu(clock)
        rng = random.Random(args.seed)
        batches = (1, args.batch)
        samples: dict[str, dict[int, list[Sample]]] = {n: {b: [] for b in batches} for n in PATHS}
        lost = dict.fromkeys(PATHS, 0)
        del EVENTS[:]
        for _ in range(args.rounds):
            for batch in batches:
                for name in rng.sample(list(PATHS), len(PATHS)):
                    got = one_fetch(name, pools[name], files, indexes, clock, batch, rng, spinners)
                    if got is None:
                        lost[name] += 1
                    else:
                        samples[name][batch].append(got)
        print(f"idle CPU: this process {idle[0]:.1f} ms/s, moe-l2d {idle[1]:.1f} ms/s; samples that came another "
              "way, left out: " + ", ".join(f"{n} {k}" for n, k in lost.items()))
    finally:
        for pool in pools.values():
            pool.close()
        for client in clients:
            client.close()
        daemon.stop()
        daemon.unlink_leftovers()
    every = [s for by_batch in samples.values() for got in by_batch.values() for s in got]
    attach_events(every, EVENTS + read_daemon_events(events_path))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", choices=sorted(synthetic.GEOMETRIES), default="deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=6, help="MoE layers of the model made (6: moe-l2 bench's)")
    parser.add_argument("--batch", type=int, default=6, help="misses in a fetch, beside the lone miss")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--slots", type=int, default=8, help="L2 slots per layer")
    parser.add_argument("--load-through-ms", type=float, default=2000,
                        help="load-through's wait: so long that every miss is the daemon's read")
    parser.add_argument("--cache-dir", type=Path, help="where the model is made (default: moe-l2 bench's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not hasattr(os, "posix_fadvise") or sys.platform != "linux":
        sys.exit("bench_miss_path reads cold (posix_fadvise) and reads the daemon's CPU clock: run it on Linux")
    cache = args.cache_dir or Path(platformdirs.user_cache_dir("moe-l2")) / "bench"
    model = synthetic.build(synthetic.GEOMETRIES[args.geometry], args.layers, cache, say=print)
    files = ModelFiles.open(model)
    most = files.n_experts - args.batch  # every fetch takes experts L2 lacks, and L2 keeps what it took
    if not 1 <= args.slots <= most:
        sys.exit(f"--slots {args.slots}: give 1 to {most}; each fetch needs --batch {args.batch} experts that L2 "
                 f"lacks, of {args.geometry}'s {files.n_experts} a layer")
    load_before = os.getloadavg()
    print(f"model: {args.geometry}, {files.n_layers} MoE layers x {files.n_experts} experts, record "
          f"{format_size(files.layout.nbytes)}; L2 {args.slots} slots a layer; {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in load_before)}")
    work = Path(tempfile.mkdtemp(prefix="ml2mp-", dir="/tmp"))
    try:
        with contextlib.ExitStack() as stack:
            spinners = {name: stack.enter_context(busy_cores(1, copying))[0] for name, copying in BUSY.items()}
            for spinner in spinners.values():  # each runs only for the length of its path's fetches
                os.kill(spinner.pid, signal.SIGSTOP)
            samples = run(files, args, work, spinners)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, by_batch in samples.items():
        print_path(name, by_batch)
    print("\nfetch returns, median ms (over pread's):")
    for batch in (1, args.batch):
        medians = {n: statistics.median(milestone(s, "fetch_end", "last") for s in samples[n][batch])
                   for n in PATHS if samples[n][batch]}
        base = medians.get("pread")
        print(f"  {batch} miss{'es' if batch > 1 else ''}: " + ", ".join(
            f"{n} {m:.2f}" + (f" ({base / m:.2f}x pread's speed)" if base and n != "pread" else "")
            for n, m in medians.items()))
    print(f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
