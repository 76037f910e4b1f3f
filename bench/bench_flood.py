"""moe-l2d's `stats` latency under floods of hostile requests (issue 10.6, docs/security.md), side by side.

A small model, a daemon on an ipc socket in a temp dir (nothing leaves the machine), and for each flood a few
connections sending at a bounded rate for a bounded time while one connection times `stats` round trips.
Printed: p50 / p99 of `stats` idle and under each flood, and their ratios to idle; then the cost of one of each
request issue 10.6 found expensive (a 1 MiB report took 8 s, a hello with a 1 MiB path 7 s).

With --before REV the same floods also hit the daemon of an earlier revision of this repository (exported with
git archive, run with this checkout's native module), and the table puts "before" and "after" side by side.

With --metrics the floods are of the daemon's HTTP metrics endpoint instead (issue 20): N scrapers asking for
/metrics back to back and M idle HTTP connections (reopened when the daemon closes them, as an attacker
would); printed: `stats` p50 / p99 and the daemon's RSS, threads and descriptors before, during and after.

    python bench/bench_flood.py [--seconds 3] [--flooders 2] [--rate 20] [--before 15b2a7d]
    python bench/bench_flood.py --metrics [--scrapers 16] [--idle-http 200] [--seconds 3] [--before 15b2a7d]

With --connections N the flood is of connections to the control socket (issue 20): N plain connections, each
with a ZeroMQ greeting and then silent, held while `stats` is timed; printed: `stats` p50 / p99 and the daemon's
RSS, threads and descriptors idle, while they are held and after they are closed, and what its gate (daemon/
gate.py) held and refused. Before the gate, a daemon under a low descriptor limit died of SIGABRT here.

    python bench/bench_flood.py --connections 3000 [--seconds 3] [--before 15b2a7d]

With --group N the floods are those a member of the socket's group can send at no cost to itself (issue 37.12),
each from N connections in a process of its own: `stats` requests it never reads the replies of, ZMTP PING
commands whose PONGs it never reads, and connection churn (connect, greet, one request, close), then all three
at once; printed: `stats` p50 / p99 and the daemon's RSS idle, during each flood, just after and --settle seconds
after.

    python bench/bench_flood.py --group 256 [--seconds 3] [--settle 10] [--before 15b2a7d]
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import psutil
import zmq

from moe_l2 import protocol
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles


# Runs moe_l2.daemon.main from the tree in argv[1] instead of this checkout (whose editable install would win).
LAUNCH_TREE = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
               "sys.meta_path[:] = [f for f in sys.meta_path if 'Redirecting' not in type(f).__name__]; "
               "runpy.run_module('moe_l2.daemon.main', run_name='__main__', alter_sys=True)")


def export_tree(rev: str, dest: Path) -> Path:
    """The package of an earlier revision, laid out as installed (moe_l2, moe_l2.daemon, moe_l2.client) beside
    this checkout's native module, which only ever gains functions."""
    repo = Path(__file__).resolve().parent.parent
    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = dest / "pkg" / "moe_l2"
    shutil.copytree(src / "moe_l2", pkg)
    shutil.copytree(src / "daemon", pkg / "daemon")
    shutil.copytree(src / "client", pkg / "client")
    import mlx
    from moe_l2 import _native

    shutil.copy(_native.__file__, pkg)
    (dest / "pkg" / "mlx").symlink_to(Path(mlx.__path__[0]))  # the module's rpath: $ORIGIN/../mlx/lib
    return dest / "pkg"


