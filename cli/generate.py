"""`moe-l2 generate`: run an mlx-lm MoE model with streamed experts, print the text and where experts came from."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import time
from dataclasses import replace

from moe_l2.client import options
from moe_l2.cli.flags import KV_BITS, add_sampling, json_object
from moe_l2.model.location import path_arg
from moe_l2.sizes import format_pct, format_size

HELP = "generate text with an mlx-lm MoE model, its experts streamed"

# mlx_lm.generate's defaults (mlx_lm/generate.py), restated so that the parser is built without importing
# mlx-lm; tests/test_generate.py checks every flag and default against the installed mlx-lm's parser.
DEFAULT_PROMPT = "hello"
DEFAULT_QUANTIZED_KV_START = 5000

# mlx_lm.generate's flags that moe-l2 generate does not take, and why; given, they are refused with the reason
# (tests/test_generate.py checks that they are exactly the installed mlx-lm's flags that this parser lacks).
NOT_TAKEN = {
    "--adapter-path": "the experts are streamed from the checkpoint as it is; fuse the adapter into it first "
                      "(mlx_lm.fuse)",
    "--image": "moe-l2 streams text models; it builds no image processor",
    "--draft-model": "speculative decoding needs a second model, which moe-l2 does not stream",
    "--num-draft-tokens": "it goes with --draft-model, which moe-l2 generate does not take",
}


class _NotTaken(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is mlx_lm.generate's, and moe-l2 generate does not take it: "
                     f"{NOT_TAKEN[option_string]}")


def _bool_word(text: str) -> bool:
    """mlx_lm.generate's str2bool: anything but false or f (any case) is true."""
    return text.lower() not in ("false", "f")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True,
                        help="mlx-lm MoE model directory, or Hugging Face repo id (owner/name[@revision]; downloaded "
                             "when not in the local cache); required, where mlx_lm.generate defaults to a dense "
                             "model")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                        help=f"the prompt text ('-' reads it from standard input; default: {DEFAULT_PROMPT})")
    prompt.add_argument("--prompt-file", type=path_arg, help="read the prompt from a file ('-': standard input)")
    options.add_arguments(parser)
    parser.add_argument("--trace-out", type=path_arg, help="append this run's routing to a trace file (.jsonl.gz)")
    parser.add_argument("--trace-domain", default=None, help="domain label written into the trace")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text and summary")

    mlx = parser.add_argument_group("mlx_lm.generate options (same names, meanings and defaults)")
    mlx.add_argument("--trust-remote-code", action="store_true", help="trust remote code for the tokenizer")
    mlx.add_argument("--extra-eos-token", default=(), nargs="+", help="more tokens that end the generation")
    mlx.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    mlx.add_argument("--prefill-response", default=None,
                     help="the start of the response, which the chat template continues")
    mlx.add_argument("--max-tokens", "-m", type=int, default=100, help="tokens to generate, at most (default: 100)")
    add_sampling(mlx)
    mlx.add_argument("--xtc-probability", type=float, default=0.0,
                     help="probability of XTC sampling at each token (default: 0.0, off)")
    mlx.add_argument("--xtc-threshold", type=float, default=0.1,
                     help="probability above which XTC removes a candidate (default: 0.1)")
    mlx.add_argument("--min-tokens-to-keep", type=int, default=1,
                     help="tokens min-p sampling keeps at least (default: 1)")
    mlx.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: none, unseeded)")
    mlx.add_argument("--ignore-chat-template", action="store_true",
                     help="feed the prompt as is, without the tokenizer's chat template")
    mlx.add_argument("--use-default-chat-template", action="store_true",
                     help="taken for mlx_lm.generate's command lines, which take it and do nothing with it")
    mlx.add_argument("--chat-template-config", type=json_object, default=None,
                     help="JSON keyword arguments for the tokenizer's apply_chat_template, e.g. "
                          "'{\"enable_thinking\": false}'")
    mlx.add_argument("--verbose", type=_bool_word, default=True,
                     help="True (default): the text as it comes, then the summary; False (or F): the text only")
    mlx.add_argument("--max-kv-size", type=int, default=None,
                     help="keep at most this many tokens in the KV cache (a rotating cache; default: all)")
    mlx.add_argument("--prefill-step-size", type=int, default=2048,
                     help="prompt tokens processed at a time; fewer lower the prefill's peak memory (default: 2048)")
    mlx.add_argument("--prompt-cache-file", type=path_arg, default=None,
                     help="a KV cache saved by mlx_lm.cache_prompt for this --model: the prompt continues it")
    mlx.add_argument("--quantize-activations", "-qa", action="store_true",
                     help="quantize the activations of the dense layers as their weights are (nvfp4, mxfp8 models)")
    mlx.add_argument("--kv-bits", type=int, default=None, choices=KV_BITS,
                     help="quantize the KV cache to this many bits (default: no quantization)")
    mlx.add_argument("--kv-group-size", type=int, default=64, help="group size of KV cache quantization (default: 64)")
    mlx.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                     help="with --kv-bits, the token from which the KV cache is quantized "
                          f"(default: {DEFAULT_QUANTIZED_KV_START})")
    for flag in NOT_TAKEN:
        mlx.add_argument(flag, action=_NotTaken, nargs="*", help=argparse.SUPPRESS)
    return parser


