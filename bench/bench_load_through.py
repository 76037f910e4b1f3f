"""Load-through, side by side in one process: a miss waited for asleep on its slot_of entry, woken by the daemon's
begin_fill and publish (ExpertPool, client/slot_waits.py) vs a 0.5 ms sleep-poll of L2 (PolledLoader below, kept
here only as the baseline; the daemon's Loaded notice, relayed through its gate and the client's connection
thread, woke the wait in between).

Each miss is a record neither L0 nor L2 holds (the experts of a layer are taken in turn, L2 holds a few of them);
the pool reports it at once, the daemon reads it into L2, the pool copies it. Per miss: the wall time of the
fetch and the CPU time of this whole process meanwhile (the waiting thread and the connection thread). Rounds
alternate the two pools; medians, ratios.

    python bench/bench_load_through.py [--hidden 1024] [--moe-hidden 512] [--experts 64] [--rounds 10] [--misses 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.client.row_loader import RowLoader
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles
from moe_l2.lab.random_models import make_model
from moe_l2.sizes import format_size

# The interval of the poll the wake-ups replaced.
POLL_S = 0.0005


class PolledLoader(RowLoader):
    """The pool's row loader as it waited before wake-ups: copy from L2 every POLL_S until the deadline."""

    def await_l2(self, layer, lp, missing, rows, copied, timeout_s):
        copied = list(copied)
        deadline = time.perf_counter() + timeout_s
        while not all(copied) and self.client.attached and time.perf_counter() < deadline:
            time.sleep(POLL_S)
            todo = [i for i, ok in enumerate(copied) if not ok]
            for i, ok in zip(todo, self._copy_from_l2(layer, lp, [missing[i] for i in todo], [rows[i] for i in todo])):
                copied[i] = ok
        return copied


def polled_pool(*args, **kwargs) -> ExpertPool:
    """An ExpertPool whose loader polls (PolledLoader): the same state, the wait it had before wake-ups."""
    pool = ExpertPool(*args, **kwargs)
    pool.loader.__class__ = PolledLoader
    return pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="L2 slots per layer")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--misses", type=int, default=20, help="misses per pool per round")
    parser.add_argument("--load-through-ms", type=float, default=2000)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ml2lt-", dir="/tmp"))
    model = make_model(work / "model", arch="qwen3_moe", layers=args.layers, experts=args.experts, top_k=4,
                       hidden_size=args.hidden, moe_hidden_size=args.moe_hidden, bits=4, seed=0)
    files = ModelFiles.open(model)
    budget = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, args.slots)
    print(f"model: {args.layers} layers x {args.experts} experts, record {format_size(files.layout.nbytes)}; "
          f"L2 {args.slots} slots per layer; load_through {args.load_through_ms:g} ms")
    daemon = DaemonProcess.serving([model], str(budget), "--log-level", "warning", runtime_dir=work).start()
    client = L2Client(files, daemon.socket, wait_s=5)
    wait_s = args.load_through_ms / 1e3
    pools = {"poll 0.5 ms": polled_pool(files, 1, client, load_through_s=wait_s, lend=False),
             "slot wait": ExpertPool(files, 1, client, load_through_s=wait_s, lend=False)}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pools}
    skipped = dict.fromkeys(pools, 0)
    turn = 0
    try:
        for r in range(args.rounds):
            for name in (list(pools) if r % 2 == 0 else list(pools)[::-1]):
                for _ in range(args.misses):
                    layer, expert = turn % files.n_layers, (turn // files.n_layers) % files.n_experts
                    turn += 1
                    wall, cpu = time.perf_counter(), time.process_time()
                    counts = pools[name].fetch(layer, [expert])
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    if counts.l2_awaited == 1:  # loaded through (not in L2 already, not read from the file)
                        samples[name].append((wall, cpu))
                    else:
                        skipped[name] += 1
        print(f"{'wait':<12} {'misses':>6} {'latency p50':>12} {'p90':>9} {'CPU/miss p50':>13} {'CPU/wall':>9}")
        medians = {}
        for name, got in samples.items():
            walls, cpus = sorted(w for w, _ in got), sorted(c for _, c in got)
            medians[name] = statistics.median(walls), statistics.median(cpus)
            p90 = walls[int(0.9 * len(walls))]
            print(f"{name:<12} {len(got):>6} {medians[name][0] * 1e3:>9.3f} ms {p90 * 1e3:>6.3f}"
                  f" ms {medians[name][1] * 1e3:>10.3f} ms {sum(cpus) / sum(walls):>9.2f}"
                  + (f"  ({skipped[name]} not loaded through, left out)" if skipped[name] else ""))
        (pw, pc), (nw, nc) = medians.values()
        waits = pools["slot wait"].waits
        print(f"slot wait / poll: latency {nw / pw:.2f}x, CPU per miss {nc / pc:.2f}x; slot waits {waits.waits}, "
              f"woken {waits.woken}, reached the deadline {waits.expired}")
    finally:
        for pool in pools.values():
            pool.close()
        client.close()
        daemon.stop()
        daemon.unlink_leftovers()


if __name__ == "__main__":
    main()