def dealer(address: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


# A stats round trip longer than this is counted as this long, and ends the measurement.
GIVE_UP_S = 20.0


def stats_latencies(address: str, seconds: float) -> list[float]:
    sock = dealer(address)
    samples = []
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        start = time.perf_counter()
        sock.send(protocol.Stats(id=i).encode())
        while sock.poll(int(GIVE_UP_S * 1000)):
            if protocol.decode_reply(sock.recv()).id == i:
                break
        else:
            samples.append(GIVE_UP_S)
            break
        samples.append(time.perf_counter() - start)
        time.sleep(0.01)
    sock.close(0)
    return samples


def flood(address: str, frames: list[bytes], stop: threading.Event, rate: float, new_identity: bool) -> None:
    sock = dealer(address)
    i = 0
    while not stop.wait(1 / rate):
        if new_identity:  # a fresh connection per hello: the client-table attack
            sock.close(0)
            sock = dealer(address)
        sock.send(frames[i % len(frames)])
        i += 1
        while sock.poll(0):
            sock.recv()
    sock.close(0)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def workload(fp: str, n: int) -> tuple[dict, list]:
    """The floods and the single requests, for the model of fingerprint fp (each revision computes its own)."""
    half = protocol.MAX_IDS // 2 - 1
    legal = protocol.Report(id=1, model=fp, layers={0: [[e % n for e in range(half)],
                                                        [e % n for e in range(half)]]}).encode()
    floods = {
        "largest legal reports": [legal],
        "hostile frames": [
            msgpack.packb({"v": 1, "type": "hello", "id": 2, "model": "/" + "a/.." * 60_000, "fingerprint": "0",
                           "client": "x"}),
            msgpack.packb({"v": 1, "type": "t" * 200_000, "id": 3}),
            msgpack.packb({"v": 1, "type": ["stats"], "id": 4}),
            protocol.Prefetch(id=5, model=fp, layer=0, experts=[*range(n), n]).encode(),
            protocol.Report(id=6, model=fp, layers={0: [[1] * 10_000, [2] * 10_000]}).encode()],
        "hellos from new identities": [protocol.Hello(id=7, model="/m", fingerprint=fp, client="c" * 256).encode()],
    }
    singles = [("report of 1 MiB of ids", protocol.Report(id=8, model=fp, layers={  # just under the old limit
                    0: [[1] * ((1 << 19) - 64), [2] * ((1 << 19) - 64)]}).encode()),
               ("hello with a 240 KB path", floods["hostile frames"][0]),
               ("largest legal report", legal)]
    return floods, singles


def measure(address: str, floods: dict, args) -> list[tuple[str, list[float]]]:
    rows = [("idle", stats_latencies(address, args.seconds))]
    for name, frames in floods.items():
        stop = threading.Event()
        threads = [threading.Thread(target=flood, args=(address, frames, stop, args.rate, name.startswith("hellos")))
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
    return rows


def single_requests(address: str, requests: list[tuple[str, bytes]], max_frame: int | None) -> list[str]:
    """Each request followed by a stats barrier: the time until the barrier's answer, and what was refused
    (a frame over max_frame, this checkout's ZMQ_MAXMSGSIZE, gets no reply: libzmq closes its connection)."""
    lines = []
    sock = dealer(address)
    for name, frame in requests:
        start = time.perf_counter()
        sock.send(frame)
        sock.send(protocol.Stats(id=99).encode())
        refused = []
        while sock.poll(int(GIVE_UP_S * 1000)):
            reply = protocol.decode_reply(sock.recv())
            if reply.id == 99 and reply.ok:
                break
            refused.append(reply.ename)
        else:
            refused.append(f"no answer within {GIVE_UP_S:g} s")
        if not refused and max_frame is not None and len(frame) > max_frame:
            refused.append("no reply: libzmq closed the connection (ZMQ_MAXMSGSIZE)")
        lines.append(f"{name:<26} {len(frame) / 1024:>6.0f} KiB {(time.perf_counter() - start) * 1e3:>9.1f} ms  "
                     + ("refused: " + ", ".join(refused) if refused else "accepted"))
    sock.close(0)
    return lines


def percentiles(samples: list[float]) -> tuple[float, float]:
    return percentile(samples, 0.5), percentile(samples, 0.99)


def scraper(port: int, stop: threading.Event, counts: dict) -> None:
    """GET /metrics back to back, each on a new connection (the endpoint closes every connection)."""
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GIVE_UP_S)
        try:
            conn.request("GET", "/metrics")
            answer = conn.getresponse()
            answer.read()
            counts["ok" if answer.status == 200 else "failed"] += 1
        except (OSError, http.client.HTTPException):
            counts["failed"] += 1
        finally:
            conn.close()


def idle_holder(port: int, n: int, stop: threading.Event, counts: dict, held: threading.Event) -> None:
    """Holds n idle HTTP connections (`held` set once they are open), opening a new one whenever the daemon
    closes one."""
    selector = selectors.DefaultSelector()

    def open_one():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP_S)
        except OSError:
            counts["failed"] += 1
            return
        selector.register(sock, selectors.EVENT_READ)
        counts["opened"] += 1

    for _ in range(n):
        open_one()
    held.set()
    while not stop.is_set():
        for key, _ in selector.select(0.1):
            selector.unregister(key.fileobj)
            key.fileobj.close()
            open_one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()


