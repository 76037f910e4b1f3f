"""`moe-l2 generate`: run an mlx-lm MoE model with streamed experts, print the text and where experts came from."""

from __future__ import annotations

import argparse
import json
import sys
import time

from moe_l2.client import options
from moe_l2.model.location import path_arg
from moe_l2.sizes import format_pct, format_size

HELP = "generate text with an mlx-lm MoE model, its experts streamed"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True,
                        help="mlx-lm model directory, or Hugging Face repo id (owner/name[@revision]; downloaded "
                             "when not in the local cache)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", type=path_arg, help="read the prompt from a file ('-': standard input)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    options.add_arguments(parser)
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="feed the prompt as is, without the tokenizer's chat template")
    parser.add_argument("--trace-out", type=path_arg, help="append this run's routing to a trace file (.jsonl.gz)")
    parser.add_argument("--trace-domain", default=None, help="domain label written into the trace")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text and summary")
    return parser


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if str(args.prompt_file) == "-":
        return sys.stdin.read()
    return args.prompt_file.read_text(encoding="utf-8")


def summary(result: dict, lm) -> dict:
    """The run's numbers as one JSON-able dict."""
    from moe_l2.client.mlx_lm import hit_rates, peak_rss_bytes
    import mlx.core as mx

    c = result["counts"]
    rates = hit_rates(c)
    tiers = c.by_source()
    client = lm.client
    return {
        "model": str(lm.files.path),
        "text": result["text"],
        "tokens": result["tokens"],
        "finish_reason": result["finish_reason"],
        "prompt_tokens": result["prompt_tokens"],
        "prompt_tps": result["prompt_tps"],
        "generation_tokens": result["generation_tokens"],
        "generation_tps": result["generation_tps"],
        # Each lookup once, by where its bytes came from (TierCounts.by_source).
        "expert_lookups": rates["lookups"],
        "l0_hits": tiers["l0"],
        "l2_hits": tiers["l2"],
        "daemon_reads": tiers["daemon_disk"],
        "l3_reads": tiers["own_disk"],
        "l2_lent": c.l2_lent,
        "l0_hit_rate": rates["l0"],
        "l2_hit_rate": rates["l2"],
        "daemon_read_rate": rates["daemon_disk"],
        "l3_rate": rates["own_disk"],
        "disk_rate": rates["disk"],
        "bytes_read": c.bytes_read,
        "bytes_copied": c.bytes_copied,
        "l0_slots": lm.pool.capacity,  # the ceiling, per layer or in all
        "l0_rows": lm.pool.rows,  # held now, in all layers (fewer than the ceiling while L0 grows on demand)
        "l0_bytes": lm.pool.nbytes,  # what l0_rows hold
        "l0_ceiling_bytes": lm.pool.ceiling_bytes,
        "l0_shared": lm.pool.shared_l0,  # l0_slots counts rows in all, not per layer
        "layers": sorted(lm.pool.layers),  # the MoE layers this process ran
        "daemon": None if client is None else {"address": client.address, "attached": client.attached,
                                               "attaches": client.attaches, "last_error": client.last_error},
        "streaming": result["stats"],  # StreamStats over this run: calls, sync/fetch/copy/pread seconds
        "prefetch": None if lm.next_layer is None else {"predictor": lm.next_layer.describe(),
                                                        **result["prefetch"].as_dict()},
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_mlx_bytes": mx.get_peak_memory(),
    }


# What each rank reports of its own streaming; the rest of the summary is the same on every rank.
_PER_RANK = ("expert_lookups", "l0_hits", "l2_hits", "daemon_reads", "l3_reads", "l2_lent", "bytes_read", "bytes_copied",
             "l0_slots", "l0_rows", "l0_bytes", "l0_ceiling_bytes", "layers", "daemon", "streaming", "prefetch",
             "peak_rss_bytes", "peak_mlx_bytes")
_SUMMED = ("expert_lookups", "l0_hits", "l2_hits", "daemon_reads", "l3_reads", "l2_lent", "bytes_read", "bytes_copied",
           "l0_rows", "l0_bytes", "l0_ceiling_bytes")


def merge_ranks(summaries: list[dict]) -> dict:
    """One summary for a pipelined run: rank 0's, with the expert counts summed over the ranks, the peaks the
    largest rank's, and each rank's own figures under "ranks" (docs/distributed.md)."""
    s = dict(summaries[0])
    s["ranks"] = [{"rank": r, **{k: one[k] for k in _PER_RANK}} for r, one in enumerate(summaries)]
    for key in _SUMMED:
        s[key] = sum(one[key] for one in summaries)
    for key in ("peak_rss_bytes", "peak_mlx_bytes"):
        s[key] = max(one[key] for one in summaries)
    s["layers"] = sorted(layer for one in summaries for layer in one["layers"])
    lookups = s["expert_lookups"]
    for tier, count in (("l0_hit_rate", ("l0_hits",)), ("l2_hit_rate", ("l2_hits",)),
                        ("daemon_read_rate", ("daemon_reads",)), ("l3_rate", ("l3_reads",)),
                        ("disk_rate", ("daemon_reads", "l3_reads"))):
        s[tier] = sum(s[c] for c in count) / lookups if lookups else None
    return s


def _daemon_text(daemon: dict | None) -> str:
    if daemon is None:
        return "no daemon"
    if daemon["attached"]:
        return f"moe-l2d at {daemon['address']}"
    return f"moe-l2d not attached ({daemon['last_error'] or 'no answer'})"


