"""`moe-l2 stats`: what the running daemon holds and how well it serves, for the people who run it."""

from __future__ import annotations

import argparse
import json
import sys

from moe_l2 import protocol
from moe_l2.model.location import socket_arg
from moe_l2.sizes import format_pct, format_size

HELP = "hit rates, occupancy, loads and memory of the running daemon"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, type=socket_arg, help="daemon address (default: the local runtime dir)")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f} ms"


def _locking(d: dict) -> str:
    # A daemon from before locking (still running after an upgrade) does not report it.
    if "shm_locked_bytes" not in d:
        return ""
    return f" (locked {format_size(d['shm_locked_bytes'])}, unlocked {format_size(d['shm_unlocked_bytes'])})"


def _corrupt(m: dict) -> str:
    # Records that failed their checksum, never published (docs/architecture.md, "Integrity"); a daemon from
    # before checksums does not report them.
    if not m.get("corrupt_records"):
        return ""
    listed = ", ".join(f"{layer}/{expert}" for layer, expert in m["corrupt"])
    more = ", ..." if m["corrupt_records"] > len(m["corrupt"]) else ""
    return (f"  CORRUPT RECORDS {m['corrupt_records']} (layer/expert {listed}{more}; refused "
            f"{m['corrupt_loads']} loads: see the daemon log)")


def render(reply: dict) -> str:
    d = reply["daemon"]
    lines = [
        f"moe-l2d {d['version']}  pid {d['pid']}  up {d['uptime_s']:.0f} s  socket {d['socket']}",
        f"clients {d['clients']}  loads in flight {d['loads_in_flight']}  shared memory "
        f"{format_size(d['shm_bytes'])}{_locking(d)}  RSS {format_size(d['rss_bytes'])}  requests {d['requests']} "
        f"(refused {d['errors']})",
    ]
    for m in reply["models"]:
        resident = sum(layer["resident"] for layer in m["layers"])
        slots = m["slots_per_layer"] * m["n_layers"]
        lines += [
            "",
            f"model {m['path']}  ({m['n_layers']} layers x {m['n_experts']} experts, "
            f"{m['slots_per_layer']} slots per layer, policy {m['policy']})",
            f"  hit rate {format_pct(m['hit_rate'])}  hits {m['hits']}  misses {m['misses']}  "
            f"served {format_size(m['bytes_served'])}  loaded {format_size(m['bytes_loaded'])}",
            f"  loads done {m['loads_done']}  errors {m['load_errors']}{_corrupt(m)}  in flight "
            f"{m['loads_in_flight']}  latency p50 {_ms(m['load_latency_p50'])}  p99 {_ms(m['load_latency_p99'])}",
            f"  occupancy {resident}/{slots} slots ({format_size(m['shm_bytes'])})",
            "  layer  resident  loading  pinned",
        ]
        lines += [f"  {i:5d}  {layer['resident']:8d}  {layer['loading']:7d}  {layer['pinned']:6d}"
                  for i, layer in enumerate(m["layers"])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from moe_l2.client.connection import request

    try:
        reply = request(args.socket, protocol.Stats(id=1), timeout_s=args.timeout)
    except OSError as exc:  # no answer, no socket, or no permission to connect
        print(f"moe-l2 stats: {exc}", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"moe-l2 stats: the daemon refused: {reply.ename}: {reply.evalue}", file=sys.stderr)
        return 1
    print(json.dumps(reply.payload, indent=2) if args.json else render(reply.payload))
    return 0
