"""The L2 data path, measured side by side in one process (ratios: the machines are noisy).

1. L2 hit copy of a batch of records (SlotIndex.copy, on one thread and on the pool's copy threads) vs
   plain memcpy of the same bytes; SlotIndex.lend + check of the same batch (the zero-copy path's instead).
2. Per-record cost: L2 copy vs pread from a warm page cache vs pread after posix_fadvise(DONTNEED).
3. `stats` reply latency p50/p99, idle and with 4 clients copying flat out.

    python bench/bench_l2.py [--hidden 1024] [--moe-hidden 512] [--experts 16] [--repeat 50]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_l2 import protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles
from moe_l2.sizes import format_size

COPIER = """
import sys, random
from moe_l2.model import ModelFiles
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
files = ModelFiles.open(sys.argv[1])
pool = ExpertPool(files, capacity=files.top_k, client=L2Client(files, sys.argv[2], wait_s=5))
rng = random.Random(int(sys.argv[3]))
print("ready", flush=True)
while True:
    pool.fetch(rng.randrange(files.n_layers), rng.sample(range(files.n_experts), files.top_k))
"""


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ml2b-", dir="/tmp"))
    model = make_model(work / "model", arch="qwen3_moe", layers=2, experts=args.experts, top_k=4,
                       hidden_size=args.hidden, moe_hidden_size=args.moe_hidden, bits=4, seed=0)
    files = ModelFiles.open(model)
    record = files.layout.nbytes
    print(f"model: 2 layers x {args.experts} experts, record {format_size(record)}, batch {args.batch}")
    daemon = DaemonProcess.serving([model], "4GiB", "--log-level", "warning", runtime_dir=work).start()
    socket = daemon.socket
    try:
        for layer in range(files.n_layers):
            request(socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=layer,
                                              experts=list(range(files.n_experts))))
        while request(socket, protocol.Stats(id=1)).payload["models"][0]["loads_done"] < 2 * args.experts:
            time.sleep(0.05)
        client = L2Client(files, socket, wait_s=5)
        att = client.attachment
        g = att.geometry
        slot_index = att.slot_indexes[0]
        pool = ExpertPool(files, capacity=args.batch, client=client)
        lp = pool.layers[0]
        experts = list(range(args.batch))
        rows = list(range(args.batch))

        def l2_copy(threads=pool.loader.copy_threads):
            ok = slot_index.copy(lp.copy_pieces, experts, rows, threads)
            assert all(ok)

        src = att.data[0].view()
        slots = [slot_index.slot_of(e) for e in experts]
        places = [[(dst.view(), at) for dst, at in lp.places(row)] for row in rows]

        def memcpy():
            for slot, row_places in zip(slots, places):
                base = slot * g.slot_stride
                for p, (dst, at) in zip(lp.layout.pieces, row_places):
                    dst[at:at + p.nbytes] = src[base + p.offset:base + p.offset + p.nbytes]

        t_l2 = best_of(l2_copy, args.repeat)
        t_one = best_of(lambda: l2_copy(1), args.repeat)
        t_memcpy = best_of(memcpy, args.repeat)
        batch_bytes = args.batch * record
        print("\n1. L2 hit copy vs plain memcpy of the same bytes")
        print(f"   L2 copy  {t_l2 * 1e3:8.3f} ms  {batch_bytes / t_l2 / 1e9:6.2f} GB/s  "
              f"({pool.loader.copy_threads} threads)")
        print(f"   1 thread {t_one * 1e3:8.3f} ms  {batch_bytes / t_one / 1e9:6.2f} GB/s  "
              f"({t_one / t_l2:.2f}x the threads' time)")
        print(f"   memcpy   {t_memcpy * 1e3:8.3f} ms  {batch_bytes / t_memcpy / 1e9:6.2f} GB/s")
        print(f"   L2 copy speed / memcpy speed = {t_memcpy / t_l2:.2f}x")

        def lend_check():
            lent = slot_index.lend(experts)
            assert all(slot_index.check([slot for slot, _ in lent], [seq for _, seq in lent]))

        t_lend = best_of(lend_check, args.repeat)
        print(f"   lend + check {t_lend * 1e6:8.1f} us  (the zero-copy path's seqlock work for the batch: "
              f"{t_lend / t_l2:.4f}x the copy's time)")

        fds = pool.loader.fds

        def pread_warm():
            pool.loader.read_from_l3(0, lp, list(zip(experts, rows)))

        t_warm = best_of(pread_warm, args.repeat)
        per = 1e6 / args.batch
        print("\n2. per-record cost (batch of", args.batch, "records)")
        print(f"   L2 copy           {t_l2 * per:9.1f} us   1.00x")
        print(f"   pread, warm cache {t_warm * per:9.1f} us   {t_warm / t_l2:5.2f}x the L2 copy")
        if hasattr(os, "posix_fadvise"):
            def pread_cold():
                for fd in fds:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                pool.loader.read_from_l3(0, lp, list(zip(experts, rows)))

            t_cold = statistics.median(best_of(pread_cold, 1) for _ in range(max(5, args.repeat // 5)))
            print(f"   pread, dropped    {t_cold * per:9.1f} us   {t_cold / t_l2:5.2f}x the L2 copy"
                  "  (page cache dropped with fadvise; a tmpfs or cached disk may still be fast)")
        else:  # macOS: no posix_fadvise, and dropping the page cache takes `sudo purge`
            print("   pread, dropped    (not measured: this system has no posix_fadvise to drop the page cache)")

        def stats_latency(n: int = 200) -> tuple[float, float]:
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                assert request(socket, protocol.Stats(id=1)).ok
                samples.append(time.perf_counter() - start)
            return percentiles(samples)

        idle = stats_latency()
        copiers = [subprocess.Popen([sys.executable, "-P", "-c", COPIER, str(model), socket, str(i)],
                                    stdout=subprocess.PIPE, text=True) for i in range(4)]
        for c in copiers:
            c.stdout.readline()
        time.sleep(1)
        loaded = stats_latency()
        for c in copiers:
            c.send_signal(signal.SIGKILL)
            c.wait()
            c.stdout.close()
        print("\n3. stats reply latency (fresh connection per request)")
        print(f"   idle                 p50 {idle[0] * 1e3:6.2f} ms  p99 {idle[1] * 1e3:6.2f} ms")
        print(f"   4 clients flat out   p50 {loaded[0] * 1e3:6.2f} ms  p99 {loaded[1] * 1e3:6.2f} ms"
              f"   ({loaded[0] / idle[0]:.2f}x / {loaded[1] / idle[1]:.2f}x idle)")
        pool.close()
        client.close()
    finally:
        daemon.cleanup()


if __name__ == "__main__":
    main()
