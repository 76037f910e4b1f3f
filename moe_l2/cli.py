"""moe-l2: the command line. This file only dispatches: each subcommand is a module of moe_l2/commands with
HELP, add_arguments(parser) and run(args) -> exit status (docs/architecture.md, "The tree")."""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_l2 import __version__
from moe_l2.runtime import default_socket

# Subcommand -> module in moe_l2/commands, in the order --help lists them.
COMMANDS = {
    "demo": "demo",
    "generate": "generate",
    "serve": "serve",
    "stats": "stats",
    "plan": "plan",
    "verify": "verify",
    "pack": "pack",
    "replay": "replay",
    "bench": "bench",
    "profile": "profile",
    "predict": "predict",
    "make-model": "make_model",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-l2", description="The moe-l2 expert cache: run, inspect and tune it.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"moe_l2.commands.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "socket", "unset") is None:
        args.socket = default_socket()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