def _read_prompt(args) -> str:
    """The prompt as mlx_lm.generate reads it: \\n and \\t in --prompt are a newline and a tab, '-' is standard
    input."""
    if args.prompt_file is not None:
        return sys.stdin.read() if str(args.prompt_file) == "-" else args.prompt_file.read_text(encoding="utf-8")
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if prompt == "-" else prompt


class _Stopped(Exception):
    """Ends the run before its summary: the exit status, and what to say on standard error (nothing where it was
    said already)."""

    def __init__(self, status: int, message: str = ""):
        super().__init__(message)
        self.status = status


def _saved_cache(args) -> tuple[list, dict]:
    """The KV cache in --prompt-cache-file and the tokenizer configuration it was made with, checked as
    mlx_lm.generate checks them: the same model, KV bits and group size (ValueError)."""
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

    try:
        cache, metadata = load_prompt_cache(str(args.prompt_cache_file), return_metadata=True)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # mx.load's errors, or another file's metadata
        raise _Stopped(1, f"cannot read --prompt-cache-file {args.prompt_cache_file} ({exc}); give a file "
                          "that mlx_lm.cache_prompt wrote") from None
    if metadata.get("model") != args.model:
        raise ValueError(f"--prompt-cache-file {args.prompt_cache_file} was made with the model "
                         f"{metadata.get('model')!r}, not --model {args.model}: give that model, or cache the prompt "
                         "again with this one")
    if isinstance(cache[0], QuantizedKVCache):
        for flag, mine, saved in (("--kv-bits", args.kv_bits, cache[0].bits),
                                  ("--kv-group-size", args.kv_group_size, cache[0].group_size)):
            if mine is not None and mine != saved:
                raise ValueError(f"{flag} {mine} does not match the KV cache in --prompt-cache-file ({saved})")
    return cache, json.loads(metadata.get("tokenizer_config", "{}"))


def _daemon_text(daemon: dict | None) -> str:
    if daemon is None:
        return "no daemon"
    if daemon["attached"]:
        return f"moe-l2d at {daemon['address']}"
    return f"moe-l2d not attached ({daemon['last_error'] or 'no answer'})"


