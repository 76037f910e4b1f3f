"""`moe-l2 replay`: routing traces through the daemon's slot store and policies (moe_l2.cache.replay), with
LRU, LFU and Belady's MIN beside, and next-layer prefetch predictors scored with --prefetch; a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from moe_l2.cache.heat import AUTOPIN_SHARE
from moe_l2.cache.policy import DEFAULT_POLICY, POLICIES
from moe_l2.cache.prefetch import REPLAY_PREDICTORS
from moe_l2.cache.profile import Profile, ProfileError
from moe_l2.cache.replay import ORDERS, ReplayError, parse_slots, replay
from moe_l2.cache.replay_results import ReplayResult
from moe_l2.cache.store import HINT_MIN_LIFT, HINT_PIN_SHARE, HINT_PRIOR
from moe_l2.cache.trace import TraceError, read_traces
from moe_l2.cli.flags import add_renamed
from moe_l2.lab.synthetic import GEOMETRIES
from moe_l2.model.location import path_arg
from moe_l2.ranges import parse_ranges
from moe_l2.sizes import format_pct, format_size


def _pct(x) -> str:
    return f"{format_pct(x, sign=False):>5}"


def _moe_layers(text: str) -> list[int]:
    """An argparse type: MoE layer numbers (the trace's, 0 first) as ranges, e.g. 0-3,8."""
    try:
        return sorted({layer for first, last in parse_ranges(text) for layer in range(first, last + 1)})
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes the trace's MoE layer numbers as ranges such as 0-3,8 (0: the "
                                         f"first MoE layer), not {text!r}") from None


