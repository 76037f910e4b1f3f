"""moe-l2d's configuration: command-line flags, or a TOML file (the form systemd and launchd use).

Every option is one entry of OPTIONS: its TOML key, flag, type (with its bounds or choices), default and help.
The flags, the TOML keys, their validation and the README's table of flags all derive from it
(docs/architecture.md, "The daemon's options")."""

from __future__ import annotations

import argparse
import grp
import ipaddress
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from moe_l2 import __version__
from moe_l2.cache.policy import DEFAULT_POLICY, POLICIES
from moe_l2.model import DIRECT_IO
from moe_l2.model.location import expand_path, expand_socket, path_arg
from moe_l2.ranges import parse_ranges
from moe_l2.runtime import SOCKET_NAME, runtime_dir
from moe_l2.sizes import parse_size

from moe_l2.daemon.heat_file import default_state_dir

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    path: Path  # a directory or a Hugging Face repo id, resolved at start (moe_l2.model.location)
    budget: int | None  # None: "auto", sized at start by moe_l2.plan
    policy: str
    profile: Path | None  # domain profile from `moe-l2 profile`, loaded and checked at start
    direct_io: bool | None  # None: the model's default (on for packed models)
    # Decoder layer ranges (first, last) whose experts this daemon serves; None: all. Checked against the
    # model at start (ModelFiles.moe_layers_in); docs/architecture.md, "Served layers".
    layers: tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class DaemonConfig:
    models: tuple[ModelConfig, ...]
    runtime_dir: Path
    socket: str
    log_level: str
    shm_mode: int
    loader_threads: int
    socket_mode: int  # of an ipc socket; 0o660 lets socket_group (or the daemon's group) connect
    socket_group: int | None
    curve: "CurveKeys | None"  # tcp:// only: CurveZMQ encryption and client authentication
    processes: int  # client processes expected, for --budget auto
    memory_floor: int | None  # the governor's floor; None: moe_l2.plan.default_floor; 0: off
    metrics: tuple[str, int] | None  # Prometheus endpoint (host, port)
    warm_start: bool  # save L2's heat in state_dir and preload it at start (daemon/warm_start.py)
    state_dir: Path


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    clients: Path  # directory of the allowed clients' public certificates


# --- the types of option: each checks a value from a flag or from TOML, naming where it came from -----------


class Kind:
    """A type of option. `check(value, what)` takes the value as TOML holds it (a flag's text is turned into
    that first by `flag_type`) and returns the typed value, or raises a ConfigError that names `what`, the flag
    or the TOML key."""

    metavar: str | None  # the flag's, in each type
    flag_type = None  # argparse's type: the flag's text as TOML would hold it (None: the text itself)

    def check(self, value, what: str):
        raise NotImplementedError

    def bounds(self) -> str:
        """The range or choices, for the help; empty where the metavar says it all."""
        return ""


def _refused_as(what: str, parse, value):
    """parse(value), its ValueError (PathError included) a ConfigError that names `what`."""
    try:
        return parse(value)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class Integer(Kind):
    low: int
    high: int
    metavar: str = "N"
    flag_type = int

    def check(self, value, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.low <= value <= self.high:
            raise ConfigError(f"{what} must be an integer from {self.low} to {self.high}, got {value!r}")
        return value

    def bounds(self) -> str:
        return f"{self.low} to {self.high}"


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...]
    meaning: dict | None = None  # what each choice stands for; None: the choice itself

    @property
    def metavar(self) -> str:
        return "|".join(self.choices)

    def check(self, value, what: str):
        if value not in self.choices:
            raise ConfigError(f"{what} must be one of {', '.join(self.choices)}, got {value!r}")
        return value if self.meaning is None else self.meaning[value]


