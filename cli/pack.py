"""`moe-l2 pack`: rewrite an mlx-lm MoE checkpoint expert-major, so that a miss is one read per expert.

The command around moe_l2.model.packer.pack (docs/formats.md, "Packed checkpoints").
"""

from __future__ import annotations

import argparse
import sys

from moe_l2.model.location import ModelNotFound, path_arg, resolve_model
from moe_l2.model.packer import PackError, pack
from moe_l2.sizes import format_size, parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="mlx-lm checkpoint directory, or Hugging Face repo id in the local cache, to pack")
    parser.add_argument("--out", required=True, type=path_arg,
                        help="output directory (new or empty; an interrupted pack into it resumes)")
    parser.add_argument("--max-shard-size", default="5GiB",
                        help="largest safetensors file to write, e.g. 5GiB (a MoE layer is never split)")
    parser.add_argument("--moe-l2-only", action="store_true",
                        help="pack even when mlx_lm.load could not load the result (its sanitize does not "
                             "stack this architecture's per-expert tensors)")
    parser.add_argument("--verify", choices=("none", "sample", "full"), default="sample",
                        help="compare records of the output with the source: a sample (default), all, or none")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        max_shard = parse_size(args.max_shard_size)
    except ValueError as e:
        print(f"moe-l2 pack: --max-shard-size: {e}", file=sys.stderr)
        return 2
    try:
        model = resolve_model(args.model)
    except ModelNotFound as e:
        print(f"moe-l2 pack: {e}", file=sys.stderr)
        return 1
    try:
        packed = pack(model, args.out, max_shard_bytes=max_shard, moe_l2_only=args.moe_l2_only,
                      verify=args.verify, progress=not args.quiet)
    except (PackError, OSError) as e:
        print(f"moe-l2 pack: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in packed.files)
    print(f"packed {model} -> {packed.path}: {packed.n_layers} MoE layers x {packed.n_experts} experts, "
          f"one {format_size(packed.layout.span)} extent per expert, {len(packed.files)} files, {format_size(size)}")
    return 0
