"""What a client-side checksum costs on the copy path, side by side in one process (ratios: the machines are
noisy). For each record size, a batch of experts fetched through ExpertPool:

1. L2 hit: copied out of shared memory, unchecked (verify="file", the default) vs checked (verify="all");
2. L3 read, warm page cache: unchecked (verify="off") vs checked (verify="file", the default);
3. CRC-32 alone over the same bytes, for the throughput it runs at here: the CPU's as the reads run it
   (`_native.CRC32_KIND`), zlib's, and where the CPU folds 512 bits at a time, the same folding 128.

    python bench/bench_checksum.py [--sizes 2048x768,4096x2048] [--batch 8] [--repeat 30]

2048x768 is Qwen3-30B-A3B's expert (2.5 MiB at 4 bits), 4096x2048 a 13.5 MiB one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from pathlib import Path

from moe_l2 import _native, protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.random_models import make_model
from moe_l2.model.packer import pack
from moe_l2.sizes import format_size


def per_fetch(pool: ExpertPool, experts: list[int], repeat: int, want: str) -> float:
    """Median seconds of one fetch of the batch into an empty L0, checking where the experts came from."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        counts = pool.fetch(0, experts)
        times.append(time.perf_counter() - start)
        assert getattr(counts, want) == len(experts), counts
        for e in experts:
            pool.evict(0, e)
    return statistics.median(times)


def side_by_side(label: str, plain: float, checked: float, nbytes: int) -> None:
    print(f"   {label:<34} unchecked {plain * 1e3:8.2f} ms ({nbytes / plain / 1e9:5.2f} GB/s)   checked "
          f"{checked * 1e3:8.2f} ms ({nbytes / checked / 1e9:5.2f} GB/s)   checked / unchecked = "
          f"{checked / plain:.2f}x")


def bench_size(work: Path, hidden: int, moe_hidden: int, batch: int, repeat: int) -> None:
    source = make_model(work / f"m{hidden}", arch="qwen3_moe", layers=1, experts=batch, top_k=min(batch, 8),
                        hidden_size=hidden, moe_hidden_size=moe_hidden, bits=4, seed=0)
    files = pack(source, work / f"p{hidden}", progress=False, moe_l2_only=True)
    assert files.checksums is not None
    record = files.layout.nbytes
    nbytes = batch * record
    print(f"\nrecord {format_size(record)} ({hidden}x{moe_hidden}, 4-bit), batch of {batch} "
          f"({format_size(nbytes)}), median of {repeat} fetches")
    (work / f"d{hidden}").mkdir()
    daemon = DaemonProcess.serving([files.path], str(2 * nbytes + (64 << 20)), "--log-level", "warning",
                                   runtime_dir=work / f"d{hidden}").start()
    try:
        experts = list(range(batch))
        request(daemon.socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=0, experts=experts))
        while request(daemon.socket, protocol.Stats(id=1)).payload["models"][0]["loads_done"] < batch:
            time.sleep(0.05)
        client = L2Client(files, daemon.socket, wait_s=5)
        pools = {v: ExpertPool(files, capacity=batch, client=client, verify=v) for v in ("file", "all")}
        files_only = {v: ExpertPool(files, capacity=batch, verify=v, direct=False) for v in ("off", "file")}
        try:
            l2 = {v: per_fetch(p, experts, repeat, "l2_hits") for v, p in pools.items()}
            l3 = {v: per_fetch(p, experts, repeat, "l3_reads") for v, p in files_only.items()}
            # CRC-32 alone, over one record's worth of bytes held in memory, each way in turn.
            data = files.read_record(0, 0)
            narrow = "the CPU's, 128-bit"
            ways = {f"the CPU's ({_native.CRC32_KIND})": lambda: _native.crc32(data),
                    "zlib's": lambda: zlib.crc32(data)}
            if _native.CRC32_KIND == "vpclmulqdq":  # the same CPU folding 128 bits at a time
                ways[narrow] = lambda: _native.crc32(data)
            times: dict = {way: [] for way in ways}
            try:
                for _ in range(repeat):
                    for way, fn in ways.items():
                        _native._crc32_use_narrow(way == narrow)
                        times[way].append(_timed(fn))
            finally:
                _native._crc32_use_narrow(False)
            crc = {way: statistics.median(t) * batch for way, t in times.items()}
        finally:
            for p in (*pools.values(), *files_only.values()):
                p.close()
            client.close()
        side_by_side("1. L2 hit copy", l2["file"], l2["all"], nbytes)
        side_by_side("2. L3 read, warm page cache", l3["off"], l3["file"], nbytes)
        for way, took in crc.items():
            print(f"   3. CRC-32 alone, {way:<24} {took * 1e3:8.2f} ms ({nbytes / took / 1e9:5.2f} GB/s): "
                  f"{took / l2['file']:.2f}x an L2 copy, {took / l3['off']:.2f}x a warm L3 read")
    finally:
        daemon.cleanup()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2048x768,4096x2048",
                        help="expert shapes, hidden x moe-hidden, comma separated")
    parser.add_argument("--batch", type=int, default=8, help="experts per fetch (and in the model)")
    parser.add_argument("--repeat", type=int, default=30, help="fetches per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ml2c-", dir="/tmp") as tmp:
        for size in args.sizes.split(","):
            hidden, moe_hidden = (int(x) for x in size.split("x"))
            bench_size(Path(tmp), hidden, moe_hidden, args.batch, args.repeat)


if __name__ == "__main__":
    main()
