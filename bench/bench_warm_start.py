"""After a restart: what the first client's first tokens wait for experts, with the heat the daemon saved before
it stopped (warm start), without it (a cold daemon), and with no daemon (pread: the process' own reads into an
L0 of the whole budget, as `moe-l2 bench`'s pread).

A daemon first learns a workload (--teach tokens of the trace through a real client) and is stopped with SIGTERM,
which saves its heat. Then each run, with the model's page cache dropped, starts a daemon as a restart does (in a
fresh state dir holding that heat, or none) and one client process (moe_l2.lab.replayer, already imported and
waiting) that replays the trace's next --tokens tokens at once: `warm start` as soon as the daemon is ready, its
preload still running; `warm start settled` once the preload is done; `cold daemon` at once; `pread` alone. The
configurations take turns (--repeat), each figure is the median of its runs, each ratio the median of the ratios
of runs side by side. The memory split is `moe-l2 bench`'s (moe_l2.lab.bench.plan_memory).

    python bench/bench_warm_start.py --geometry gpt-oss-20b --first-layers 6 \\
        --trace ../shared/traces/gpt-oss-20b.jsonl.gz --budget-share 50% --tokens 100 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import platformdirs

from moe_l2 import protocol

from moe_l2.lab import lifeline
from moe_l2.cache.trace import read_traces
from moe_l2.client.connection import request
from moe_l2.client.options import DEFAULTS
from moe_l2.lab.bench import DEFAULT_COMPUTE_MS, drop_page_cache, plan_memory
from moe_l2.daemon.heat_file import file_name
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir
from moe_l2.model import ModelFiles
from moe_l2.lab.synthetic import GEOMETRIES, build
from moe_l2.sizes import format_size

CONFIGS = ("warm start", "warm start settled", "cold daemon", "pread")


class Replayer:
    """A client process of `moe-l2 bench`, started ahead so that its imports are done when its job is given."""

    def __init__(self):
        self.proc = subprocess.Popen(lifeline.command("moe_l2.lab.replayer"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def hear(self, expect: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the client process exited with {self.proc.wait()} before saying {expect!r}")
        message = json.loads(line)
        if "error" in message:
            sys.exit(message["error"])
        return message

    def replay(self, job: dict) -> dict:
        """Give the job (no warm-up), replay its tokens once, end: the counts."""
        self.say(json.dumps(dict(job, warmup=0)))
        self.hear("ready")
        self.say("go")
        self.hear("warm")
        self.say("go")
        counts = self.hear("counts")
        self.proc.stdin.close()
        self.proc.wait()
        return counts


def tokens_of(traces, n_layers: int) -> list:
    """Every token of the trace, sequence after sequence, cut to the model's layers."""
    return [[list(layer) for layer in token[:n_layers]] for s in traces.sequences for token in s.experts]


def settle(daemon: DaemonProcess) -> float:
    """Wait until the warm start has preloaded what it could; the seconds waited."""
    start = time.perf_counter()
    while True:
        m = request(daemon.socket, protocol.Stats(id=1)).payload["models"][0]
        if not (m["warm_start"] or {}).get("pending") and m["loads_in_flight"] == 0:
            return time.perf_counter() - start
        time.sleep(0.01)


def run(config: str, files: ModelFiles, jobs: dict, l2_budget: int, heat: bytes) -> dict:
    """One run of a configuration after a restart: the client's counts, and the daemon's preload."""
    drop_page_cache(files)
    client = Replayer()
    directory = short_tempdir("ml2ws-")
    daemon = None
    try:
        if config.startswith("warm start"):
            (directory / file_name(files.fingerprint)).write_bytes(heat)
            os.chmod(directory / file_name(files.fingerprint), 0o600)
        if config != "pread":
            daemon = DaemonProcess.serving([files.path], l2_budget, "--log-level", "warning",
                                           runtime_dir=directory).start()
        settled_s = settle(daemon) if config == "warm start settled" else None
        job = dict(jobs["pread" if config == "pread" else "moe-l2"], socket=daemon.socket if daemon else None)
        counts = client.replay(job)
        if daemon is not None:
            counts["warm_start"] = request(daemon.socket, protocol.Stats(id=1)).payload["models"][0]["warm_start"]
        counts["settled_s"] = settled_s
        return counts
    finally:
        if client.proc.poll() is None:
            client.proc.kill()
        if daemon is not None:
            daemon.stop()
            daemon.unlink_leftovers()
        shutil.rmtree(directory, ignore_errors=True)


def teach(files: ModelFiles, job: dict, l2_budget: int) -> bytes:
    """The heat a daemon saves at its stop after serving `job`'s tokens."""
    directory = short_tempdir("ml2ws-")
    daemon = DaemonProcess.serving([files.path], l2_budget, "--log-level", "warning", runtime_dir=directory).start()
    try:
        Replayer().replay(dict(job, socket=daemon.socket))
        daemon.stop()
        return (directory / file_name(files.fingerprint)).read_bytes()
    finally:
        daemon.stop()
        daemon.unlink_leftovers()
        shutil.rmtree(directory, ignore_errors=True)


def median_ratio(a: list[float], b: list[float]) -> str:
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}-{max(pairs):.2f})" if pairs else "-"