@dataclass(frozen=True)
class Size(Kind):
    words: dict  # words taken beside sizes, and what they stand for ("auto": None)

    @property
    def metavar(self) -> str:
        return "|".join(("SIZE", *self.words))

    def check(self, value, what: str) -> int | None:
        if isinstance(value, str) and value in self.words:
            return self.words[value]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"{what} must be a size such as \"24GiB\" or one of {', '.join(self.words)}, "
                              f"got {value!r}")
        return _refused_as(what, parse_size, value)


@dataclass(frozen=True)
class Switch(Kind):
    metavar = None

    def check(self, value, what: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{what} must be true or false, got {value!r}")
        return value


@dataclass(frozen=True)
class File(Kind):
    """A path; `~` and `$VAR` expand (moe_l2.model.location.expand_path)."""

    metavar: str
    kind: str = "a file name"

    def check(self, value, what: str) -> Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{what} must be {self.kind} (a string), got {value!r}")
        return _refused_as(what, expand_path, value)


@dataclass(frozen=True)
class Parsed(Kind):
    """A string that `parse` turns into the value, refusing it with a ValueError."""

    metavar: str
    example: str
    parse: object

    def check(self, value, what: str):
        if not isinstance(value, str):
            raise ConfigError(f"{what} must be a string such as {self.example}, got {value!r}")
        return _refused_as(what, self.parse, value)


@dataclass(frozen=True)
class Mode(Kind):
    """A file mode: octal digits in a string ("640"), or a TOML octal integer (0o640); `parse` checks it."""

    metavar: str
    parse: object

    def check(self, value, what: str) -> int:
        return _refused_as(what, self.parse, value)


def _shm_mode(value: str | int) -> int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"shm mode {value!r} must be octal digits such as \"640\" or a TOML octal integer "
                         "such as 0o640")
    if isinstance(value, int):
        mode, shown = value, f"{value:#o}"
    else:
        try:
            mode, shown = int(value, 8), repr(value)
        except ValueError:
            raise ValueError(f"shm mode {value!r} is not an octal number such as 600 or 640") from None
    if mode & ~0o666 or not mode & 0o600 == 0o600:
        # TOML reads shm_mode = 640 as the decimal number 640 (0o1200): say how to write the octal mode.
        decimal = isinstance(value, int) and all(c in "01234567" for c in str(value))
        raise ValueError(f"shm mode {shown} must give the owner read and write and nothing executable"
                         + (f" (TOML reads shm_mode = {value} as a decimal number: write shm_mode = 0o{value} "
                            f"or \"{value}\")" if decimal else ""))
    if mode & 0o022:
        raise ValueError(f"shm mode {shown} lets others write the segments, and clients refuse such "
                         "segments (docs/security.md): use 600, 640 or 644")
    return mode


def _socket_mode(value: str | int) -> int:
    mode = value if isinstance(value, int) and not isinstance(value, bool) else \
        int(value, 8) if str(value).isdigit() else -1
    if mode not in (0o600, 0o660):
        raise ValueError(f"socket mode {value!r} must be 600 (the daemon's user only) or 660 (its group "
                         "too): other users connect only through a group (docs/security.md)")
    return mode


@dataclass(frozen=True)
class Group(Kind):
    metavar = "NAME|GID"

    def check(self, value, what: str) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{what} must be a group name or id, got {value!r}")
        if value.isdigit():
            return int(value)
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise ConfigError(f"{what}: socket group {value!r} does not exist: create it (groupadd) or give a "
                              "gid") from None


def _control_address(text: str) -> str:
    address = expand_socket(text)
    if not address.startswith(("ipc://", "tcp://")):
        raise ValueError(f"socket {address!r} must be ipc://PATH or tcp://HOST:PORT")
    return address


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"metrics address {text!r} must be HOST:PORT, e.g. 127.0.0.1:9464")
    return host, int(port)


# --- the options -------------------------------------------------------------------------------------------

TOP = "top"      # a top-level TOML key; the flag sets it
MODEL = "model"  # a [[model]] key; the flag is given once for all --model or once per --model
BOTH = "both"    # a top-level key that each [[model]] may override; the flag sets the top-level one


