"""`moe-l2 serve` under 1, 2 and 4 concurrent streaming clients: one server, two servers sharing one daemon,
two servers without a daemon; tokens/s, time to first token and the machine's memory for each.

    python bench/bench_serve.py [--model DIR] [--tokens 32] [--clients 1,2,4]

Without --model it makes a random-weight qwen3_moe checkpoint in a temp dir. Everything runs on loopback. In
each setup the servers (default L0: a quarter of the experts) and, where there is one, a daemon holding every
expert are started once and warmed with one request each; then for each client count, that many streaming
chat requests (distinct prompts, so mlx-lm's prompt cache never answers, temperature 1: greedy decoding of
random weights routes to a handful of experts) go out at once, spread over the servers. Printed per row:
- tok/s: generated tokens of all clients over the wall time from the first request to the last token;
- TTFT: the median time from sending a request to its first text chunk (mlx_lm.server sends a chunk only
  for tokens that add text);
- memory: the servers' and the daemon's resident memory without shared memory (RssAnon + RssFile, Linux),
  plus the daemon's segments once; so a segment page that several processes map is counted once. Model file
  pages in the page cache (what the servers without a daemon read from) are not counted;
and every row's ratios to the one-server row with the same client count.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from moe_l2 import protocol
from moe_l2.client.connection import request
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.lab.random_models import make_model
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles

MODEL = dict(arch="qwen3_moe", layers=6, experts=32, top_k=4, hidden_size=128, moe_hidden_size=128, bits=4, seed=11)
PROMPT = "Request {n}: summarise how a machine-wide expert cache lets several processes share the weights."
REQUEST_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, log: Path, *args: str):
        self.port = free_port()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "moe_l2.cli", "serve", "--model", str(model),
                                          "--port", str(self.port), "--log-level", "WARNING", *args],
                                         stdout=out, stderr=out)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moe-l2 serve exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"moe-l2 serve not healthy after 180 s:\n{log.read_text()}")

    def stream(self, prompt: str, tokens: int) -> dict:
        """One streaming chat request: seconds to the first token, to the last, and tokens generated."""
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                           "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        first = None
        generated = 0
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if event.get("usage"):
                generated = event["usage"]["completion_tokens"]
            elif first is None and event["choices"] and event["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter()
        end = time.perf_counter()
        conn.close()
        return {"ttft": (first or end) - start, "start": start, "end": end, "tokens": generated}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def private_memory(pid: int) -> int:
    """Resident memory that is not shared memory: RssAnon + RssFile (Linux), else the RSS."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))
    except (OSError, KeyError):
        return psutil.Process(pid).memory_info().rss


def measure(servers: list[Server], daemon: DaemonProcess | None, clients: int, tokens: int, counter) -> dict:
    results: list[dict] = [{} for _ in range(clients)]

    def client(i: int) -> None:
        results[i] = servers[i % len(servers)].stream(PROMPT.format(n=next(counter)), tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    if any(not r for r in results):
        raise RuntimeError("a request did not finish")
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    memory = sum(private_memory(s.proc.pid) for s in servers)
    if daemon is not None:
        reply = request(daemon.socket, protocol.Stats(id=1)).payload["daemon"]
        memory += private_memory(reply["pid"]) + reply["shm_bytes"]
    return {"tps": sum(r["tokens"] for r in results) / wall,
            "ttft": statistics.median(r["ttft"] for r in results), "memory": memory}


def run_setup(name: str, model: Path, files: ModelFiles, n_servers: int, with_daemon: bool, args, work: Path,
              counter) -> dict[int, dict]:
    daemon = None
    servers: list[Server] = []
    try:
        extra: tuple[str, ...] = ("--no-daemon",)
        if with_daemon:
            budget = Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, files.n_experts)
            daemon = DaemonProcess.serving([model], budget, log_path=work / f"{name}-daemon.log").start()
            extra = ("--socket", daemon.socket)
        servers = [Server(model, work / f"{name}-{i}.log", *extra) for i in range(n_servers)]
        for server in servers:
            server.stream(PROMPT.format(n=next(counter)), args.tokens)  # warm: L0, L2 and MLX's kernels
        return {c: measure(servers, daemon, c, args.tokens, counter) for c in args.clients}
    finally:
        for server in servers:
            server.stop()
        if daemon is not None:
            daemon.cleanup()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="mlx-lm MoE model (default: make a small random one)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                        help="concurrent client counts, comma-separated")
    args = parser.parse_args(argv)
    counter = iter(range(1_000_000))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            model = work / "model"
            make_model(model, **MODEL)
        files = ModelFiles.open(model)
        setups = [("one serve + daemon", 1, True), ("two serves + one daemon", 2, True),
                  ("two serves, no daemon", 2, False)]
        rows = {}
        for i, (name, n, with_daemon) in enumerate(setups):
            print(f"running: {name} ...", file=sys.stderr, flush=True)
            rows[name] = run_setup(f"setup{i}", model, files, n, with_daemon, args, work, counter)
    base = rows[setups[0][0]]
    print(f"{files.n_layers} MoE layers x {files.n_experts} experts, {args.tokens} tokens per request, "
          f"{os.cpu_count()} CPUs")
    print(f"{'setup':<26}{'clients':>8}{'tok/s':>9}{'TTFT s':>9}{'memory MiB':>12}"
          f"{'tok/s x':>9}{'TTFT x':>8}{'memory x':>10}")
    for name, by_clients in rows.items():
        for clients, r in by_clients.items():
            b = base[clients]
            print(f"{name:<26}{clients:>8}{r['tps']:>9.1f}{r['ttft']:>9.3f}{r['memory'] / 2**20:>12.1f}"
                  f"{r['tps'] / b['tps']:>9.2f}{r['ttft'] / b['ttft']:>8.2f}{r['memory'] / b['memory']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
