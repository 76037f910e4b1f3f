"""moe-l2d's `stats` latency under floods of hostile requests (issue 10.6, docs/security.md), side by side.

A small model, a daemon on an ipc socket in a temp dir (nothing leaves the machine), and for each flood a few
flooding connections sending flat out for a bounded time while one connection times `stats` round trips.
Printed: p50 / p99 of `stats` idle and under each flood, and their ratios to idle; then the cost of one of
each request issue 10.6 found expensive (a 1 MiB report took 8 s, a hello with a 1 MiB path 7 s).

    python bench/bench_flood.py [--seconds 3] [--flooders 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import zmq

from moe_l2 import protocol
from moe_l2.generator import make_model
from moe_l2.model import ModelFiles


def start_daemon(model: Path, directory: Path) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{directory}/moe-l2d.sock"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(model), "--budget",
                             "8MiB", "--runtime-dir", str(directory), "--log-level", "error"],
                            env=dict(os.environ, MOE_L2_RUNTIME_DIR=str(directory)))
    sock = dealer(address)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sock.send(protocol.Stats(id=1).encode())
        if sock.poll(500):
            sock.recv()
            sock.close(0)
            return proc, address
    raise SystemExit("moe-l2d did not start")


def dealer(address: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def stats_latencies(address: str, seconds: float) -> list[float]:
    sock = dealer(address)
    samples = []
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        start = time.perf_counter()
        sock.send(protocol.Stats(id=i).encode())
        while True:
            if not sock.poll(30_000):
                raise SystemExit("stats went unanswered for 30 s")
            if protocol.decode_reply(sock.recv()).id == i:
                break
        samples.append(time.perf_counter() - start)
        time.sleep(0.01)
    sock.close(0)
    return samples


def flood(address: str, frames: list[bytes], stop: threading.Event, new_identity: bool) -> None:
    sock = dealer(address)
    sock.setsockopt(zmq.SNDHWM, 100)
    i = 0
    while not stop.is_set():
        if new_identity:  # a fresh connection per request: the client-table attack
            sock.close(0)
            sock = dealer(address)
        try:
            sock.send(frames[i % len(frames)], zmq.NOBLOCK)
            i += 1
        except zmq.Again:
            time.sleep(0.001)
        while sock.poll(0):
            sock.recv()
    sock.close(0)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each flood")
    parser.add_argument("--flooders", type=int, default=2, help="flooding connections")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ml2-bench-", dir="/tmp"))
    try:
        model = work / "model"
        make_model(model, arch="qwen3_moe", layers=4, experts=32, top_k=4, hidden_size=128, moe_hidden_size=64,
                   bits=4, seed=1)
        files = ModelFiles.open(model)
        proc, address = start_daemon(model, work)
        fp, n = files.fingerprint, files.n_experts
        half = protocol.MAX_IDS // 2 - 1
        floods = {
            "largest legal reports": [protocol.Report(id=1, model=fp, layers={
                0: [[e % n for e in range(half)], [e % n for e in range(half)]]}).encode()],
            "hostile frames": [
                msgpack.packb({"v": 1, "type": "hello", "id": 2, "model": "/" + "a/.." * 60_000, "fingerprint": "0",
                               "client": "x"}),
                msgpack.packb({"v": 1, "type": "t" * 200_000, "id": 3}),
                msgpack.packb({"v": 1, "type": ["stats"], "id": 4}),
                protocol.Prefetch(id=5, model=fp, layer=0, experts=[*range(n), n]).encode(),
                protocol.Report(id=6, model=fp, layers={0: [[1] * 10_000, [2] * 10_000]}).encode()],
            "hellos from new identities": [protocol.Hello(id=7, model="/m", fingerprint=fp, client="c" * 256).encode()],
        }
        try:
            idle = stats_latencies(address, args.seconds)
            rows = [("idle", idle)]
            for name, frames in floods.items():
                stop = threading.Event()
                threads = [threading.Thread(target=flood, args=(address, frames, stop, name.startswith("hellos")))
                           for _ in range(args.flooders)]
                for t in threads:
                    t.start()
                time.sleep(0.2)
                try:
                    rows.append((name, stats_latencies(address, args.seconds)))
                finally:
                    stop.set()
                    for t in threads:
                        t.join()
            p50, p99 = percentile(idle, 0.5), percentile(idle, 0.99)
            print(f"stats round trip, {args.flooders} flooding connection(s), {args.seconds:g} s each")
            print(f"{'':<28}{'p50 ms':>9}{'p99 ms':>9}{'p50/idle':>10}{'p99/idle':>10}{'samples':>9}")
            for name, samples in rows:
                a, b = percentile(samples, 0.5), percentile(samples, 0.99)
                print(f"{name:<28}{a * 1e3:>9.2f}{b * 1e3:>9.2f}{a / p50:>10.1f}{b / p99:>10.1f}{len(samples):>9}")
            print("\none request of each kind issue 10.6 found expensive (then: 1 MiB report 8 s, 1 MiB hello 7 s)")
            sock = dealer(address)
            for name, frame in [("report of 1 MiB of ids", protocol.Report(id=8, model=fp, layers={
                    0: [[1] * (1 << 19), [2] * (1 << 19)]}).encode()),
                    ("hello with a 400 KB path", floods["hostile frames"][0]),
                    ("largest legal report", floods["largest legal reports"][0])]:
                start = time.perf_counter()
                sock.send(frame)
                sock.send(protocol.Stats(id=99).encode())
                answers = []
                while not answers or answers[-1].id != 99:
                    if not sock.poll(30_000):
                        answers.append(protocol.Reply(id=99, ok=False, ename="no answer (connection closed)"))
                        break
                    answers.append(protocol.decode_reply(sock.recv()))
                refused = [r.ename for r in answers if not r.ok]
                print(f"  {name:<26} {len(frame) / 1024:>8.0f} KiB  {(time.perf_counter() - start) * 1e3:>8.2f} ms  "
                      f"{'refused: ' + ', '.join(refused) if refused else 'accepted'}")
                if refused and refused[-1].startswith("no answer"):
                    sock.close(0)
                    sock = dealer(address)
            sock.close(0)
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
