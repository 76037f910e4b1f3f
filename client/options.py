"""StreamOptions: how a process streams a model's experts, the one owner of every streaming option.

Each field carries its default, its choices and its help (dataclasses.field metadata); nothing else restates
them. `moe_l2.load` takes the fields as keyword arguments, `StreamedLM` takes the dataclass, `moe-l2
generate`, `serve` and `bench` derive their flags from it (`add_arguments`, `from_args`), and `moe-l2 plan`
reads the L0 policy and `--l0-ceilings` from it.

The defaults are the configuration `moe-l2 bench` measured as best, the one every table of docs/benchmarks.md
runs as "moe-l2" (architecture.md, "The bench"; the figures, step by step, in benchmarks.md's "How it got
there"): the experts L2 holds computed on in place (a copy costs what a page-cache read costs: "Zero-copy L2
reads"); with a daemon and in-place reads, one shared set of L0 rows for every layer, so that L2 gets the
memory; a miss read once instead of twice (by this process, which gives it to L2, or by the daemon while this
process waits: 100 ms is ten reads of a 12.6 MiB record on the slowest disk measured here); LRU in L0, the only
policy a shared L0 has and the one every measured L0 ran. Without a daemon, L0 keeps rows in every layer, as the
bench's pread (the same memory, no L2) does. The experimental options (`experimental=True`) are off by default
until a benchmark shows that they win; `--help` lists them under EXPERIMENTAL, and what each was measured to
give is in benchmarks.md, "Experimental options", never in its help.

Help texts name other options as `{name}`: the field's name in the library, its flag on the command line. So do
the messages of `OptionError`, which `str()` gives in the library's terms and `on_command_line()` in flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from moe_l2.cache.policy import POLICIES
from moe_l2.cache.prefetch import PREFETCH
from moe_l2.cache.profile import Profile, ProfileError
from moe_l2.model import DIRECT_IO
from moe_l2.model.location import path_arg, socket_arg
from moe_l2.sizes import parse_size

__all__ = ["StreamOptions", "OptionError", "DEFAULTS", "VERIFY", "L2_READS", "EXPERIMENTAL", "add_arguments",
           "from_args", "milliseconds"]

# verify: which records are checked against the model's checksum manifest, if it has one: none, those read from
# the model file, or those and the ones copied from L2 (docs/architecture.md, "Integrity").
VERIFY = ("off", "file", "all")
# l2_reads: the experts L2 holds are computed on where they are, or copied into the process first.
L2_READS = ("in-place", "copy")
# shared_l0 as `--l0` gives it, the flag `moe-l2 bench` has always taken.
_L0_LAYOUTS = {"shared": True, "per-layer": False}
# The heading of the experimental options in every command's --help.
EXPERIMENTAL = "experimental options"
_EXPERIMENTAL_NOTE = ("off by default; what each gained or cost where it was measured, and the command that "
                      "measures it: docs/benchmarks.md, \"Experimental options\"")


class OptionError(ValueError):
    """A streaming option that cannot be used as given; the message says what to give instead."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(template.format_map(_NAMES))

    def on_command_line(self) -> str:
        """The message with the options named by their flags."""
        return _with_flags(self.template)


def ceilings_arg(text: str) -> Path | tuple[int, ...]:
    """An argparse type: experts per MoE layer as N,N,..., or a profile's path."""
    if re.fullmatch(r"[\d,\s]+", text):
        try:
            return tuple(int(n) for n in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a number of experts for every MoE layer, such as 8,8,12, "
                                             f"or a profile, not {text!r}") from None
    return path_arg(text)