def render(result: ReplayResult, per_layer: bool = True) -> str:
    names = [result.policy, *result.compare]
    head = (f"{', '.join(os.path.basename(p) for p in result.traces)}: {result.model}, "
            f"{result.n_layers} layers x {result.n_experts} experts, top-{result.top_k}; "
            f"{result.sequences} sequences, {result.tokens} tokens; order {result.order}"
            + (f" (seed {result.seed})" if result.order == "interleave" else ""))
    lines = [head]
    if result.hints:
        hs = result.hint_stats
        lines.append(f"hints: {result.hints} ({hs['hints_sent']} sent, {hs['confident']} confident, "
                     f"{hs['predicted_correctly']} predicted correctly); profile {result.profile}")
    elif result.profile:
        lines.append(f"profile {result.profile} (prior strength {result.prior:g})")
    lines.append("")
    lines.append("hit rate (%) per capacity" + " " * 4 + "slots = expert slots per layer")
    width = {n: max(10, len(n) + 2) for n in names}
    cols = "".join(f"{n:>{width[n]}}" for n in names)
    lines.append(f"{'slots':>5} {'share':>6}{cols}{'gap closed':>12}{'switch ' + result.policy:>18}"
                 f"{'switch lru':>12}")
    for entry in result.capacities:
        ps = entry.policies
        gap = entry.gap_closed_vs_lru
        row = "".join(f"{_pct(ps[n].hit_rate):>{width[n]}}" for n in names)
        sw = ps[result.policy].switch_hit_rate
        swl = ps["lru"].switch_hit_rate if "lru" in ps else None
        lines.append(f"{entry.slots:>5} {100 * entry.share:5.1f}%{row}"
                     f"{'-' if gap is None else f'{100 * gap:.0f}%':>12}{_pct(sw):>18}{_pct(swl):>12}")
    lines.append("")
    lines.append(f"gap closed: share of the distance from LRU to MIN that {result.policy} covers; "
                 f"switch: hit rate over the first {result.switch_window} tokens after each of the "
                 f"{result.domain_switches} domain switches")
    lines.append("")
    lines.extend(_render_records(result, names))
    if result.warm:
        trained = result.trained_on
        lines.append(f"--warm: every policy but MIN ran over the first {trained['sequences']} sequences "
                     f"({trained['tokens']} tokens) and was restarted from its saved state, its store preloaded; "
                     "scored on the others only")
    if result.ceilings:
        trained = result.trained_on
        lines.append(f"+ceilings: the slots of all layers split by the LRU hit curves of the first "
                     f"{trained['sequences']} sequences ({trained['tokens']} tokens), every column scored on the "
                     "others only; slots per layer:")
        lines.extend(f"{slots:>5}: {' '.join(map(str, rows))}" for slots, rows in result.ceilings.items())
    if result.autopin:
        lines.append(f"+autopin: each layer's hottest experts pinned, up to {100 * AUTOPIN_SHARE:g}% of its "
                     f"slots, as L0's --l0-autopin does")
    if result.prefetch:
        lines.append("")
        lines.extend(_render_prefetch(result))
    if per_layer:
        shown = [n for n in (result.policy, "lru", "min") if n in names]
        lines.append("")
        lines.append("per layer hit rate (%): " + " / ".join(shown) + " at each capacity")
        header = "layer" + "".join(f"{'slots ' + str(e.slots):>22}" for e in result.capacities)
        lines.append(header)
        for i, layer in enumerate(result.layers):
            cells = []
            for entry in result.capacities:
                cells.append(" /".join(_pct(entry.policies[n].per_layer[i]) for n in shown))
            lines.append(f"{layer:>5}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def _render_records(result: ReplayResult, names: list[str]) -> list[str]:
    """Records loaded per token, against MIN's, and the bytes they read where the record size is known."""
    size = result.record_bytes
    lines = ["records loaded per token (all replayed layers), x MIN's" +
             (f"; disk read per token at {format_size(size)} a record" if size else "")]
    width = {n: max(14, len(n) + 2) + (10 if size else 0) for n in names}
    lines.append(f"{'slots':>5} {'share':>6}" + "".join(f"{n:>{width[n]}}" for n in names))
    for entry in result.capacities:
        cells = []
        for n in names:
            p = entry.policies[n]
            ratio = "-" if p.misses_vs_min is None else f"{p.misses_vs_min:.2f}x"
            cell = f"{p.records_per_token:.1f} {ratio:>6}"
            if size:
                cell += f" {format_size(p.bytes_per_token):>9}"
            cells.append(f"{cell:>{width[n]}}")
        lines.append(f"{entry.slots:>5} {100 * entry.share:5.1f}%" + "".join(cells))
    return lines


def _render_prefetch(result: ReplayResult) -> list[str]:
    trained = result.trained_on
    lines = [f"next-layer prefetch with {result.policy}, {result.prefetch_k} guesses per token and layer; "
             f"learned from the first {trained['sequences']} sequences ({trained['tokens']} tokens), every "
             "column above and below scored on the others only",
             f"{'predictor':>14}{'precision':>10}{'recall':>8}"]
    for name, score in result.prefetch_scores.items():
        lines.append(f"{name:>14}{_pct(score.precision):>10}{_pct(score.recall):>8}")
    lines.append("")
    lines.append(f"{'slots':>5} {'share':>6}{'predictor':>14}{'hit rate':>9}{'vs min':>8}"
                 f"{'records/token':>14}{'vs ' + result.policy:>14}{'useful':>10}{'wasted':>10}")
    for entry in result.capacities:
        ceiling = entry.policies["min"].hit_rate if "min" in entry.policies else None
        for name, p in entry.prefetch.items():
            vs_min = "-" if ceiling is None else f"{100 * (p.hit_rate - ceiling):+.1f}"
            lines.append(f"{entry.slots:>5} {100 * entry.share:5.1f}%{name:>14}{_pct(p.hit_rate):>9}"
                         f"{vs_min:>8}{p.records_per_token:>14.2f}{p.records_vs_demand:>13.2f}x"
                         f"{p.useful:>10}{p.wasted:>10}")
    lines.append("records/token: records loaded per token over all layers (demand loads plus prefetches); "
                 f"vs {result.policy}: against the demand policy's; every prefetch is taken to land in time")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, action="append", type=path_arg, metavar="FILE",
                        help="routing trace (JSON Lines, .gz or not); repeat to concatenate files of one model")
    parser.add_argument("--slots", metavar="N[,N...]",
                        help="expert slots per layer to try (default: 25%%, 37.5%% and 50%% of the experts)")
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                        help=f"policy under test (default {DEFAULT_POLICY})")
    parser.add_argument("--compare", default="adaptive,lru,lfu",
                        help="comparison policies, comma-separated (default adaptive,lru,lfu); Belady's MIN always "
                             "runs")
    parser.add_argument("--profile", type=path_arg, metavar="P.json",
                        help="profile from moe-l2 profile (for --hints, --prior)")
    parser.add_argument("--hints", action="store_true",
                        help="send each sequence's prompt as a hint before its tokens (needs --profile)")
    parser.add_argument("--oracle-hints", action="store_true",
                        help="hint each sequence's true domain instead (what a perfect predictor would do)")
    parser.add_argument("--prior", type=float, default=0.0, metavar="S",
                        help="seed the policy's scores with the profile's expert shares at strength S")
    parser.add_argument("--hint-share", type=float, default=HINT_PIN_SHARE, metavar="F",
                        help=f"domain pins take at most this share of a layer's slots (default {HINT_PIN_SHARE})")
    parser.add_argument("--hint-lift", type=float, default=HINT_MIN_LIFT, metavar="X",
                        help=f"pin only experts the domain picks X times as often as the rest (default {HINT_MIN_LIFT:g})")
    parser.add_argument("--hint-prior", type=float, default=HINT_PRIOR, metavar="S",
                        help=f"strength of the domain prior a hint adds to the policy (default {HINT_PRIOR:g}; 0: none)")
    parser.add_argument("--order", choices=ORDERS, default="interleave",
                        help="interleave: shuffle sequences with --seed; blocked: group them by domain; file: as "
                             "the trace files hold them")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed for --order interleave (default 0)")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="replay the sequences as N clients would send them: each runs one sequence after "
                             "another, and they take turns token by token (default 1)")
    # MoE layer numbers, as a trace has them; --layers means decoder layers everywhere else (moe-l2d, plan).
    add_renamed(parser, "--moe-layers", "--layers", type=_moe_layers, metavar="A-B[,C-D...]",
                help="replay only these MoE layers, numbered as in the trace from 0 (default: all)")
    parser.add_argument("--sequences", type=int, metavar="N", help="use only the first N sequences of the trace")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (layers run in parallel)")
    parser.add_argument("--prefetch", metavar="P[,P...]",
                        help="score next-layer prefetch predictors with the policy under test: "
                             f"{', '.join(REPLAY_PREDICTORS)} (the trace holds no hidden states, so the router "
                             "predictor cannot be replayed)")
    add_renamed(parser, "--train", "--prefetch-train", type=float, default=0.5, metavar="F",
                help="share of the sequences the predictors, --ceilings and --warm learn from before scoring "
                     "begins; with any, every policy is scored on the rest only (default 0.5)")
    parser.add_argument("--ceilings", action="store_true",
                        help="also run the policy under test and LRU with per-layer slots: each capacity's "
                             "slots in all layers split by the LRU hit curves of the --train share (what "
                             "moe-l2 profile learns for the client's --l0-ceilings)")
    parser.add_argument("--autopin", action="store_true",
                        help="also run the policy under test and LRU pinning each layer's hottest experts, as "
                             "the client's --l0-autopin does")
    parser.add_argument("--warm", action="store_true",
                        help="score the policies as a restarted moe-l2d has them: each first runs over the --train "
                             "share, then restarts from its saved state with its store preloaded")
    parser.add_argument("--prefetch-k", type=int, metavar="K",
                        help="guesses per token and layer (default: the trace's top-k)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _record_bytes(model: str) -> int | None:
    """One expert's record of the trace's model, where it is a geometry moe-l2 bench knows."""
    geometry = GEOMETRIES.get(model)
    return geometry.layout().nbytes if geometry is not None else None


def run(args: argparse.Namespace) -> int:
    try:
        traces = read_traces(args.trace)
        if args.sequences is not None:
            if args.sequences < 1:
                raise ReplayError("--sequences must be at least 1")
            traces.sequences = traces.sequences[:args.sequences]
        slots = parse_slots(args.slots, traces.n_experts)
        profile = Profile.load(args.profile) if args.profile else None
        compare = tuple(c.strip() for c in args.compare.split(",") if c.strip())
        hints = "oracle" if args.oracle_hints else ("prompt" if args.hints else None)
        prefetch = tuple(p.strip() for p in (args.prefetch or "").split(",") if p.strip())
        result = replay(traces, slots=slots, policy=args.policy, compare=compare, order=args.order,
                        seed=args.seed, profile=profile, hints=hints, prior=args.prior, layers=args.moe_layers,
                        jobs=max(1, args.jobs), hint_share=args.hint_share, hint_prior=args.hint_prior,
                        hint_lift=args.hint_lift, prefetch=prefetch, train=args.train,
                        prefetch_k=args.prefetch_k, ceilings=args.ceilings, autopin=args.autopin,
                        processes=args.processes, record_bytes=_record_bytes(traces.model), warm=args.warm)
    except ReplayError as exc:  # flags out of range or that do not go together
        print(f"moe-l2 replay: {exc}", file=sys.stderr)
        return 2
    except (TraceError, ProfileError) as exc:  # a trace or profile it cannot use
        print(f"moe-l2 replay: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result))
    return 0