def spread(values: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(values) * scale:.1f} ({min(values) * scale:.1f}-{max(values) * scale:.1f})"


def report(results: dict[str, list[dict]], compute_s: float) -> None:
    first = {c: [r["first_token_s"] - compute_s for r in runs] for c, runs in results.items()}
    stall = {c: [r["stall_s"] / r["tokens"] for r in runs] for c, runs in results.items()}
    print(f"{'after the restart':<20}{'1st token stall ms':>22}{'stall ms/token':>22}{'L2 hits':>9}{'own disk':>9}"
          f"   {'vs pread: 1st token, all':<34}{'vs cold daemon: 1st token, all'}")
    for config, runs in results.items():
        lookups = [sum(r["counts"][k] for k in ("l0_hits", "l2_hits", "l3_reads")) for r in runs]
        l2 = statistics.median(r["counts"]["l2_hits"] - r["counts"]["l2_awaited"] for r in runs) / \
            statistics.median(lookups)
        disk = statistics.median(r["counts"]["l3_reads"] for r in runs) / statistics.median(lookups)
        vs = [f"{median_ratio(first[config], first[base])}, {median_ratio(stall[config], stall[base])}"
              if base in results and base != config else "-" for base in ("pread", "cold daemon")]
        print(f"{config:<20}{spread(first[config]):>22}{spread(stall[config]):>22}{l2:>9.0%}{disk:>9.0%}   "
              f"{vs[0]:<34}{vs[1]}")
    for config, runs in results.items():
        preloads = [r["warm_start"] for r in runs if r.get("warm_start")]
        if preloads:
            settled = [r["settled_s"] for r in runs if r["settled_s"] is not None]
            print(f"{config}: preloaded {statistics.median(p['preloaded'] for p in preloads)} of "
                  f"{preloads[0]['records']} records by the end of the client's tokens"
                  + (f"; the preload took {statistics.median(settled):.2f} s after READY" if settled else ""))
    print("Medians over the runs (min-max); ratios: the median of the runs side by side (min-max). 1st token stall: "
          "the first token's wait for experts; L2 hits: lookups L2 held when looked up; own disk: lookups the client "
          "read itself (moe-l2's misses are read by the daemon while the client waits: load-through)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="gpt-oss-20b")
    parser.add_argument("--first-layers", type=int, default=6, help="MoE layers of the geometry (default 6)")
    parser.add_argument("--budget-share", default="50%", help="memory for experts, a share of all experts' bytes")
    parser.add_argument("--teach", type=int, default=400, help="tokens the daemon serves before the restart")
    parser.add_argument("--tokens", type=int, default=100, help="tokens replayed after the restart (default 100)")
    parser.add_argument("--compute-ms", type=float, default=DEFAULT_COMPUTE_MS, help="model compute per layer")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    args = parser.parse_args()

    share = float(args.budget_share.rstrip("%")) / (100 if args.budget_share.endswith("%") else 1)
    configs = [c.strip() for c in args.configs.split(",")]
    traces = read_traces(args.trace)
    geometry = GEOMETRIES[args.geometry]
    files = ModelFiles.open(build(geometry, args.first_layers, Path(platformdirs.user_cache_dir("moe-l2")) / "bench",
                                  say=print))
    tokens = tokens_of(traces, files.n_layers)
    taught, measured = tokens[:args.teach], tokens[args.teach:args.teach + args.tokens]
    moe_l2 = plan_memory(files, "moe-l2", share, 1, 0.0 if DEFAULTS.lend else 0.5, DEFAULTS.l0_shared)
    pread = plan_memory(files, "pread", share, 1, 0.0)
    common = {"model": str(files.path), "policy": DEFAULTS.policy, "compute_ms": args.compute_ms, "cgroup": None,
              "prefetch": False}
    jobs = {"moe-l2": dict(common, capacity=moe_l2["capacity"], direct=True, lend=DEFAULTS.lend,
                           shared_l0=moe_l2["shared_l0"], grow=DEFAULTS.l0_grow,
                           load_through_ms=DEFAULTS.load_through_ms, tokens=measured),
            "pread": dict(common, capacity=pread["capacity"], direct=True, shared_l0=False, grow=False,
                          load_through_ms=0, lend=False, tokens=measured)}
    compute_s = args.compute_ms / 1e3 * files.n_layers
    print(f"{args.geometry}, {files.n_layers} MoE layers: record {format_size(files.layout.nbytes)}; budget "
          f"{format_size(moe_l2['budget'])} ({args.budget_share}): moe-l2 L2 {moe_l2['slots']} slots and L0 "
          f"{moe_l2['capacity']} rows{' shared' if moe_l2['shared_l0'] else ''}, pread L0 {pread['capacity']} rows "
          f"a layer; {len(taught)} tokens taught, {len(measured)} replayed after the restart; compute "
          f"{args.compute_ms:g} ms a layer; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    heat = teach(files, dict(jobs["moe-l2"], tokens=taught), moe_l2["l2_budget"])
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for config in configs:
            results[config].append(run(config, files, jobs, moe_l2["l2_budget"], heat))
    print(f"load after: {os.getloadavg()[0]:.1f}")
    report(results, compute_s)


if __name__ == "__main__":
    main()