def daemon_figures(pid: int) -> dict:
    process = psutil.Process(pid)
    return {"rss": process.memory_info().rss, "threads": process.num_threads(), "fds": process.num_fds()}


def http_flood(kind: str, port: int, n: int, stop, out) -> None:
    """In a process of its own, so that the flood's threads do not take the measuring thread's GIL: n
    scrapers, or one holder of n idle connections, until `stop`; puts None on `out` once flooding, then its
    counts."""
    counts = {"ok": 0, "failed": 0, "opened": 0}
    done, held = threading.Event(), threading.Event()
    threads = ([threading.Thread(target=scraper, args=(port, done, counts)) for _ in range(n)] if kind == "scrapers"
               else [threading.Thread(target=idle_holder, args=(port, n, done, counts, held))])
    for t in threads:
        t.start()
    if kind != "scrapers":
        held.wait()
    out.put(None)
    stop.wait()
    done.set()
    for t in threads:
        t.join()
    out.put(counts)


def metrics_flood(address: str, port: int, pid: int, args) -> list[tuple[str, list[float], dict, dict]]:
    """(phase, stats latencies, the daemon's figures at the phase's end, scrape counts) idle, under
    args.scrapers scrapers and args.idle_http idle connections, and after."""
    rows = [("idle", stats_latencies(address, args.seconds), daemon_figures(pid), {})]
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    floods = [context.Process(target=http_flood, args=(kind, port, n, stop, out))
              for kind, n in (("scrapers", args.scrapers), ("idle", args.idle_http))]
    for p in floods:
        p.start()
    for _ in floods:
        out.get(timeout=120)
    try:
        during = stats_latencies(address, args.seconds)
        figures = daemon_figures(pid)
    finally:
        stop.set()
    counts = {}
    for _ in floods:
        for key, value in out.get(timeout=60).items():
            counts[key] = counts.get(key, 0) + value
    for p in floods:
        p.join()
    rows.append(("during", during, figures, counts))
    time.sleep(0.5)
    rows.append(("after", stats_latencies(address, args.seconds), daemon_figures(pid), {}))
    return rows


