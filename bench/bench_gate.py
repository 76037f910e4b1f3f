"""What the gate (daemon/gate.py) costs on the control path, against libzmq bound directly, side by side.

One daemon, one process: the same requests go alternately through the public socket (the gate relays them) and
straight to the ROUTER's private socket (the gate's inner address, which this user may reach as the daemon's
own), so both paths share the daemon, the machine's load and the time. Printed: p50 / p99 of a hello round
trip, a stats round trip, and a load-through fetch (an L2 miss that waits for the daemon to load the expert),
each path's figures and their ratio.

    python bench/bench_gate.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import zmq

from moe_l2 import protocol
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.random_models import make_model
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles
from moe_l2.runtime import instance_tag


def round_trip(sock, message: protocol.Message) -> float:
    start = time.perf_counter()
    sock.send(message.encode())
    assert sock.poll(10_000), "no answer"
    protocol.decode_reply(sock.recv())
    return time.perf_counter() - start


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ml2-gate-", dir="/tmp"))
    try:
        model = work / "model"
        make_model(model, arch="qwen3_moe", layers=4, experts=32, top_k=4, hidden_size=128, moe_hidden_size=64,
                   bits=4, seed=1)
        files = ModelFiles.open(model)
        budget = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, 4)
        daemon = DaemonProcess.serving([model], budget).start()
        inner = f"ipc://{Path(daemon.socket[len('ipc://'):]).parent}/moe-l2d-{instance_tag(daemon.socket)}.gate"
        paths = {"gate": daemon.socket, "direct": inner}
        samples = {(path, what): [] for path in paths for what in ("hello", "stats", "load-through")}
        context = zmq.Context.instance()
        socks, clients, pools = {}, {}, {}
        try:
            for path, address in paths.items():
                socks[path] = context.socket(zmq.DEALER)
                socks[path].setsockopt(zmq.LINGER, 0)
                socks[path].connect(address)
                clients[path] = L2Client(files, address, wait_s=5)
                assert clients[path].attached, path
                pools[path] = ExpertPool(files, capacity=1, client=clients[path], load_through_s=2.0, lend=True)
            hello = protocol.Hello(id=1, model=str(model), fingerprint=files.fingerprint, client="bench")
            for i in range(args.rounds):
                for k, path in enumerate(paths):
                    samples[path, "hello"].append(round_trip(socks[path], hello))
                    samples[path, "stats"].append(round_trip(socks[path], protocol.Stats(id=2)))
                    # An expert not in L2: 4 slots a layer, and each path cycles through its own half of the 32.
                    half = files.n_experts // 2
                    layer, expert = i % files.n_layers, k * half + (i // files.n_layers) % half
                    start = time.perf_counter()
                    counts = pools[path].fetch(layer, [expert])
                    if counts.l2_awaited:
                        samples[path, "load-through"].append(time.perf_counter() - start)
        finally:
            for pool in pools.values():
                pool.close()
            for client in clients.values():
                client.close()
            for sock in socks.values():
                sock.close(0)
            daemon.cleanup()
        print(f"{args.rounds} rounds, the two paths alternating; round trips in ms")
        print(f"{'':<14}{'gate p50':>10}{'gate p99':>10}{'direct p50':>12}{'direct p99':>12}{'p50 ratio':>11}"
              f"{'p99 ratio':>11}{'n':>6}")
        for what in ("hello", "stats", "load-through"):
            gate, direct = samples["gate", what], samples["direct", what]
            if not gate or not direct:
                print(f"{what:<14} no samples")
                continue
            g50, g99, d50, d99 = (percentile(s, q) * 1e3 for s in (gate, direct) for q in (0.5, 0.99))
            print(f"{what:<14}{g50:>10.3f}{g99:>10.3f}{d50:>12.3f}{d99:>12.3f}{g50 / d50:>11.2f}{g99 / d99:>11.2f}"
                  f"{min(len(gate), len(direct)):>6}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