@dataclass(frozen=True)
class Option:
    name: str  # the TOML key
    kind: Kind
    default: object  # as a flag or TOML would give it; None: unset (see `shown`)
    help: str
    scope: str = TOP
    flag: str | None = None  # default: --name, with dashes
    shown: str | None = None  # the default as the help says it, where it is not `default` itself
    required: str | None = None  # for a required [[model]] key: an example value, for the message

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_")

    def value(self, raw, what: str):
        return None if raw is None else self.kind.check(raw, what)

    def default_value(self):
        return self.value(self.default, f"the default of {self.option}")

    def full_help(self) -> str:
        shown = self.shown if self.shown is not None else \
            None if self.default is None or isinstance(self.kind, Switch) else str(self.default)
        bounds = self.kind.bounds()
        tail = "; ".join(part for part in (bounds, shown and f"default {shown}") if part)
        return f"{self.help} ({tail})" if tail else self.help


PER_MODEL = "once for all models or once per --model"
# The integer bounds catch a slip of the keyboard (400 for 4): past 256 loader threads, preads only queue at the
# device; past 1024 client processes, --budget auto has no memory left to split.

OPTIONS = (
    Option("path", File("DIR|ID", "a model directory or a Hugging Face repo id"), None, scope=MODEL, flag="--model",
           required="DIR", help="an mlx-lm checkpoint (safetensors, sharded or not, experts stacked or one tensor "
           "per expert; GGUF; or the output of moe-l2 pack), or a Hugging Face repo id already in the local cache "
           "(the daemon never downloads: moe-l2 generate --model ID or hf download ID fetches it); repeat for "
           "several models"),
    Option("budget", Size({"auto": None}), None, scope=MODEL, required="8GiB",
           help="shared memory per model (24GiB, 512MiB, 2G), checked against free memory and /dev/shm at start; "
           "one above what the model needs takes what it needs, and says so. auto (one model only): what "
           f"moe-l2 plan prints for this machine and --processes; {PER_MODEL}"),
    Option("processes", Integer(1, 1024), 1, help="client processes expected, for --budget auto"),
    Option("memory_floor", Size({"auto": None, "off": 0}), "auto", shown="auto: a twentieth of memory, at least "
           "256 MiB", help="when available memory falls below SIZE, L2 shrinks (evicting by policy, releasing the "
           "pages, never below its pins) and grows back once memory recovers; off never shrinks"),
    Option("metrics", Parsed("HOST:PORT", "\"127.0.0.1:9464\"", _host_port), None,
           help="serve the stats figures as Prometheus metrics at http://HOST:PORT/metrics (and /health: 200 "
           "while the daemon answers); loopback only unless --metrics-public; every local user can read it "
           "(docs/security.md, \"The metrics endpoint\")"),
    Option("metrics_public", Switch(), False, help="allow --metrics on an address other hosts can reach: the "
           "figures name models, paths and clients"),
    Option("policy", Choice(tuple(sorted(POLICIES))), DEFAULT_POLICY, scope=BOTH,
           help="eviction policy: learned evicts what an online model of each layer's routing finds least likely "
           "to be picked soon; adaptive is a decayed frequency whose half-life follows the workload "
           "(docs/policy-report.md); also per [[model]]"),
    Option("direct_io", Choice(tuple(sorted(DIRECT_IO)), DIRECT_IO), "auto", scope=BOTH,
           help="read model files with O_DIRECT (Linux) / F_NOCACHE (macOS); auto does for packed models, whose "
           "misses are one large aligned read (docs/formats.md); also per [[model]], and moe-l2 generate/verify "
           "--direct-io"),
    Option("layers", Parsed("A-B[,C-D]", "\"0-23\" (decoder layer ranges)", parse_ranges), None, scope=MODEL,
           shown="all", help="serve only these decoder layers (model.layers.N, as mlx-lm's pipeline numbers "
           "them): one daemon per host keeps the layers that host's ranks run, the budget buys slots for those "
           "only, and clients read the other layers from the model files (docs/architecture.md, \"Served "
           f"layers\"); {PER_MODEL}"),
    Option("profile", File("FILE"), None, scope=MODEL, help="domain profile from moe-l2 profile, so that hint "
           f"requests preload and pin a domain's experts; {PER_MODEL}"),
    Option("socket", Parsed("ADDR", "ipc://PATH", _control_address), None,
           shown="ipc://RUNTIME_DIR/moe-l2d.sock", help="ZeroMQ address to bind: ipc://PATH, or tcp://HOST:PORT "
           "on loopback unless CurveZMQ"),
    Option("runtime_dir", File("DIR", "a directory"), None, shown="$MOE_L2_RUNTIME_DIR, systemd's "
           "$RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/moe-l2, or the temp dir",
           help="directory of the socket, the lock and the segment list"),
    Option("shm_mode", Mode("OCTAL", _shm_mode), "600", help="mode of the shared-memory segments: 600, or 640 "
           "with a shared group; in the TOML shm_mode = 0o640 or \"640\": a bare 640 is a decimal number, refused "
           "with a message"),
    Option("loader_threads", Integer(1, 256), 4, help="parallel loads from disk"),
    Option("warm_start", Choice(("on", "off"), {"on": True, "off": False}), "on", help="save what L2 holds (its "
           "experts, their policy state, the pins) every few minutes and at a clean stop, and preload it at the "
           "next start below clients' loads; off starts cold and saves nothing"),
    Option("state_dir", File("DIR", "a directory"), None, shown="systemd's $STATE_DIRECTORY, else "
           "$XDG_STATE_HOME/moe-l2 or ~/.local/state/moe-l2; ~/Library/Application Support/moe-l2 on macOS",
           help="directory of the saved heat of each model (--warm-start)"),
    Option("socket_mode", Mode("OCTAL", _socket_mode), "600", help="mode of the ipc socket: 600 lets the daemon's "
           "user connect, 660 its group too: --socket-group, else the daemon's"),
    Option("socket_group", Group(), None, help="group of the ipc socket"),
    Option("curve_secret_key", File("FILE"), None, help="tcp:// only: the daemon's CurveZMQ certificate with its "
           "secret key (zmq.auth.create_certificates); with --curve-clients, allows non-loopback addresses"),
    Option("curve_clients", File("DIR", "a directory"), None, help="directory of the public certificates of the "
           "clients allowed to connect over CurveZMQ"),
    Option("log_level", Choice(LOG_LEVELS), "info", help="least severe messages logged; under systemd "
           "(JOURNAL_STREAM set) each line carries its journald priority, <3> to <7>"),
)
TOP_KEYS = tuple(o.name for o in OPTIONS if o.scope != MODEL)
MODEL_KEYS = tuple(o.name for o in OPTIONS if o.scope != TOP)
REQUIRED = tuple(o for o in OPTIONS if o.required)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-l2d",
        description="Keep MoE expert weights in POSIX shared memory for every inference process on this machine.")
    parser.add_argument("--config", type=path_arg, metavar="FILE",
                        help="TOML file (systemd/moe-l2d.toml.example): the options below as keys, each model a "
                             "[[model]]; flags given too win")
    add_flags(parser, OPTIONS)
    parser.add_argument("--version", action="version", version=f"moe-l2d {__version__}", help="print the version")
    return parser