def milliseconds(text: str) -> float:
    """An argparse type: a wait in milliseconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes milliseconds, a number such as 100, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"takes 0 (no wait) or more milliseconds, not {text}")
    return value


def _option(default, help: str, flag: str | None = None, **how):
    """A field: its default, its help, and how the command line gives it: `flag` (None: the library alone),
    `choices`, `type`, `metavar`, `action`, `exclusive` (a group of flags that exclude each other), `flag_help`
    (the flag's help where it says the opposite of the field: a store_false flag), `experimental` (listed
    under EXPERIMENTAL in --help)."""
    return field(default=default, metadata={"help": help, "flag": flag, **how})


@dataclass(frozen=True)
class StreamOptions:
    """How a process streams a model's experts (moe_l2.load's keyword arguments; StreamedLM's options)."""

    l0_slots: int | None = _option(
        None, "experts kept in this process: per layer, or in all with a shared L0 (default: moe-l2 plan's for "
              "this machine: with a daemon at load and a shared L0, top-k rows in all, leaving the memory to "
              "L2, and more only where L2 holds every expert; else a quarter of the experts of every layer, "
              "fewer when memory is short)",
        "--l0-slots", type=int, exclusive="l0 size")
    l0_budget: int | str | None = _option(
        None, "memory for this process' experts over all layers, in bytes or as a size such as 2GiB",
        "--l0-budget", exclusive="l0 size")
    shared_l0: bool | None = _option(
        None, "one set of L0 rows for all layers ({l0_slots} counts rows in all), evicting the least recently used "
              "expert of any layer, instead of rows in every layer; by default shared where the experts moe-l2d's "
              "shared memory holds are computed on in place (with a daemon, {l2_reads} in-place), so that L0 holds "
              "only what L2 lacks and a few rows leave the memory to L2, and per layer otherwise",
        "--l0-shared", action=argparse.BooleanOptionalAction, exclusive="l0 layout")
    l0_grow: bool = _option(
        False, "L0 starts with the model's top-k rows (per layer, or in all when shared) and grows them by half at "
               "a time while the experts in use outgrow them, up to {l0_slots} (what the budget gives), evicting only "
               "there: a short prompt holds less memory than a long one; each growth copies the rows held so far",
        "--l0-grow", action=argparse.BooleanOptionalAction, experimental=True)
    l0_ceilings: str | Path | tuple[int, ...] | None = _option(
        None, "each layer its own L0 ceiling instead of {l0_slots} in every one: a profile from moe-l2 profile "
              "--traces (P.json), whose LRU hit curves split the rows the budget gives among the layers where "
              "they gain most, or every layer's ceiling (on the command line N,N,...); L0 is per layer then",
        "--l0-ceilings", type=ceilings_arg, metavar="P.json|N,N,...", experimental=True)
    l0_autopin: bool = _option(
        False, "pin each layer's hottest experts in L0 (counted from the router's picks, no extra sync), up to a "
               "quarter of its rows, chosen again as their heat decays, so that a burst of cold experts cannot "
               "flush them; L0 is per layer then",
        "--l0-autopin", action=argparse.BooleanOptionalAction, experimental=True)
    policy: str = _option(
        "lru", "how L0 evicts (per-layer rows; a shared L0 evicts the least recently used expert)",
        choices=tuple(POLICIES))
    socket: str | None = _option(
        None, "moe-l2d address (default: the local runtime dir's socket); under mlx.launch, {{rank}} in it is "
              "replaced by the process' rank (one daemon per rank)",
        "--socket", type=socket_arg, exclusive="daemon")
    daemon: bool = _option(
        True, "use moe-l2d where one answers (False: read missing experts from the model files only)",
        "--no-daemon", action="store_false", exclusive="daemon",
        flag_help="read missing experts from the model files only, never from moe-l2d")
    client_wait_s: float = _option(
        2.0, "seconds loading waits for moe-l2d to answer before it reads experts from the model files (and "
             "says so once); it attaches whenever the daemon answers later")
    direct_io: str = _option(
        "auto", "read missing experts with O_DIRECT / F_NOCACHE: on, off, or auto (for packed models)",
        "--direct-io", choices=tuple(DIRECT_IO))
    verify: str = _option(
        "file", "check experts against the model's checksum manifest, if it has one: those read from the model "
                "file (file), those copied from moe-l2d's shared memory too (all), or none (off)",
        "--verify-checksums", choices=VERIFY)
    l2_reads: str = _option(
        "in-place", "experts that moe-l2d's shared memory holds: computed on where they are (in-place; a layer "
                    "whose experts the daemon replaced meanwhile is computed again) or copied into this process "
                    "first (copy)",
        "--l2-reads", choices=L2_READS)
    load_through_ms: float = _option(
        100.0, "an expert that moe-l2d's shared memory lacks: report it at once and wait up to this many "
               "milliseconds for the daemon to load it (one disk read, the daemon's), then read the file for what "
               "has not arrived (0: read the file at once, while the daemon loads it too); with {fill_l2}, the "
               "longest wait for an expert another process is reading into it",
        "--load-through-ms", type=milliseconds, metavar="MS")
    fill_l2: bool = _option(
        True, "an expert that moe-l2d's shared memory lacks is read by this process, then given to the daemon's "
              "shared memory by a background thread (one disk read, this process', off the token's path), where "
              "this process runs as the daemon's user; elsewhere, and with --no-fill-l2, the daemon loads it "
              "({load_through_ms} says whether this process waits for that)",
        "--fill-l2", action=argparse.BooleanOptionalAction)
    prefetch: str = _option(
        "off", "while a MoE layer computes, load the next layer's guessed experts in the background: guessed by "
               "the next layer's router (router), by a logistic model of the expert ids this token and the one "
               "before it picked (logistic) or by expert co-occurrence (cooccurrence), both learned online, or "
               "router where the model has one and logistic where not (auto)",
        "--prefetch", choices=PREFETCH, experimental=True)
    prefetch_from: str | Path | None = _option(
        None, "a routing trace of this model (moe-l2 generate --trace-out writes one) that the learned "
              "{prefetch} predictors (logistic, cooccurrence) start from instead of from nothing",
        "--prefetch-from", type=path_arg, metavar="TRACE", experimental=True)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise OptionError(f"{{{f.name}}} takes one of {', '.join(choices)}, not {getattr(self, f.name)!r}")
        if not isinstance(self.daemon, bool):
            raise OptionError(f"{{daemon}} takes True or False, not {self.daemon!r}")
        if self.shared_l0 not in (None, True, False):
            raise OptionError(f"{{shared_l0}} takes True, False or None (by the configuration), not "
                              f"{self.shared_l0!r}")
        if self.l0_slots is not None and (not isinstance(self.l0_slots, int) or isinstance(self.l0_slots, bool)
                                          or self.l0_slots < 1):
            raise OptionError(f"{{l0_slots}} takes a number of experts, 1 or more, not {self.l0_slots!r}")
        if isinstance(self.l0_ceilings, (list, tuple)):
            if not self.l0_ceilings or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                               for n in self.l0_ceilings):
                raise OptionError(f"{{l0_ceilings}} takes a profile or a number of experts, 1 or more, for every "
                                  f"MoE layer, not {self.l0_ceilings!r}")
            if self.l0_slots is not None or self.l0_budget is not None:
                raise OptionError("{l0_ceilings} as numbers gives every layer's ceiling: give it without "
                                  "{l0_slots} or {l0_budget}, or give a profile to split those among the layers")
            object.__setattr__(self, "l0_ceilings", tuple(self.l0_ceilings))  # frozen: hashable and unchangeable
        elif self.l0_ceilings is not None and not isinstance(self.l0_ceilings, (str, Path)):
            raise OptionError(f"{{l0_ceilings}} takes a profile's path or a list of experts per layer, not "
                              f"{self.l0_ceilings!r}")
        if self.l0_autopin and self.shared_l0:
            raise OptionError("a shared L0 ({shared_l0}) has no rows of a layer's own: {l0_autopin} needs per-layer "
                              "rows")
        if self.l0_ceilings is not None and self.shared_l0:
            raise OptionError("a shared L0 ({shared_l0}) has one ceiling for all layers: {l0_ceilings} needs "
                              "per-layer rows")
        if self.l0_budget is not None:
            try:
                parse_size(self.l0_budget)
            except (TypeError, ValueError) as exc:
                raise OptionError(f"{{l0_budget}}: {exc}") from None
        for name in ("load_through_ms", "client_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise OptionError(f"{{{name}}} takes 0 or more, not {value!r}")
        if self.prefetch_from is not None and self.prefetch == "off":
            raise OptionError("{prefetch_from} seeds next-layer prefetch, which is off: give {prefetch} too")
        if self.shared_l0 and self.policy != "lru":
            raise OptionError(f"a shared L0 ({{shared_l0}}) evicts the least recently used expert of any layer; "
                              f"{{policy}} {self.policy!r} needs per-layer rows")

    @classmethod
    def of(cls, options: "StreamOptions | None" = None, /, **fields) -> "StreamOptions":
        """`options` (or the defaults) with `fields` replaced; a name that is no option is refused with the list
        of those that are (TypeError, as Python refuses an unknown keyword argument)."""
        unknown = sorted(fields.keys() - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"no streaming option named {', '.join(map(repr, unknown))}; the options are "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        return dataclasses.replace(options if options is not None else cls(), **fields)

    @property
    def l0_shared(self) -> bool:
        """Whether L0 is one set of rows for all layers: `shared_l0`, or where it is None, whether L2's records
        are computed on in place with an LRU L0 (what `moe-l2 bench` measured as best: docs/decisions.md, "A
        shared L0 where L2 is read in place")."""
        if self.shared_l0 is not None:
            return self.shared_l0
        if self.l0_ceilings is not None or self.l0_autopin:
            return False
        return self.daemon and self.l2_reads == "in-place" and self.policy == "lru"

    @property
    def direct(self) -> bool | None:
        """ExpertPool's `direct`: True, False, or None for the model's default."""
        return DIRECT_IO[self.direct_io]

    @property
    def lend(self) -> bool:
        """ExpertPool's `lend`: compute on L2's records in place."""
        return self.l2_reads == "in-place"

    @property
    def load_through_s(self) -> float:
        return self.load_through_ms / 1e3

    def l0_capacity(self, files, layers: list[int], slots: int) -> int | dict[int, int]:
        """ExpertPool's capacity for `files`' `layers`: `slots` in every layer, or with `l0_ceilings` each layer
        its own: the number given for each MoE layer of the model, or the `slots` per layer split by the
        profile's hit curves (src/moe_l2/cache/ceilings.py)."""
        ceilings = self.l0_ceilings
        if ceilings is None:
            return slots
        if isinstance(ceilings, tuple):
            if len(ceilings) != files.n_layers:
                raise OptionError(f"{{l0_ceilings}} gives {len(ceilings)} ceilings; {files.path} has "
                                  f"{files.n_layers} MoE layers: give one for each")
            for layer, rows in enumerate(ceilings):
                if not files.top_k <= rows <= files.n_experts:
                    raise OptionError(f"{{l0_ceilings}}: MoE layer {layer} gets {rows} experts; a layer needs "
                                      f"{files.top_k} (one token's) to {files.n_experts} (all of them)")
            return {layer: ceilings[layer] for layer in layers}
        try:
            profile = Profile.load(ceilings)
            profile.check_model(files.n_layers, files.n_experts, f"model {files.path}")
            return profile.l0_ceilings(layers, slots)
        except ProfileError as exc:
            raise OptionError(f"{{l0_ceilings}}: {str(exc).replace('{', '{{').replace('}', '}}')}") from None


DEFAULTS = StreamOptions()
_NAMES = {f.name: f.name for f in dataclasses.fields(StreamOptions)}
# help(StreamOptions): each field, its default and its help, in the library's terms.
StreamOptions.__doc__ += "\n\n" + "\n".join(
    f"{f.name} = {f.default!r}{' (experimental)' if f.metadata.get('experimental') else ''}: "
    f"{f.metadata['help'].format_map(_NAMES)}" for f in dataclasses.fields(StreamOptions))


def _with_flags(template: str) -> str:
    """`{name}` as the field's flag (its name where it has none)."""
    return template.format_map({f.name: f.metadata["flag"] or f.name for f in dataclasses.fields(StreamOptions)})


def _help(f: dataclasses.Field) -> str:
    text = _with_flags(f.metadata.get("flag_help", f.metadata["help"])).replace("%", "%%")
    if f.metadata.get("action") is None and f.default is not None:
        text += f" (default: {f.default:g})" if isinstance(f.default, float) else f" (default: {f.default})"
    return text


def add_arguments(parser: argparse.ArgumentParser, names=None, title: str | None = None) -> None:
    """Add the flags of the fields named (None: every field that has one), with the fields' names as their
    destinations and the fields' defaults, choices and help: `from_args` reads them back. The experimental
    ones go under EXPERIMENTAL; the others under `title` (None: among the parser's own options)."""
    containers: dict[bool, argparse._ActionsContainer] = {}
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in dataclasses.fields(StreamOptions):
        flag = f.metadata["flag"]
        if flag is None or names is not None and f.name not in names:
            continue
        experimental = f.metadata.get("experimental", False)
        if experimental not in containers:
            containers[experimental] = (parser.add_argument_group(EXPERIMENTAL, _EXPERIMENTAL_NOTE) if experimental
                                        else parser if title is None else parser.add_argument_group(title))
        exclusive = f.metadata.get("exclusive")
        if exclusive is not None and exclusive not in groups:
            groups[exclusive] = containers[experimental].add_mutually_exclusive_group()
        target = containers[experimental] if exclusive is None else groups[exclusive]
        how = {k: f.metadata[k] for k in ("type", "choices", "metavar", "action") if f.metadata.get(k) is not None}
        target.add_argument(flag, dest=f.name, default=f.default, help=_help(f), **how)
        if f.name == "shared_l0":
            target.add_argument("--l0", dest=f.name, type=_l0_layout, metavar="{shared,per-layer}",
                                help=f"{flag} or --no-{flag[2:]}, as a word")


def _l0_layout(text: str) -> bool:
    if text not in _L0_LAYOUTS:
        raise argparse.ArgumentTypeError(f"takes {' or '.join(_L0_LAYOUTS)}, not {text!r}")
    return _L0_LAYOUTS[text]


def from_args(args: argparse.Namespace, **fields) -> StreamOptions:
    """The options a command's parsed flags give (fields it has no flags for keep their defaults), with `fields`
    replaced."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StreamOptions) if hasattr(args, f.name)}
    return StreamOptions(**{**given, **fields})

