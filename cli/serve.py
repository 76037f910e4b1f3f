"""`moe-l2 serve`: mlx_lm.server's OpenAI-compatible HTTP API over a model whose experts are streamed.

The options after the model, L0, daemon and request-limit ones are mlx_lm.server's own, with its names and
defaults (it builds its parser inside main(), so they are restated here); they land in the namespace
mlx_lm.server's ModelProvider and handler read (docs/decisions.md, "Restated mlx-lm flags").
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from moe_l2.client import options
from moe_l2.cli.flags import KV_BITS, add_sampling, json_object
from moe_l2.model.location import resolve_model
from moe_l2.tiers import describe_sources

# mlx_lm.server options this command has no use for, with the values its code expects.
# Under mlx.launch the model is split in pipeline stages (docs/distributed.md), never tensor-parallel.
_FIXED = {"adapter_path": None, "draft_model": None, "num_draft_tokens": 3, "trust_remote_code": False,
          "pipeline": True}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True,
                        help="mlx-lm model directory, or a Hugging Face repo id (downloaded when not cached)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    options.add_arguments(parser)

    limits = parser.add_argument_group("request limits (docs/security.md, \"moe-l2 serve's HTTP API\")")
    limits.add_argument("--max-tokens-limit", type=int, default=32768,
                        help="the most tokens a request may ask to generate (max_tokens); the model's context "
                             "bounds it too (default: 32768)")
    limits.add_argument("--max-body-bytes", default="16MiB",
                        help="the largest request body taken, e.g. 64MiB; a larger one is refused (413) before it "
                             "is read (default: 16MiB)")

    mlx = parser.add_argument_group("mlx_lm.server options (same names and defaults)")
    mlx.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                     help="comma-separated origins allowed by CORS (default: *)")
    mlx.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                     help="logging level (default: INFO)")
    mlx.add_argument("--chat-template", default="", help="a chat template to use instead of the tokenizer's")
    mlx.add_argument("--use-default-chat-template", action="store_true",
                     help="use the tokenizer's default chat template when the model has none, as mlx_lm.server does "
                          "(transformers 4.43 and later have none: a warning, and chats go without a template)")
    mlx.add_argument("--chat-template-args", type=json_object, default={},
                     help="JSON arguments for the tokenizer's apply_chat_template, e.g. '{\"enable_thinking\":false}'")
    add_sampling(mlx, "default ")
    mlx.add_argument("--max-tokens", type=int, default=512,
                     help="default maximum number of tokens to generate (default: 512)")
    mlx.add_argument("--decode-concurrency", type=int, default=32,
                     help="requests decoded together in one batch (default: 32)")
    mlx.add_argument("--prompt-concurrency", type=int, default=8,
                     help="prompts processed together in one batch (default: 8)")
    mlx.add_argument("--prefill-step-size", type=int, default=2048,
                     help="prompt tokens per prefill step (default: 2048)")
    mlx.add_argument("--prompt-cache-size", type=int, default=10,
                     help="most distinct KV caches kept in the prompt cache (default: 10)")
    mlx.add_argument("--prompt-cache-bytes", help="most bytes of KV caches kept in the prompt cache, e.g. 4GiB")
    mlx.add_argument("--kv-bits", type=int, default=None,
                     help="quantize the KV cache to this many bits (4 or 8); serves requests one at a time")
    mlx.add_argument("--kv-group-size", type=int, default=64, help="group size of KV cache quantization (default: 64)")
    mlx.add_argument("--quantized-kv-start", type=int, default=None,
                     help="token position from which the KV cache is quantized (default: mlx-lm's)")
    return parser


def local_model_dir(spec: str) -> Path:
    """The model directory `--model` names: a directory, or a Hugging Face repo id from the local cache,
    downloaded first as mlx-lm does when it is not there (moe_l2.model.location)."""
    path = resolve_model(spec, download=True)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {spec}: {path} has no config.json; is it an mlx-lm model directory?")
    return path


def _check(args: argparse.Namespace) -> None:
    for name in ("port", "max_tokens", "max_tokens_limit", "decode_concurrency", "prompt_concurrency",
                 "prefill_step_size", "prompt_cache_size", "kv_group_size"):
        value = getattr(args, name)
        low = 0 if name == "port" else 1
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if args.max_tokens > args.max_tokens_limit:
        raise ValueError(f"--max-tokens {args.max_tokens} is above --max-tokens-limit {args.max_tokens_limit}: "
                         "lower it, or raise the limit")
    if args.kv_bits is not None and args.kv_bits not in KV_BITS:
        raise ValueError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {args.kv_bits}")


def mlx_lm_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace mlx_lm.server's code reads, from ours."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
    from moe_l2.sizes import parse_size

    ns = argparse.Namespace(**vars(args), **_FIXED)
    ns.prompt_cache_bytes = None if args.prompt_cache_bytes is None else parse_size(args.prompt_cache_bytes)
    try:
        ns.max_body_bytes = parse_size(args.max_body_bytes)
    except ValueError as exc:
        raise ValueError(f"--max-body-bytes: {exc}") from None
    if args.quantized_kv_start is None:
        ns.quantized_kv_start = DEFAULT_QUANTIZED_KV_START
    return ns


def _announce(host: str, port: int):
    def ready(provider) -> None:
        from moe_l2.lm.generation import describe_l0

        lm = provider.lm
        client = lm.client
        if client is None:
            daemon = "no daemon: experts from the model files"
        elif client.attached:
            daemon = f"moe-l2d at {client.address}"
        else:
            daemon = (f"moe-l2d not attached at {client.address} ({client.last_error or 'no answer'}): experts "
                      "from the model files until it answers")
        layers = sorted(lm.pool.layers)
        where = (f"on http://{host}:{port}/v1" if provider.rank == 0 else "rank 0's requests")
        stage = (f"rank {provider.rank}, MoE layers {layers[0]}-{layers[-1]}; "
                 if len(layers) < lm.files.n_layers else "")
        l0 = describe_l0(lm.pool.capacity, None if lm.pool.shared_l0 else list(lm.pool.capacities.values()))
        print(f"moe-l2 serve: {provider.model_id} {where} ({stage}L0 {l0}; "
              f"{daemon})", file=sys.stderr, flush=True)
    return ready


def _farewell(provider) -> None:
    """The log's last line: where the experts of every request came from (src/moe_l2/tiers.py)."""
    print(f"moe-l2 serve: expert lookups since start: "
          f"{describe_sources(provider.lm.pool.counts.by_source(), 'this process')}", file=sys.stderr, flush=True)