# What a ZeroMQ DEALER says first (ZMTP 3.0, NULL mechanism): its greeting and READY; silence after that is legal.
ZMTP_OPENING = (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
                + bytes([4, 28]) + b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER")


def timed_stats(sock, seconds: float) -> tuple[list[float], dict]:
    """stats round trips on `sock` for `seconds`, and the last reply's daemon figures."""
    samples, daemon = [], {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        sock.send(protocol.Stats(id=len(samples) + 1).encode())
        if not sock.poll(int(GIVE_UP_S * 1000)):
            return samples + [GIVE_UP_S], {}
        daemon = protocol.decode_reply(sock.recv()).payload["daemon"]
        samples.append(time.perf_counter() - start)
        time.sleep(0.01)
    return samples, daemon


def connection_flood(address: str, pid: int, args) -> list[tuple[str, list[float], dict, dict]]:
    """(phase, stats latencies, the daemon's figures, its gate's) idle, while args.connections are held, after.
    The timing connection is opened first: the flood comes from the same user, whose share it may fill."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # importing mlx_lm left it at 2048
    timer = dealer(address)
    rows = []
    try:
        samples, daemon = timed_stats(timer, args.seconds)
        rows.append(("idle", samples, daemon_figures(pid), daemon.get("gate") or {}))
        held = []
        for _ in range(min(args.connections, hard - 256)):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(address[len("ipc://"):])
                sock.sendall(ZMTP_OPENING)
            except OSError:
                sock.close()
                continue
            held.append(sock)
        try:
            time.sleep(0.5)  # the gate turns away what is past its caps
            samples, daemon = timed_stats(timer, args.seconds)
            rows.append((f"{len(held)} held", samples, daemon_figures(pid), daemon.get("gate") or {}))
        except psutil.NoSuchProcess:
            rows.append(("during", [GIVE_UP_S], {}, {}))
            return rows
        finally:
            for sock in held:
                sock.close()
        time.sleep(1.5)  # a tick after the flood has passed the gate gives its heap back
        samples, daemon = timed_stats(timer, args.seconds)
        rows.append(("after", samples, daemon_figures(pid), daemon.get("gate") or {}))
    finally:
        timer.close(0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return rows


def print_connection_flood(model: Path, trees: dict, work: Path, args) -> None:
    results = per_tree(model, trees, work, "connections",
                       lambda daemon: connection_flood(daemon.socket, daemon.proc.pid, args))
    print(f"stats round trip (ms) and the daemon's RSS (MiB), threads and descriptors: idle, while "
          f"{args.connections} connections are held (a ZeroMQ greeting each, then silence), and after")
    print_phases(results, lambda gate: f"  gate: {gate['connections']} open of {gate['max_connections']} "
                                       f"({gate['max_per_user']} per user), refused {sum(gate['refused'].values())}")


def per_tree(model: Path, trees: dict, work: Path, name: str, measure) -> dict:
    """{label: measure(daemon)} for a daemon of each tree (None: this checkout's), each in a runtime dir of its own."""
    results = {}
    for label, tree in trees.items():
        directory = work / f"{name}-{label}"
        directory.mkdir()
        command = (sys.executable, "-P", "-c", LAUNCH_TREE, str(tree)) if tree else None
        daemon = DaemonProcess.serving([model], "8MiB", runtime_dir=directory, command=command).start()
        try:
            results[label] = measure(daemon)
        finally:
            daemon.stop(timeout=10)
    return results


def print_phases(results: dict, describe) -> None:
    """Each tree's phases (phase, samples, figures, what describe() adds to the line when the phase has any)."""
    for label, rows in results.items():
        idle = percentiles(rows[0][1])
        print(f"  {label}")
        for phase, samples, figures, extra in rows:
            if not figures:
                print(f"    {phase:<16} the daemon died")
                continue
            print(phase_line(phase, samples, figures, idle) + (describe(extra) if extra else ""))


def phase_line(phase: str, samples: list[float], figures: dict, idle: tuple[float, float]) -> str:
    """One phase of a flood: stats p50 and p99 (ms, and against the idle daemon's), RSS, threads, descriptors."""
    p50, p99 = percentiles(samples)
    return (f"    {phase:<16} p50 {p50 * 1e3:8.2f} (x{p50 / idle[0]:5.1f})  p99 {p99 * 1e3:8.2f} "
            f"(x{p99 / idle[1]:5.1f})  rss {figures['rss'] / 2**20:7.1f}  threads {figures['threads']:4d}"
            f"  fds {figures['fds']:5d}")


# ZMTP 3.1's PING command (a name, a 2-byte TTL, no context) and a stats request as one frame each.
PING = bytes([4, 7]) + b"\x04PING" + bytes(2)
STATS_FRAME = bytes([0, len(protocol.Stats(id=1).encode())]) + protocol.Stats(id=1).encode()
GROUP_FLOODS = ("never-read stats", "PINGs", "churn")


def _opened(path: str) -> socket.socket | None:
    """A connection whose ZMTP handshake is done (libzmq 4.3 fails one whose peer sends messages before it has
    answered the greeting), non-blocking; None when the daemon turned it away."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(GIVE_UP_S)
    try:
        sock.connect(path)
        sock.sendall(ZMTP_OPENING)
        answer = b""
        while len(answer) < 66 or len(answer) < 66 + answer[65]:  # its greeting, then its READY (a short frame)
            more = sock.recv(256)
            if not more:
                raise ConnectionResetError
            answer += more
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def group_flood(kind: str, path: str, n: int, stop, out) -> None:
    """In a process of its own: n connections sending `kind` as fast as the daemon takes it, never reading, or for
    churn n connections opened, sent one request and closed in turn; puts None once flooding, then its counts."""
    counts = {"sent": 0, "turned away": 0}
    if kind == "churn":
        out.put(None)
        while not stop.is_set():
            for _ in range(n):
                sock = _opened(path)
                if sock is None:
                    counts["turned away"] += 1
                    continue
                try:
                    sock.send(STATS_FRAME)
                    counts["sent"] += 1
                except OSError:
                    pass
                sock.close()
        out.put(counts)
        return
    chunk = (STATS_FRAME if kind == "never-read stats" else PING) * 256
    selector = selectors.DefaultSelector()
    for _ in range(n):
        sock = _opened(path)
        if sock is None:
            counts["turned away"] += 1
        else:
            selector.register(sock, selectors.EVENT_WRITE)
    out.put(None)
    while not stop.is_set():
        for key, _ in selector.select(0.1):
            left = key.data or chunk  # the rest of a chunk sent in part: frames stay whole
            try:
                sent = key.fileobj.send(left)
            except BlockingIOError:
                continue
            except OSError:  # the daemon closed it
                selector.unregister(key.fileobj)
                key.fileobj.close()
                continue
            counts["sent"] += sent
            selector.modify(key.fileobj, selectors.EVENT_WRITE, left[sent:])
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()
    out.put(counts)


def group_floods(address: str, pid: int, args) -> list[tuple[str, list[float], dict, dict]]:
    """(phase, stats latencies, the daemon's figures at the phase's end, the flood's counts): idle, each of
    GROUP_FLOODS from args.group connections, all three at once, just after and args.settle seconds after. The
    timing connection is opened first: the floods come from the same user, whose share they may fill."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # importing mlx_lm left it at 2048
    timer = dealer(address)
    path = address[len("ipc://"):]
    context = multiprocessing.get_context("spawn")
    rows = []
    try:
        rows.append(("idle", timed_stats(timer, args.seconds)[0], daemon_figures(pid), {}))
        refused = 0
        for kinds in [(kind,) for kind in GROUP_FLOODS] + [GROUP_FLOODS]:
            stop, out = context.Event(), context.Queue()
            floods = [context.Process(target=group_flood, args=(kind, path, args.group, stop, out)) for kind in kinds]
            for p in floods:
                p.start()
            for _ in floods:
                out.get(timeout=120)
            try:
                samples, daemon = timed_stats(timer, args.seconds)
                figures = daemon_figures(pid)
            except psutil.NoSuchProcess:
                rows.append((" + ".join(kinds), [GIVE_UP_S], {}, {}))
                return rows
            finally:
                stop.set()
            counts: dict = {}
            for _ in floods:
                for key, value in out.get(timeout=60).items():
                    counts[key] = counts.get(key, 0) + value
            for p in floods:
                p.join()
            gate = (daemon or {}).get("gate") or {}
            counts["closed"] = sum(gate.get("refused", {}).values()) - refused
            refused += counts["closed"]
            rows.append(("all three" if len(kinds) > 1 else kinds[0], samples, figures, counts))
        rows.append(("just after", timed_stats(timer, args.seconds)[0], daemon_figures(pid), {}))
        time.sleep(args.settle)
        rows.append((f"{args.settle:g} s after", timed_stats(timer, args.seconds)[0], daemon_figures(pid), {}))
    finally:
        timer.close(0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return rows


def print_group_floods(model: Path, trees: dict, work: Path, args) -> None:
    results = per_tree(model, trees, work, "group", lambda daemon: group_floods(daemon.socket, daemon.proc.pid, args))
    print(f"stats round trip (ms) and the daemon's RSS (MiB), threads and descriptors: idle, during each flood of "
          f"{args.group} connections ({', '.join(GROUP_FLOODS)}, then all three), just after, and {args.settle:g} s "
          f"after; {args.seconds:g} s each")
    print_phases(results, lambda counts: f"  sent {counts['sent']}, turned away {counts['turned away']}, closed by "
                                         f"the gate {counts['closed']}")


def print_metrics_flood(model: Path, trees: dict, work: Path, args) -> None:
    results = {}
    for label, tree in trees.items():
        directory = work / f"metrics-{label}"
        directory.mkdir()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = (sys.executable, "-P", "-c", LAUNCH_TREE, str(tree)) if tree else None
        daemon = DaemonProcess.serving([model], "8MiB", "--metrics", f"127.0.0.1:{port}", runtime_dir=directory,
                                       command=command).start()
        try:
            results[label] = metrics_flood(daemon.socket, port, daemon.proc.pid, args)
        finally:
            daemon.stop(timeout=10)
    print(f"stats round trip (ms) and the daemon's RSS (MiB), threads and descriptors: idle, during "
          f"{args.scrapers} scrapers of /metrics and {args.idle_http} idle HTTP connections, and after; "
          f"{args.seconds:g} s each")
    print_phases(results, lambda counts: f"  scrapes {counts['ok']} answered, {counts['failed']} refused or "
                                         f"failed; {counts['opened']} idle connections opened")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each flood")
    parser.add_argument("--flooders", type=int, default=2, help="flooding connections")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second per flooding connection")
    parser.add_argument("--before", metavar="REV", help="also measure the daemon of this git revision")
    parser.add_argument("--connections", type=int, default=0, metavar="N",
                        help="flood the control socket with N held connections instead")
    parser.add_argument("--metrics", action="store_true",
                        help="flood the daemon's HTTP metrics endpoint instead of its control socket")
    parser.add_argument("--scrapers", type=int, default=16, help="with --metrics: concurrent scrapers")
    parser.add_argument("--idle-http", type=int, default=200, help="with --metrics: idle HTTP connections held")
    parser.add_argument("--group", type=int, default=0, metavar="N",
                        help="flood as a member of the socket's group, from N connections per flood, instead")
    parser.add_argument("--settle", type=float, default=10.0, help="with --group: seconds before the last row")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ml2-bench-", dir="/tmp"))
    try:
        model = work / "model"
        make_model(model, arch="qwen3_moe", layers=4, experts=32, top_k=4, hidden_size=128, moe_hidden_size=64,
                   bits=4, seed=1)
        n = ModelFiles.open(model).n_experts
        results = {}
        trees = {"after": None}
        if args.before:
            trees = {"before": export_tree(args.before, work / "before"), **trees}
        if args.metrics:
            print_metrics_flood(model, trees, work, args)
            return
        if args.connections:
            print_connection_flood(model, trees, work, args)
            return
        if args.group:
            print_group_floods(model, trees, work, args)
            return
        for label, tree in trees.items():
            directory = work / f"run-{label}"
            directory.mkdir()
            command = (sys.executable, "-P", "-c", LAUNCH_TREE, str(tree)) if tree else None
            daemon = DaemonProcess.serving([model], "8MiB", runtime_dir=directory, command=command).start()
            address = daemon.socket
            try:
                sock = dealer(address)
                sock.send(protocol.Stats(id=1).encode())
                fp = protocol.decode_reply(sock.recv()).payload["models"][0]["fingerprint"]
                sock.close(0)
                floods, singles = workload(fp, n)
                results[label] = (measure(address, floods, args),
                                  single_requests(address, singles, None if tree else 2 * protocol.MAX_FRAME_BYTES))
            finally:
                daemon.stop(timeout=10)  # killed after that: an old daemon may still be busy with a backlog
        print(f"stats round trip (ms), {args.flooders} connection(s) x {args.rate:g} requests/s, "
              f"{args.seconds:g} s per flood; a round trip over {GIVE_UP_S:g} s counts as {GIVE_UP_S:g} s")
        labels = list(results)
        header = "".join(f"{label + ' p50':>13}{label + ' p99':>13}" for label in labels)
        ratio = f"{'p50 before/after':>18}{'p99 before/after':>18}" if len(labels) == 2 else ""
        print(f"{'':<28}{header}{ratio}")
        for i, (name, _) in enumerate(results[labels[-1]][0]):
            cells = [percentiles(results[label][0][i][1]) for label in labels]
            line = f"{name:<28}" + "".join(f"{a * 1e3:>13.2f}{b * 1e3:>13.2f}" for a, b in cells)
            if len(cells) == 2:
                line += f"{cells[0][0] / cells[1][0]:>18.1f}{cells[0][1] / cells[1][1]:>18.1f}"
            print(line)
        idle = percentiles(results[labels[-1]][0][0][1])
        print("\nafter, under each flood / idle: " + ", ".join(
            f"{name} p50 x{percentile(samples, 0.5) / idle[0]:.1f} p99 x{percentile(samples, 0.99) / idle[1]:.1f}"
            for name, samples in results[labels[-1]][0][1:]))
        print("\none request of each kind issue 10.6 found expensive, then a stats barrier:")
        for label in labels:
            for line in results[label][1]:
                print(f"  {label:<7}{line}")
        print("\nthe daemons' logs:")
        for label in labels:
            lines = (work / f"run-{label}" / "daemon.log").read_text(errors="replace").splitlines()
            print(f"  {label:<7}{len(lines)} lines, {sum('Traceback' in line for line in lines)} tracebacks, "
                  f"longest line {max(map(len, lines), default=0)} characters")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
