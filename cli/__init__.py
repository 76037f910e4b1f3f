"""moe-l2: the command line. This file only dispatches: each subcommand is a module of cli/ (moe_l2.cli) with
add_arguments(parser) and run(args) -> exit status (docs/architecture.md, "The tree").

Only the chosen command's module is imported, as mlx-lm's cli.py does: `moe-l2 stats`, `--version` and
`--help` answer without importing MLX's model code, mlx-lm or transformers, which the heavy commands need.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_l2 import __version__

# Subcommand -> (its module in cli/, its one-line help), in the order --help lists them.
COMMANDS = {
    "demo": ("demo", "the built-in demo: a small model, alone and with a daemon: cold, warm, restarted"),
    "generate": ("generate", "generate text with an mlx-lm MoE model, its experts streamed"),
    "serve": ("serve", "serve an mlx-lm MoE model over an OpenAI-compatible HTTP API, its experts streamed"),
    "stats": ("stats", "hit rates, occupancy, loads and memory of the running daemon"),
    "doctor": ("doctor", "what this machine gives moe-l2 (zero-copy, shared memory, locking, limits, disk, daemon) "
                         "and what would make it slow or unsafe"),
    "plan": ("plan", "how this machine's memory splits into L2, L0 per process, KV and headroom; with a trace, "
                     "hit rates"),
    "verify": ("verify", "check experts through the client path against the file and the model's checksum "
                         "manifest"),
    "pack": ("pack", "rewrite a checkpoint expert-major: one read per expert"),
    "replay": ("replay", "run routing traces through the daemon's store: hit rates vs LRU, LFU and Belady's MIN"),
    "bench": ("bench", "replay a routing trace at real expert sizes: moe-l2 against the page cache and pread, "
                       "same memory"),
    "profile": ("profile", "build a domain profile from traces or the daemon's statistics"),
    "predict": ("predict", "name a prompt's domain with a profile's predictor"),
    "make-model": ("make_model", "write a random-weight mlx-lm MoE checkpoint"),
    "service": ("service", "run moe-l2d as a service started by its first client (systemd, launchd); its "
                           "status; uninstall it"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only `command`'s module is imported and given its arguments (None: no module, which
    is all that --help, --version and a mistyped command need)."""
    parser = argparse.ArgumentParser(prog="moe-l2", description="The moe-l2 expert cache: run, inspect and tune it.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(f"moe_l2.cli.{module_name}")
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    if getattr(args, "socket", "unset") is None:
        from moe_l2.runtime import default_socket

        args.socket = default_socket()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