def check_listen(host: str, port: int) -> None:
    """Bind --host and --port as the server will (mlx_lm.server's getaddrinfo; SO_REUSEADDR, as HTTPServer),
    then let go: a port that is taken is said at once, not after the model's load, which can take minutes."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)


def listen_error(host: str, port: int, exc: OSError) -> str:
    """What to do when the server cannot listen on --host and --port."""
    if exc.errno == errno.EADDRINUSE:
        return (f"--port {port} is in use on {host} (another server listens there): choose another --port, or "
                "stop that server")
    if exc.errno == errno.EACCES:
        return f"--port {port} on {host} needs privileges this user has not: choose a --port of 1024 or more"
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return (f"--host {host} is no address of this machine ({exc.strerror}): give one of its addresses, e.g. "
                "127.0.0.1, or 0.0.0.0 for all")
    return f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --host or --port"


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from moe_l2.lm.distributed import rank_socket
    from moe_l2.serve.server import StreamedModelProvider, serve
    from moe_l2.serve.generation import GenerationThreadDied

    # Under mlx.launch every rank runs its pipeline stage; rank 0 alone listens (docs/distributed.md).
    group = mx.distributed.init()
    try:
        _check(args)
        model_dir = local_model_dir(args.model)
        cli_args = mlx_lm_args(args)
        stream = options.from_args(args, socket=rank_socket(args.socket, group))
    except options.OptionError as exc:
        print(f"moe-l2 serve: {exc.on_command_line()}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"moe-l2 serve: {exc}", file=sys.stderr)
        return 2
    if group.rank() == 0:
        try:
            check_listen(args.host, args.port)
        except OSError as exc:
            print(f"moe-l2 serve: {listen_error(args.host, args.port, exc)}", file=sys.stderr)
            return 1
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    provider = StreamedModelProvider(cli_args, model_dir, args.model, stream, group if group.size() > 1 else None)
    status = 0
    try:
        serve(args.host, args.port, provider, on_ready=_announce(args.host, args.port), on_close=_farewell)
    except (OSError, ValueError) as exc:
        # 2: a model it cannot serve; 1: the port (taken since check_listen) or the like.
        status = 2 if exc is provider.load_error else 1
        listening = status == 1 and isinstance(exc, OSError)
        print(f"moe-l2 serve: {listen_error(args.host, args.port, exc) if listening else exc}", file=sys.stderr)
    except GenerationThreadDied as exc:
        status = 1
        print(f"moe-l2 serve: {exc}", file=sys.stderr)
    # Everything is shut down in order (the requests, the generation thread, the pool, the daemon link): leave
    # at once. mlx 0.32.4 aborts at interpreter exit after a model was loaded on another thread, as
    # mlx_lm.server does on Ctrl-C (docs/decisions.md, "serve leaves with os._exit").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
