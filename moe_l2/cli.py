"""moe-l2: the command line for people who run moe-l2d and the models it serves.

Each subcommand lives in the module of its noun (generate.py, demo.py, pack.py, generator.py, ...), which
exposes add_arguments(parser) and run(args); this file only assembles them and holds stats and verify.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from moe_l2 import demo, generate, generator, predictor, protocol, replay
from moe_l2 import pack as pack_cmd
from moe_l2 import profile as profile_cmd
from moe_l2.runtime import default_socket
from moe_l2.sizes import format_size


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f} ms"


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def render_stats(reply: dict) -> str:
    d = reply["daemon"]
    lines = [
        f"moe-l2d {d['version']}  pid {d['pid']}  up {d['uptime_s']:.0f} s  socket {d['socket']}",
        f"clients {d['clients']}  loads in flight {d['loads_in_flight']}  shared memory "
        f"{format_size(d['shm_bytes'])}  RSS {format_size(d['rss_bytes'])}  requests {d['requests']} "
        f"(refused {d['errors']})",
    ]
    for m in reply["models"]:
        resident = sum(layer["resident"] for layer in m["layers"])
        slots = m["slots_per_layer"] * m["n_layers"]
        lines += [
            "",
            f"model {m['path']}  ({m['n_layers']} layers x {m['n_experts']} experts, "
            f"{m['slots_per_layer']} slots per layer, policy {m['policy']})",
            f"  hit rate {_pct(m['hit_rate'])}  hits {m['hits']}  misses {m['misses']}  "
            f"served {format_size(m['bytes_served'])}  loaded {format_size(m['bytes_loaded'])}",
            f"  loads done {m['loads_done']}  errors {m['load_errors']}  in flight {m['loads_in_flight']}  "
            f"latency p50 {_ms(m['load_latency_p50'])}  p99 {_ms(m['load_latency_p99'])}",
            f"  occupancy {resident}/{slots} slots ({format_size(m['shm_bytes'])})",
            "  layer  resident  loading  pinned",
        ]
        lines += [f"  {i:5d}  {layer['resident']:8d}  {layer['loading']:7d}  {layer['pinned']:6d}"
                  for i, layer in enumerate(m["layers"])]
    return "\n".join(lines)


def cmd_stats(args) -> int:
    from moe_l2.client.connection import request

    try:
        reply = request(args.socket, protocol.Stats(id=1), timeout_s=args.timeout)
    except OSError as exc:  # no answer, no socket, or no permission to connect
        print(f"moe-l2 stats: {exc}", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"moe-l2 stats: the daemon refused: {reply.ename}: {reply.evalue}", file=sys.stderr)
        return 1
    print(json.dumps(reply.payload, indent=2) if args.json else render_stats(reply.payload))
    return 0


def cmd_verify(args) -> int:
    from moe_l2.client.connection import L2Client
    from moe_l2.client.pool import ExpertPool
    from moe_l2.model import DIRECT_IO, ModelFiles

    try:
        files = ModelFiles.open(args.model)
    except (OSError, ValueError) as exc:
        print(f"moe-l2 verify: {exc}", file=sys.stderr)
        return 2
    client = None if args.no_daemon else L2Client(files, args.socket, wait_s=2.0)
    if client is not None and not client.attached:
        print(f"moe-l2 verify: not attached to moe-l2d ({client.last_error or 'no answer'}); "
              "checking the pread path only", file=sys.stderr)
    rng = random.Random(args.seed)
    pool = ExpertPool(files, capacity=1, client=client, direct=DIRECT_IO[args.direct_io])
    mismatches = 0
    tiers = {"L2": 0, "L3": 0}
    try:
        for _ in range(args.samples):
            layer, expert = rng.randrange(files.n_layers), rng.randrange(files.n_experts)
            counts = pool.fetch(layer, [expert])
            tier = "L2" if counts.l2_hits else "L3"
            tiers[tier] += 1
            if pool.layers[layer].record(expert) != files.read_record(layer, expert):
                mismatches += 1
                print(f"MISMATCH layer {layer} expert {expert} (from {tier})")
            # Evicted at once, so that every sample goes through L2 or L3, never L0.
            pool.evict(layer, expert)
    finally:
        pool.close()
        if client is not None:
            client.close()
    print(f"checked {args.samples} experts of {files.path} ({files.format}): {tiers['L2']} from L2 (shared memory), "
          f"{tiers['L3']} from L3 (model file); {mismatches} mismatches")
    return 1 if mismatches else 0


# Subcommands whose module has add_arguments(parser) and run(args), in the order --help lists them.
COMMANDS = [
    ("demo", demo, "the built-in demo: a small model, a daemon, a cold and a warm run"),
    ("generate", generate, "generate text with an mlx-lm MoE model, its experts streamed"),
    ("pack", pack_cmd, "rewrite a checkpoint expert-major: one read per expert"),
    ("replay", replay, "run routing traces through the daemon's store: hit rates vs LRU, LFU and Belady's MIN"),
    ("profile", profile_cmd, "build a domain profile from traces or the daemon's statistics"),
    ("predict", predictor, "name a prompt's domain with a profile's predictor"),
]


def _add_commands(sub, commands) -> None:
    for name, module, help_text in commands:
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-l2", description="Stats, verification and tools for moe-l2.")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_commands(sub, COMMANDS)

    p = sub.add_parser("stats", help="hit rates, occupancy, loads and memory of the running daemon")
    p.add_argument("--socket", default=None, help="daemon address (default: the local runtime dir)")
    p.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("verify", help="fetch random experts through the client path and compare with the file")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--socket", default=None)
    p.add_argument("--no-daemon", action="store_true", help="check the pread path only")
    p.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto",
                   help="read the model files with O_DIRECT / F_NOCACHE (auto: for packed models)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("make-model", help="write a random-weight mlx-lm MoE checkpoint")
    generator.configure_parser(p)
    p.set_defaults(func=lambda args, parser=p: generator.run(args, parser))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "socket", "unset") is None:
        args.socket = default_socket()
    if getattr(args, "samples", 1) < 1:
        print("moe-l2 verify: --samples must be at least 1", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