def add_flags(parser: argparse.ArgumentParser, options) -> None:
    """The flags of `options` (entries of OPTIONS): moe-l2d's, and those `moe-l2 service install` passes on."""
    for o in options:
        help = o.full_help().replace("%", "%%")
        if isinstance(o.kind, Switch):
            parser.add_argument(o.option, action="store_true", default=None, help=help)
        else:
            parser.add_argument(o.option, dest=o.dest, type=o.kind.flag_type, metavar=o.kind.metavar, help=help,
                                choices=o.kind.choices if isinstance(o.kind, Choice) else None,
                                action="append" if o.scope == MODEL else "store", default=None)


def flags_table() -> str:
    """The README's table of moe-l2d's flags, from the parser OPTIONS drives (tests/test_daemon.py checks it)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| flag | meaning |", "|---|---|"]
    for action in build_parser()._actions:
        if "-h" not in action.option_strings:
            flag = " ".join(filter(None, (action.option_strings[-1], action.metavar)))
            rows.append(f"| `{cell(flag)}` | {cell(action.help.replace('%%', '%'))} |")
    return "\n".join(rows) + "\n"


# Host names that always mean this machine; anything else is checked as an address.
LOOPBACK_NAMES = ("localhost", "lo", "lo0")


def _curve(secret_key, clients, socket: str) -> CurveKeys | None:
    if secret_key is None and clients is None:
        return None
    if secret_key is None or clients is None:
        raise ConfigError("CurveZMQ needs both curve_secret_key (the daemon's certificate) and curve_clients (the "
                          "directory of the allowed clients' public certificates)")
    if not socket.startswith("tcp://"):
        raise ConfigError(f"CurveZMQ keys apply to tcp:// sockets only, not {socket!r}; an ipc socket is guarded by "
                          "its mode (--socket-mode)")
    secret_key, clients = Path(secret_key), Path(clients)
    try:
        if os.stat(secret_key).st_mode & 0o077:
            raise ConfigError(f"{secret_key} holds the daemon's secret key but others may read it: chmod 600 it")
        public, secret = zmq.auth.load_certificate(secret_key)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the CurveZMQ certificate {secret_key}: {exc}") from None
    if secret is None:
        raise ConfigError(f"{secret_key} has no secret key: give the .key_secret file of "
                          "zmq.auth.create_certificates")
    if not clients.is_dir():
        raise ConfigError(f"curve_clients {clients} is not a directory of client public certificates")
    return CurveKeys(public, secret, clients)


def check_tcp(socket: str) -> None:
    """tcp:// without CurveZMQ is unauthenticated: refuse every host but loopback."""
    host = socket[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host in LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"socket {socket!r} would let other machines reach the control plane, which has no authentication "
            "over plain TCP: bind tcp://127.0.0.1:PORT, or configure CurveZMQ (--curve-secret-key and "
            "--curve-clients), or use the default ipc:// socket, whose file mode decides who may connect "
            "(docs/security.md)")


