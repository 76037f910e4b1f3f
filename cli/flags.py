"""What several commands' parsers share: a flag's old name kept for one release (`add_renamed`), and the
values of mlx-lm's flags that generate and serve both take."""

from __future__ import annotations

import argparse
import json
import sys

# KV cache bits that mlx-lm's --kv-bits can take (mlx.core.quantize's).
KV_BITS = (2, 3, 4, 5, 6, 8)


def add_sampling(group, default: str = "") -> None:
    """mlx-lm's sampling flags, which mlx_lm.generate and mlx_lm.server take with the same defaults; `default`
    starts their help (serve: "default " for what a request leaves out)."""
    for flag, kind, value, help in (("--temp", float, 0.0, "sampling temperature (default: 0.0, greedy)"),
                                    ("--top-p", float, 1.0, "nucleus sampling top-p (default: 1.0, off)"),
                                    ("--min-p", float, 0.0, "min-p sampling (default: 0.0, off)"),
                                    ("--top-k", int, 0, "top-k sampling (default: 0, off)")):
        group.add_argument(flag, type=kind, default=value, help=default + help)


def json_object(text: str) -> dict:
    """An argparse type: a JSON object, such as the keyword arguments of a tokenizer's apply_chat_template."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); give an object, e.g. '{{\"enable_thinking\": false}}'")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


class _OldName(argparse.Action):
    """A flag's old name: says on stderr that it is deprecated, then does what the new name does."""

    def __init__(self, option_strings, dest, renamed: argparse.Action, **kwargs):
        super().__init__(option_strings, dest, nargs=renamed.nargs, const=renamed.const, default=argparse.SUPPRESS,
                         type=renamed.type, choices=renamed.choices, metavar=renamed.metavar, help=argparse.SUPPRESS)
        self.renamed = renamed

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.renamed.option_strings[-1]
        # stderr, not warnings.warn: a script sees it whatever its warning filters, and tests keep warnings errors.
        print(f"{parser.prog}: {option_string} is deprecated: use {new} (the old name goes after the next "
              "release)", file=sys.stderr)
        self.renamed(parser, namespace, values, new)


def add_renamed(container, new: str, old: str, **kwargs) -> argparse.Action:
    """Add flag `new` (`kwargs` as add_argument takes them) to a parser or argument group, with `old`, its
    name until now, as a hidden alias that keeps working for one release and says on stderr that it is
    deprecated. The two exclude each other; `required` holds for the pair."""
    if isinstance(container, argparse._MutuallyExclusiveGroup):
        pair = container  # argparse does not nest exclusive groups: the pair joins the one it is in
    else:
        pair = container.add_mutually_exclusive_group(required=kwargs.pop("required", False))
    kwargs["help"] = f"{kwargs.get('help', '')} (was {old})".lstrip()
    action = pair.add_argument(new, **kwargs)
    pair.add_argument(old, action=_OldName, dest=action.dest, renamed=action)
    return action
