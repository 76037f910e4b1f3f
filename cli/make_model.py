"""`moe-l2 make-model`: write a random-weight mlx-lm MoE checkpoint (moe_l2.lab.random_models) for tests and benchmarks."""

from __future__ import annotations

import argparse
import sys

from moe_l2.cli.flags import add_renamed
from moe_l2.lab.random_models import _DEFAULT_VOCAB, ARCHS, make_model
from moe_l2.model.location import path_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS), help="mlx-lm architecture")
    # A count, where --layers elsewhere names decoder layers (moe-l2d, plan).
    add_renamed(parser, "--num-layers", "--layers", type=int, required=True,
                help="decoder layers, how many (the config's num_hidden_layers)")
    parser.add_argument("--experts", type=int, required=True, help="routed experts per MoE layer")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token")
    parser.add_argument("--hidden-size", type=int, required=True, help="model width (multiple of 32)")
    parser.add_argument("--moe-hidden-size", type=int, required=True, help="width of one expert")
    parser.add_argument("--bits", type=int, required=True, choices=(4, 8, 16),
                        help="4/8: affine quantized, 16: float16")
    parser.add_argument("--out", required=True, type=path_arg, help="output directory (created; must be empty)")
    parser.add_argument("--per-expert", action="store_true", help="one tensor per expert instead of stacked")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"tokenizer and model vocabulary (default {_DEFAULT_VOCAB})")


def run(args: argparse.Namespace) -> int:
    try:
        make_model(args.out, args.arch, args.num_layers, args.experts, args.top_k, args.hidden_size,
                   args.moe_hidden_size, args.bits, per_expert=args.per_expert, shards=args.shards, seed=args.seed,
                   vocab_size=args.vocab_size, progress=lambda msg: print(msg, file=sys.stderr))
    except ValueError as exc:
        print(f"moe-l2 make-model: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # no room, or --out filled or taken by someone else meanwhile
        print(f"moe-l2 make-model: error: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    return 0