def _load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None


def _per_model(o: Option, values: list | None, models: list) -> list:
    """A flag given once for all --model or once per --model, as one value (or None) per --model."""
    values = values or []
    if values and not models:
        raise ConfigError(f"{o.option} needs a --model to apply to (in a config file, set {o.name} in [[model]])")
    if values and len(values) not in (1, len(models)):
        raise ConfigError(f"give {o.option} once, or once per --model ({len(models)} models, {len(values)} "
                          f"{o.option})")
    if not values and models and o.required:
        raise ConfigError(f"{o.option} is required with --model, e.g. {o.option} {o.required}")
    return values * len(models) if len(values) == 1 else (values or [None] * len(models))


def _flag_or_key(o: Option, args: argparse.Namespace, table: dict, config) -> object:
    """The flag's value if given, else the TOML key's, else the default; checked by the option's type."""
    given = getattr(args, o.dest)
    if given is not None:
        return o.value(given, o.option)
    if o.name in table:
        return o.value(table[o.name], f"{o.name} in {config}")
    return o.default_value()


def _models_of_file(table: dict, config, top: dict) -> list[ModelConfig]:
    entries = table.get("model", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"model in {config} must be [[model]] tables, each with a path and a budget")
    models = []
    for entry in entries:
        if any(o.name not in entry for o in REQUIRED):
            raise ConfigError(f"every [[model]] in {config} needs a {' and a '.join(o.name for o in REQUIRED)}")
        unknown = set(entry) - set(MODEL_KEYS)
        if unknown:
            raise ConfigError(f"unknown key(s) in the [[model]] of {entry['path']} in {config}: "
                              f"{', '.join(sorted(unknown))} (known: {', '.join(MODEL_KEYS)})")
        values = {}
        for o in OPTIONS:
            if o.scope == TOP:
                continue
            what = f"path of a [[model]] in {config}" if o.name == "path" else f"{o.name} of {entry['path']}"
            values[o.name] = o.value(entry[o.name], what) if o.name in entry else \
                top[o.name] if o.scope == BOTH else o.default_value()
        models.append(ModelConfig(**values))
    return models


