"""`moe-l2 plan`: how this machine's memory would be split for a model (moe_l2.plan), and with a routing trace
the hit rate each tier could expect at that split (moe_l2.cache.replay)."""

from __future__ import annotations

import argparse
import json
import sys

from moe_l2.cache.policy import DEFAULT_POLICY
from moe_l2.cache.replay import ReplayError, replay
from moe_l2.cache.trace import TraceError, read_traces
from moe_l2.client import options
from moe_l2.client.options import DEFAULTS
from moe_l2.layout import record_stride, slot_range
from moe_l2.model import ModelFiles
from moe_l2.ranges import parse_ranges
from moe_l2.model.location import path_arg, resolve_model
from moe_l2.plan import DEFAULT_KV_BYTES, ModelSizes, Plan, PlanError, plan, read_memory
from moe_l2.sizes import format_pct, format_size, parse_size, size_arg

L0_POLICY = DEFAULTS.policy  # the client pool's (client/options.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR|ID",
                        help="the model to plan for: a directory or a Hugging Face repo id in the local cache")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="inference processes expected on this machine (default 1)")
    parser.add_argument("--kv", default=None, metavar="SIZE",
                        help=f"KV cache and activations per process (default {format_size(DEFAULT_KV_BYTES)})")
    parser.add_argument("--trace", action="append", metavar="FILE", type=path_arg,
                        help="routing trace of this model (moe-l2 generate --trace-out); repeat to add files: "
                             "prints the expected hit rate of each tier at the planned sizes")
    parser.add_argument("--layers", default=None, metavar="A-B[,C-D...]",
                        help="plan L2 for a daemon that serves only these decoder layers (moe-l2d --layers): the "
                             "same memory buys more slots per layer; a trace is replayed over those layers")
    options.add_arguments(parser, ["l0_ceilings"])
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def tier_hit_rates(traces, p: Plan, layers: list[int] | None = None, l0_rows: list[int] | None = None) -> dict:
    """Replay the trace (over `layers`, None: all) at L0's capacity with the pool's policy, or at `l0_rows` (one
    ceiling per replayed layer: --l0-ceilings), and at L2's with the daemon's. The tiers are inclusive (L2 is at
    least as large as L0 and sees the same experts), so what L0 misses and L2 holds is L2's share and the rest is
    read from disk; every process is assumed to route like the trace. A shared L0 is counted no hits: its rows
    hold the misses of the layers being computed, which L2 holds afterwards."""
    l2 = [p.l2_slots, p.l2_slots - 1] if p.l2_short else [p.l2_slots] if p.l2_slots else []
    # A shared L0 is not replayed; with no L2 either, the replay only counts the tokens.
    l0_slots = () if p.l0_shared else (p.l0_slots,)
    result = replay(traces, slots=sorted({*l0_slots, *l2}) or [p.l0_slots], policy=DEFAULT_POLICY,
                    compare=() if p.l0_shared else (L0_POLICY,), belady=False, layers=layers, layer_rows=l0_rows)
    rate = {(c.slots, name): r.hit_rate or 0.0 for c in result.capacities for name, r in c.policies.items()}
    l0 = 0.0 if p.l0_shared else rate[(p.l0_slots, L0_POLICY if l0_rows is None else f"{L0_POLICY}+ceilings")]
    l2_alone = 0.0
    if p.l2_slots:
        # The last l2_short served layers hold a slot fewer: weigh the two capacities by their layers.
        short = p.l2_short / (len(layers) if layers is not None else traces.n_layers)
        l2_alone = (1 - short) * rate[(p.l2_slots, DEFAULT_POLICY)]
        if p.l2_short:
            l2_alone += short * rate[(p.l2_slots - 1, DEFAULT_POLICY)]
    return {"tokens": result.tokens, "l0": l0, "l2": max(0.0, l2_alone - l0), "l3": 1.0 - max(l0, l2_alone)}


def render(files: ModelFiles, sizes: ModelSizes, p: Plan, rates: dict | None, layers: str | None = None,
           ceilings: list[int] | None = None) -> str:
    lines = [
        f"plan for {files.path}: {sizes.n_layers} layers x {sizes.n_experts} experts, top-{sizes.top_k}; experts "
        f"{format_size(sizes.expert_bytes)}, other weights {format_size(sizes.non_expert_bytes)}",
        f"memory {format_size(p.total)}, available {format_size(p.available)}",
        f"  OS and other programs   {format_size(p.os_headroom)}",
        f"  each of {p.processes} process(es): weights {format_size(p.non_expert_per_process)}, KV "
        f"{format_size(p.kv_per_process)}, {p.l0_text}",
    ]
    if ceilings is not None:
        lines.append(f"    L0 ceilings per MoE layer (--l0-ceilings): {' '.join(map(str, ceilings))}")
    if p.l2_slots:
        served = "" if layers is None else f" of the {sizes.l2_layers} MoE layers in decoder layers {layers}"
        budget = size_arg(p.l2_budget, record_stride(sizes.record_bytes))
        lines.append(f"  L2, one shared copy     {format_size(p.l2_budget)}: {slot_range(p.l2_slots, p.l2_short)} "
                     f"of {p.n_experts} experts per layer{served} (moe-l2d --budget {budget}"
                     + ("" if layers is None else f" --layers {layers}") + ")")
    else:
        lines.append("  L2                      nothing left: lower --processes or --kv, or free memory")
    if rates is not None:
        lines.append(f"expected hit rate over {rates['tokens']} tokens: L0 {format_pct(rates['l0'])}, "
                     f"L2 {format_pct(rates['l2'])}, disk {format_pct(rates['l3'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        files = ModelFiles.open(resolve_model(args.model))
        served = None if args.layers is None else list(files.moe_layers_in(parse_ranges(args.layers)))
        sizes = ModelSizes.of(files, None if served is None else len(served))
        kv = DEFAULT_KV_BYTES if args.kv is None else parse_size(args.kv)
        p = plan(read_memory(), sizes, args.processes, kv_bytes=kv, shared_l0=args.l0_ceilings is None)
        ceilings = None
        if args.l0_ceilings is not None:
            layers = list(range(files.n_layers))
            chosen = options.from_args(args, shared_l0=False).l0_capacity(files, layers, p.l0_slots)
            ceilings = [chosen[layer] for layer in layers]
        rates = None
        if args.trace:
            traces = read_traces(args.trace)
            if (traces.n_layers, traces.n_experts) != (sizes.n_layers, sizes.n_experts):
                raise PlanError(f"the trace is of a model with {traces.n_layers} layers x {traces.n_experts} "
                                f"experts, {args.model} has {sizes.n_layers} x {sizes.n_experts}: give a trace "
                                "of this model")
            replayed = range(files.n_layers) if served is None else served
            l0_rows = None if ceilings is None else [ceilings[layer] for layer in replayed]
            rates = tier_hit_rates(traces, p, served, l0_rows)
    except options.OptionError as exc:
        print(f"moe-l2 plan: {exc.on_command_line()}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TraceError, ReplayError) as exc:
        print(f"moe-l2 plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"plan": p.to_dict(), "hit_rates": rates, "l0_ceilings": ceilings}, indent=1))
    else:
        print(render(files, sizes, p, rates, args.layers, ceilings))
    return 0