def render(s: dict) -> str:
    """The text summary of a run, from its JSON object (GenerationSummary.to_json)."""
    from moe_l2.lm.generation import describe_l0

    ranks = [f"rank {r['rank']}: MoE layers {r['layers'][0]}-{r['layers'][-1]}, {r['expert_lookups']} lookups, "
             f"L3 {r['l3_reads']}, L0 {describe_l0(r['l0_slots'], r['l0_layer_slots'])}; {_daemon_text(r['daemon'])}; "
             f"peak RSS {format_size(r['peak_rss_bytes'])}" for r in s.get("ranks", [])]
    return "\n".join([
        f"prompt {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s; "
        f"decode {s['generation_tokens']} tokens, {s['generation_tps']:.1f} tok/s",
        f"experts: {s['expert_lookups']} lookups: L0 {format_pct(s['l0_hit_rate'])}, L2 {format_pct(s['l2_hit_rate'])}, "
        f"disk {format_pct(s['disk_rate'])} (read by moe-l2d while waiting {format_pct(s['daemon_read_rate'])}, by "
        f"this process {format_pct(s['l3_rate'])}); this process read {format_size(s['read_bytes'])} from disk, "
        f"copied {format_size(s['copied_bytes'])} from L2 and computed {s['l2_lent']} experts in place there",
        f"L0 {describe_l0(s['l0_slots'], s['l0_layer_slots'])} at most, {s['l0_rows']} rows held "
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

    # Under mlx.launch every rank runs this with the same flags: each runs its pipeline stage, rank 0 reads the
    # prompt and alone prints (docs/distributed.md).
    group = mx.distributed.init()
    try:
        summary = _generate(args, group)
    except _Stopped as stop:
        if str(stop):
            print(f"moe-l2 generate: {stop}", file=sys.stderr)
        return stop.status
    if group.rank() == 0:
        _print_summary(args, summary)
    return 0


def _generate(args: argparse.Namespace, group):
    """Checks the flags, builds the model and generates; the run's GenerationSummary (every rank's, merged)."""
    from moe_l2.lm.distributed import gather_json
    from moe_l2.lm.generation import GenerationSummary, StreamFigures, encode_prompt, generate_streamed
    from moe_l2.model import DamagedRecord

    pipelined = group.size() > 1
    _check_flags(args, pipelined)
    prompt_cache, tokenizer_config = None, {}
    if args.prompt_cache_file is not None:
        try:
            prompt_cache, tokenizer_config = _saved_cache(args)
        except ValueError as exc:  # a cache made for another model or KV quantization
            raise _Stopped(2, str(exc)) from None
    prompt = _shared_prompt(args, group)
    lm = _open_model(args, group, tokenizer_config)
    with lm, contextlib.ExitStack() as stack:
        # Before generating: a path it may not write is said now, not after the run (docs/security.md).
        writer = None if args.trace_out is None else stack.enter_context(_trace_writer(args, lm))
        _greet_daemon(lm, group, prompt)
        _seed(args, group)
        tokenizer = lm.tokenizer
        for token in args.extra_eos_token:
            tokenizer.add_eos_token(token)
        ids = encode_prompt(tokenizer, prompt, not args.ignore_chat_template, system_prompt=args.system_prompt,
                            prefill_response=args.prefill_response, template_args=args.chat_template_config,
                            after_cache=prompt_cache is not None)
        if not ids:
            raise _Stopped(2, "the prompt is empty" if group.rank() == 0 else "")
        show = (None if args.json or not args.verbose or group.rank() != 0
                else (lambda text: print(text, end="", flush=True)))
        try:
            result = generate_streamed(lm, ids, args.max_tokens, on_text=show, sampler=_sampler(args, tokenizer),
                                       max_kv_size=args.max_kv_size, prefill_step_size=args.prefill_step_size,
                                       kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                                       quantized_kv_start=args.quantized_kv_start, prompt_cache=prompt_cache)
        except DamagedRecord as exc:  # a record that fails its checksum, or a model file cut short while we ran
            print(f"\nmoe-l2 generate: {exc}", file=sys.stderr)
            raise _Stopped(1) from None
        s = GenerationSummary.of(result, lm)
        if pipelined:
            s = s.merged([StreamFigures.from_json(one) for one in gather_json(group, s.stream.to_json())])
        if writer is not None:
            # Every token the model processed: the prompt's, then each generated one fed back.
            _write_trace(writer, lm.recorder.take()[: len(ids) + len(result.tokens)], args, prompt)
            s = replace(s, trace_out=str(args.trace_out))
    return s


def _check_flags(args: argparse.Namespace, pipelined: bool) -> None:
    for flag, value, low in (("--max-tokens", args.max_tokens, 1), ("--max-kv-size", args.max_kv_size, 1),
                             ("--prefill-step-size", args.prefill_step_size, 1),
                             ("--min-tokens-to-keep", args.min_tokens_to_keep, 1),
                             ("--kv-group-size", args.kv_group_size, 1),
                             ("--quantized-kv-start", args.quantized_kv_start, 0)):
        if value is not None and value < low:
            raise _Stopped(2, f"{flag} must be at least {low}, got {value}")
    if pipelined and args.trace_out is not None:
        raise _Stopped(2, "--trace-out records one process' routing: run without mlx.launch to write a trace")
    if pipelined and args.prompt_cache_file is not None:
        raise _Stopped(2, "--prompt-cache-file holds every layer's KV cache: run without mlx.launch to use it")


def _shared_prompt(args: argparse.Namespace, group) -> str:
    """The prompt, read by rank 0 and sent to the others."""
    from moe_l2.lm.distributed import share_text

    prompt = None
    if group.rank() == 0:
        try:
            prompt = _read_prompt(args)
        except OSError as exc:
            print(f"moe-l2 generate: cannot read the prompt: {exc}", file=sys.stderr)
    if group.size() > 1:
        prompt = share_text(group, prompt)  # None on every rank where rank 0 could not read it
    if prompt is None:
        raise _Stopped(1)
    return prompt


def _open_model(args: argparse.Namespace, group, tokenizer_config: dict):
    from moe_l2.lm.distributed import rank_socket
    from moe_l2.lm.streamed_lm import StreamedLM

    pipelined = group.size() > 1
    try:
        return StreamedLM(args.model, options.from_args(args, socket=rank_socket(args.socket, group)),
                          model_config={"quantize_activations": args.quantize_activations},
                          tokenizer_config={**tokenizer_config, "trust_remote_code": args.trust_remote_code},
                          download=True, record=args.trace_out is not None, group=group if pipelined else None)
    except options.OptionError as exc:
        raise _Stopped(2, exc.on_command_line()) from None
    except (OSError, ValueError) as exc:  # the model, or options that do not fit it (an L0 too small for a token)
        raise _Stopped(1, str(exc)) from None


def _trace_writer(args: argparse.Namespace, lm):
    from moe_l2.cache.trace import TraceWriter

    f = lm.files
    try:
        return TraceWriter(args.trace_out, model=f.path.name, n_layers=f.n_layers, n_experts=f.n_experts,
                           top_k=f.top_k, append=True)
    except OSError as exc:
        raise _Stopped(1, f"cannot write the trace: {exc}") from None


def _write_trace(writer, routed, args: argparse.Namespace, prompt: str) -> None:
    writer.write(routed, seq=f"generate-{time.time_ns()}", domain=args.trace_domain, prompt=prompt)
    try:
        writer.close()
    except OSError as exc:
        raise _Stopped(1, f"cannot write the trace: {exc}") from None


def _greet_daemon(lm, group, prompt: str) -> None:
    """Says when this rank reads without the daemon; hints the prompt to it, from the rank that speaks for it."""
    from moe_l2.lm.distributed import speaks_for_daemon

    pipelined = group.size() > 1
    if lm.client is not None and not lm.client.attached:
        print(f"moe-l2 generate: {f'rank {group.rank()}: ' if pipelined else ''}not attached to moe-l2d at "
              f"{lm.client.address} ({lm.client.last_error or 'no answer'}); reading experts from the model "
              "files", file=sys.stderr)
    # A collective: every rank asks, whether or not it has a daemon link.
    speaks = not pipelined or speaks_for_daemon(group, lm.client.address if lm.client is not None else None)
    if lm.client is not None and speaks:
        lm.client.hint(prompt)  # the daemon preloads the prompt's domain while we prefill


def _seed(args: argparse.Namespace, group) -> None:
    import mlx.core as mx

    from moe_l2.lm.distributed import gather_json

    seed = args.seed
    if group.size() > 1 and seed is None:  # every rank samples each token (docs/distributed.md): one seed for all
        seed = gather_json(group, secrets.randbits(31) if group.rank() == 0 else None)[0]
    if seed is not None:
        # Once the model is built, so that sampling draws as the whole model's does when seeded once loaded.
        # mlx_lm.generate seeds before building its model, whose initial weights draw from the same
        # generator, and moe-l2's build draws a different number of them.
        mx.random.seed(seed)


def _sampler(args: argparse.Namespace, tokenizer):
    """mlx_lm.generate's sampler, from the same flags."""
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
                        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))


def _print_summary(args: argparse.Namespace, s) -> None:
    if args.json:
        print(json.dumps(s.to_json()))
    elif not args.verbose:
        print(s.text)  # as mlx_lm.generate --verbose False prints it
    else:
        print("\n")
        print(render(s.to_json()))
