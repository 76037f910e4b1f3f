"""What one layer's lookup costs the client when nothing is missing, apart from any read: moe-l2's (`borrow` from
an L2 that holds every expert, then the loan's check, as the streamed forward runs them) against pread's (`fetch`
from an L0 that holds every expert). This is the bookkeeping every layer of every token pays on a fast machine
where the disk is not what decides.

A real moe-l2d serves a packed model of a real geometry (`moe-l2 bench --geometry`'s, lab/synthetic.py) with room
for every expert; the trace's first tokens fill L2 and L0, then the two take turns (--repeat) replaying the rest
back to back, with no compute between layers. Prints each one's median microseconds a layer (min-max), the
ratio, and the machine's load.

    python bench/bench_lookup.py --trace ../shared/traces/deepseek-v2-lite.jsonl.gz [--layers 26] [--tokens 480]
                                 [--repeat 7] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import platformdirs

from moe_l2.cache.trace import read_traces
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.lab import synthetic
from moe_l2.lab.bench import trace_parts
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.replayer import replay
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles


def per_layer(lookup, tokens: list) -> float:
    """Microseconds a layer of `lookup(layer, experts)` over the tokens."""
    start = time.perf_counter()
    for token in tokens:
        for layer, experts in enumerate(token):
            lookup(layer, experts)
    return (time.perf_counter() - start) / sum(len(token) for token in tokens) * 1e6


def borrowing(pool: ExpertPool):
    def lookup(layer: int, experts: list[int]) -> None:
        loan = pool.borrow(layer, experts)[1]
        if loan is None:
            pool.fetch(layer, experts)
        elif loan.torn():
            raise SystemExit(f"layer {layer}: a loan was torn with no writer: L2 was not full")
    return lookup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="routing trace (the shared traces' format)")
    ap.add_argument("--geometry", default="deepseek-v2-lite", choices=sorted(synthetic.GEOMETRIES))
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default: all of the geometry's)")
    ap.add_argument("--tokens", type=int, default=480)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--cache-dir", type=Path, default=Path(platformdirs.user_cache_dir("moe-l2")) / "bench")
    args = ap.parse_args()
    geometry = synthetic.GEOMETRIES[args.geometry]
    model = synthetic.build(geometry, args.layers or geometry.n_moe_layers, args.cache_dir, say=print)
    files = ModelFiles.open(model)
    (tokens, warm), = trace_parts(read_traces([args.trace]), files.n_layers, 1, args.tokens, 0.2)
    budget = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, files.n_experts)
    work = Path(tempfile.mkdtemp(prefix="bench-lookup-"))
    daemon = DaemonProcess.serving([files.path], budget, "--log-level", "warning", runtime_dir=work).start()
    client = L2Client(files, daemon.socket, wait_s=5)
    # Each as `moe-l2 bench` runs it: moe-l2 with a shared L0 of twice top-k rows that gives its reads to L2.
    lending = ExpertPool(files, 2 * files.top_k, client, policy="lru", direct=True, verify="off", lend=True,
                         shared_l0=True, fill_l2=True)
    alone = ExpertPool(files, files.n_experts, None, policy="lru", direct=True, verify="off")
    try:
        lending.donor.wait_accepted(10)
        for pool in (lending, alone):
            replay(pool, tokens, 0.0)  # every expert the trace picks, resident
        before = [pool.counts.l3_reads for pool in (lending, alone)]
        runs = {"moe-l2 borrow + check": [], "pread fetch": []}
        for _ in range(args.repeat):
            runs["moe-l2 borrow + check"].append(per_layer(borrowing(lending), tokens[warm:]))
            runs["pread fetch"].append(per_layer(alone.fetch, tokens[warm:]))
        if [pool.counts.l3_reads for pool in (lending, alone)] != before:
            raise SystemExit("a run read from the disk: not every expert was resident; pass fewer --tokens")
    finally:
        lending.close(), alone.close(), client.close()
        daemon.stop()
        daemon.cleanup()
    print(f"{geometry.name}, {files.n_layers} MoE layers, {len(tokens) - warm} tokens a run, {args.repeat} runs "
          f"taking turns; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for name, times in runs.items():
        print(f"  {name:24} {statistics.median(times):6.1f} us a layer ({min(times):.1f}-{max(times):.1f})")
    ratios = [a / b for a, b in zip(*runs.values())]
    print(f"  moe-l2 / pread          {statistics.median(ratios):6.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
