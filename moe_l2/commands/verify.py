"""`moe-l2 verify`: fetch random experts through the client path (L2, else the file) and compare every byte
with the model file."""

from __future__ import annotations

import argparse
import random
import sys

from moe_l2.model.location import resolve_model, socket_arg

HELP = "fetch random experts through the client path and compare with the file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model directory, or Hugging Face repo id in the local cache")
    parser.add_argument("--socket", default=None, type=socket_arg, help="daemon address (default: the local runtime dir)")
    parser.add_argument("--no-daemon", action="store_true", help="check the pread path only")
    parser.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto",
                        help="read the model files with O_DIRECT / F_NOCACHE (auto: for packed models)")
    parser.add_argument("--samples", type=int, default=64, help="experts to check (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the experts picked")


def run(args: argparse.Namespace) -> int:
    from moe_l2.client.connection import L2Client
    from moe_l2.client.pool import ExpertPool
    from moe_l2.model import DIRECT_IO, ModelFiles

    if args.samples < 1:
        print("moe-l2 verify: --samples must be at least 1", file=sys.stderr)
        return 2
    try:
        files = ModelFiles.open(resolve_model(args.model))
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