def _models_of_flags(args: argparse.Namespace, top: dict) -> list[ModelConfig]:
    paths = args.model or []
    per_model = {o.name: _per_model(o, getattr(args, o.dest), paths) for o in OPTIONS if o.scope == MODEL}
    models = []
    for i in range(len(paths)):
        values = {o.name: o.value(per_model[o.name][i], o.option) if per_model[o.name][i] is not None
                  else o.default_value() for o in OPTIONS if o.scope == MODEL}
        models.append(ModelConfig(**values, **{o.name: top[o.name] for o in OPTIONS if o.scope == BOTH}))
    return models


def resolve(args: argparse.Namespace) -> DaemonConfig:
    """Merge the TOML file (if any) with the flags; flags win."""
    table = _load_toml(args.config) if args.config else {}
    unknown = set(table) - {*TOP_KEYS, "model"}
    if unknown:
        raise ConfigError(f"unknown key(s) in {args.config}: {', '.join(sorted(unknown))}")
    top = {o.name: _flag_or_key(o, args, table, args.config) for o in OPTIONS if o.scope != MODEL}
    models = _models_of_file(table, args.config, top) + _models_of_flags(args, top)
    if not models:
        raise ConfigError("nothing to serve: give --model DIR --budget SIZE, or --config FILE")
    if any(m.budget is None for m in models) and len(models) > 1:
        raise ConfigError("budget auto sizes one model's L2 from the machine's memory; with several models give "
                          "each a size (moe-l2 plan --model DIR prints one)")
    directory = top["runtime_dir"] or runtime_dir()
    socket = top["socket"] or f"ipc://{directory / SOCKET_NAME}"
    curve = _curve(top["curve_secret_key"], top["curve_clients"], socket)
    if socket.startswith("tcp://") and curve is None:
        check_tcp(socket)
    # sun_path holds 108 bytes on Linux and 104 on macOS.
    if socket.startswith("ipc://") and len(socket[len("ipc://"):].encode()) > 100:
        raise ConfigError(f"ipc socket path {socket[6:]!r} is longer than 100 bytes; choose a shorter "
                          "--runtime-dir or --socket")
    if top["metrics"] is not None and not top["metrics_public"]:
        _check_loopback_metrics(*top["metrics"])
    return DaemonConfig(
        models=tuple(models), runtime_dir=directory, socket=socket, log_level=top["log_level"],
        shm_mode=top["shm_mode"], loader_threads=top["loader_threads"], socket_mode=top["socket_mode"],
        socket_group=top["socket_group"], curve=curve, processes=top["processes"],
        memory_floor=top["memory_floor"], metrics=top["metrics"], warm_start=top["warm_start"],
        state_dir=top["state_dir"] or default_state_dir())


def _check_loopback_metrics(host: str, port: int) -> None:
    """A loopback host unless metrics_public: the figures name models, paths and clients (docs/architecture.md,
    "A live view and metrics")."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ConfigError(f"metrics address {host}:{port} is reachable from other hosts, and the metrics name "
                          "models, paths and clients: use 127.0.0.1:PORT, or add --metrics-public "
                          "(metrics_public = true) if that is meant")