def render(s: dict) -> str:
    ranks = [f"rank {r['rank']}: MoE layers {r['layers'][0]}-{r['layers'][-1]}, {r['expert_lookups']} lookups, "
             f"L3 {r['l3_reads']}, L0 {r['l0_slots']} experts per layer; {_daemon_text(r['daemon'])}; "
             f"peak RSS {format_size(r['peak_rss_bytes'])}" for r in s.get("ranks", [])]
    return "\n".join([
        f"prompt {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s; "
        f"decode {s['generation_tokens']} tokens, {s['generation_tps']:.1f} tok/s",
        f"experts: {s['expert_lookups']} lookups: L0 {format_pct(s['l0_hit_rate'])}, L2 {format_pct(s['l2_hit_rate'])}, "
        f"disk {format_pct(s['disk_rate'])} (read by moe-l2d while waiting {format_pct(s['daemon_read_rate'])}, by "
        f"this process {format_pct(s['l3_rate'])}); this process read {format_size(s['bytes_read'])} from disk, "
        f"copied {format_size(s['bytes_copied'])} from L2 and computed {s['l2_lent']} experts in place there",
        f"L0 {s['l0_slots']} experts {'in all' if s['l0_shared'] else 'per layer'} at most, {s['l0_rows']} rows held "
        f"({format_size(s['l0_bytes'])} of {format_size(s['l0_ceiling_bytes'])}); "
        f"{_daemon_text(s['daemon'])}",
        *([] if s["prefetch"] is None else [_render_prefetch(s["prefetch"])]),
        f"peak memory: RSS {format_size(s['peak_rss_bytes'])}, MLX {format_size(s['peak_mlx_bytes'])}",
        *ranks,
    ])


def _render_prefetch(p: dict) -> str:
    return (f"prefetch by {p['predictor']}: guesses {format_pct(p['precision'])} precise, "
            f"{format_pct(p['recall'])} recall; {p['issued']} experts loaded ahead, {p['useful']} used, "
            f"{p['wasted']} evicted unused; stall hidden ~{1000 * p['hidden_s']:.1f} ms, "
            f"waited {1000 * p['wait_s']:.1f} ms")


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from moe_l2.client.distributed import gather_json, rank_socket, share_text, speaks_for_daemon
    from moe_l2.client.generation import encode_prompt, generate_streamed
    from moe_l2.client.mlx_lm import StreamedLM
    from moe_l2.model import CorruptRecord
    from moe_l2.cache.trace import TraceWriter

    # Under mlx.launch every rank runs this with the same flags: each runs its pipeline stage, rank 0 reads the
    # prompt and alone prints (docs/distributed.md).
    group = mx.distributed.init()
    pipelined = group.size() > 1
    rank0 = group.rank() == 0
    if args.max_tokens < 1:
        print("moe-l2 generate: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    if pipelined and args.trace_out is not None:
        print("moe-l2 generate: --trace-out records one process' routing: run without mlx.launch to write a trace",
              file=sys.stderr)
        return 2
    prompt = None
    if rank0:
        try:
            prompt = _read_prompt(args)
        except OSError as exc:
            print(f"moe-l2 generate: cannot read the prompt: {exc}", file=sys.stderr)
    if pipelined:
        prompt = share_text(group, prompt)
    if prompt is None:
        return 1
    try:
        lm = StreamedLM(args.model, options.from_args(args, socket=rank_socket(args.socket, group)),
                        download=True, record=args.trace_out is not None, group=group if pipelined else None)
    except options.OptionError as exc:
        print(f"moe-l2 generate: {exc.on_command_line()}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # the model, or options that do not fit it (an L0 too small for a token)
        print(f"moe-l2 generate: {exc}", file=sys.stderr)
        return 1
    with lm:
        if lm.client is not None and not lm.client.attached:
            print(f"moe-l2 generate: {f'rank {group.rank()}: ' if pipelined else ''}not attached to moe-l2d at "
                  f"{lm.client.address} ({lm.client.last_error or 'no answer'}); reading experts from the model "
                  "files", file=sys.stderr)
        # A collective: every rank asks, whether or not it has a daemon link.
        speaks = not pipelined or speaks_for_daemon(group, lm.client.address if lm.client is not None else None)
        if lm.client is not None and speaks:
            lm.client.hint(prompt)  # the daemon preloads the prompt's domain while we prefill
        mx.random.seed(args.seed)
        ids = encode_prompt(lm.tokenizer, prompt, not args.ignore_chat_template)
        if not ids:
            if rank0:
                print("moe-l2 generate: the prompt is empty", file=sys.stderr)
            return 2
        show = None if args.json or not rank0 else (lambda text: print(text, end="", flush=True))
        try:
            result = generate_streamed(lm, ids, args.max_tokens, temp=args.temp, on_text=show)
        except CorruptRecord as exc:
            print(f"\nmoe-l2 generate: {exc}", file=sys.stderr)
            return 1
        s = summary(result, lm)
        if pipelined:
            s = merge_ranks(gather_json(group, s))
        if args.trace_out is not None:
            # Every token the model processed: the prompt's, then each generated one fed back.
            routed = lm.recorder.take()[: len(ids) + len(result["tokens"])]
            f = lm.files
            with TraceWriter(args.trace_out, model=f.path.name, n_layers=f.n_layers, n_experts=f.n_experts,
                             top_k=f.top_k, append=True) as writer:
                writer.write(routed, seq=f"generate-{time.time_ns()}", domain=args.trace_domain, prompt=prompt)
            s["trace_out"] = str(args.trace_out)
    if not rank0:
        return 0
    if args.json:
        print(json.dumps(s))
    else:
        print("\n")
        print(render(s))
    return 0
