"""moe-l2d's configuration: command-line flags, or a TOML file (the form systemd and launchd use)."""

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
from moe_l2.ranges import parse_ranges
from moe_l2.model.location import PathError, expand_path, expand_socket, path_arg, socket_arg
from moe_l2.runtime import SOCKET_NAME, runtime_dir
from moe_l2.sizes import parse_size

LOG_LEVELS = ("debug", "info", "warning", "error")
MODEL_KEYS = ("path", "budget", "policy", "profile", "direct_io", "layers")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    path: Path  # a directory or a Hugging Face repo id, resolved at start (moe_l2.model.location)
    budget: int | None  # None: "auto", sized at start by moe_l2.plan
    policy: str = DEFAULT_POLICY
    profile: Path | None = None  # domain profile from `moe-l2 profile`, loaded and checked at start
    direct_io: bool | None = None  # None: the model's default (on for packed models)
    # Decoder layer ranges (first, last) whose experts this daemon serves; None: all. Checked against the
    # model at start (ModelFiles.moe_layers_in); docs/architecture.md, "Served layers".
    layers: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class DaemonConfig:
    models: tuple[ModelConfig, ...]
    runtime_dir: Path
    socket: str
    log_level: str = "info"
    shm_mode: int = 0o600
    loader_threads: int = 4
    socket_mode: int = 0o600  # of an ipc socket; 0o660 lets socket_group (or the daemon's group) connect
    socket_group: int | None = None
    curve: "CurveKeys | None" = None  # tcp:// only: CurveZMQ encryption and client authentication
    processes: int = 1  # client processes expected, for --budget auto
    memory_floor: int | None = None  # the governor's floor; None: moe_l2.plan.default_floor; 0: off
    metrics: tuple[str, int] | None = None  # Prometheus endpoint (host, port)


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    clients: Path  # directory of the allowed clients' public certificates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-l2d",
        description="Keep MoE expert weights in POSIX shared memory for every inference process on this machine.")
    parser.add_argument("--config", type=path_arg, help="TOML file (see systemd/moe-l2d.toml.example)")
    parser.add_argument("--model", action="append", type=path_arg, default=[], metavar="DIR|ID",
                        help="model directory, or Hugging Face repo id in the local cache (the daemon never "
                             "downloads), to serve; repeat for several models")
    parser.add_argument("--budget", action="append", default=[], metavar="SIZE",
                        help="shared memory per model, e.g. 24GiB, or auto (sized from this machine's memory, "
                             "as moe-l2 plan prints); once for all models or once per --model")
    parser.add_argument("--processes", type=int, default=None,
                        help="client processes expected, for --budget auto (default 1)")
    parser.add_argument("--memory-floor", default=None, metavar="SIZE",
                        help="when available memory falls below SIZE, shrink L2 until it recovers; off to "
                             "never shrink (default auto: a twentieth of memory, at least 256MiB)")
    parser.add_argument("--metrics", default=None, metavar="HOST:PORT",
                        help="serve Prometheus metrics over HTTP, e.g. 127.0.0.1:9464 (loopback only unless "
                             "--metrics-public)")
    parser.add_argument("--metrics-public", action="store_true",
                        help="allow --metrics on an address other hosts can reach")
    parser.add_argument("--policy", default=None, choices=sorted(POLICIES),
                        help=f"eviction policy (default {DEFAULT_POLICY})")
    parser.add_argument("--direct-io", choices=sorted(DIRECT_IO), default=None,
                        help="read model files with O_DIRECT / F_NOCACHE: auto (default: for packed models), "
                             "on, off")
    parser.add_argument("--profile", action="append", type=path_arg, default=[], metavar="FILE",
                        help="domain profile (moe-l2 profile) for hints; once for all models or once per --model")
    parser.add_argument("--layers", action="append", default=[], metavar="A-B[,C-D...]",
                        help="serve only these decoder layers (model.layers.N, as mlx-lm's pipeline numbers "
                             "them), e.g. 0-23 for the ranks on this host; the budget covers only their MoE "
                             "layers, clients read the others from the model files (default: all); once for all "
                             "models or once per --model")
    parser.add_argument("--socket", type=socket_arg,
                        help="ZeroMQ address to bind (default ipc://RUNTIME_DIR/moe-l2d.sock)")
    parser.add_argument("--runtime-dir", type=path_arg, help="directory for the socket and lock file")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="least severe messages logged (default info)")
    parser.add_argument("--shm-mode", default=None, help="octal mode of the segments (default 600)")
    parser.add_argument("--loader-threads", type=int, default=None, help="parallel loads (default 4)")
    parser.add_argument("--socket-mode", default=None,
                        help="octal mode of the ipc socket: 600 (default: the daemon's user only) or 660 "
                             "(also --socket-group, else the daemon's group)")
    parser.add_argument("--socket-group", default=None, help="group (name or id) of the ipc socket")
    parser.add_argument("--curve-secret-key", type=Path, default=None, metavar="FILE",
                        help="tcp:// only: the daemon's CurveZMQ certificate with its secret key "
                             "(zmq.auth.create_certificates); with --curve-clients, allows non-loopback addresses")
    parser.add_argument("--curve-clients", type=Path, default=None, metavar="DIR",
                        help="directory of the public certificates of the clients allowed to connect over CurveZMQ")
    parser.add_argument("--version", action="version", version=f"moe-l2d {__version__}")
    return parser


def _octal(value: str | int) -> int:
    """The mode from a flag or a TOML string ("640", octal digits) or a TOML integer (0o640)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"shm mode {value!r} must be octal digits such as \"640\" or a TOML octal integer "
                          "such as 0o640")
    if isinstance(value, int):
        mode, shown = value, f"{value:#o}"
    else:
        try:
            mode, shown = int(value, 8), repr(value)
        except ValueError:
            raise ConfigError(f"shm mode {value!r} is not an octal number such as 600 or 640") from None
    if mode & ~0o666 or not mode & 0o600 == 0o600:
        # TOML reads shm_mode = 640 as the decimal number 640 (0o1200): say how to write the octal mode.
        decimal = isinstance(value, int) and all(c in "01234567" for c in str(value))
        raise ConfigError(f"shm mode {shown} must give the owner read and write and nothing executable"
                          + (f" (TOML reads shm_mode = {value} as a decimal number: write shm_mode = 0o{value} "
                             f"or \"{value}\")" if decimal else ""))
    if mode & 0o022:
        raise ConfigError(f"shm mode {shown} lets others write the segments, and clients refuse such "
                          "segments (docs/security.md): use 600, 640 or 644")
    return mode


def _socket_mode(value: str | int) -> int:
    mode = value if isinstance(value, int) else int(value, 8) if str(value).isdigit() else -1
    if mode not in (0o600, 0o660):
        raise ConfigError(f"socket mode {value!r} must be 600 (the daemon's user only) or 660 (its group "
                          "too): other users connect only through a group (docs/security.md)")
    return mode


def _group(value: str | int | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ConfigError(f"socket group {value!r} does not exist: create it (groupadd) or give a gid") from None


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


def _path(value, what: str, kind: str = "a file name") -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be {kind} (a string), got {value!r}")
    try:
        return expand_path(value)
    except PathError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _parsed(value, what: str, example: str, parse, errors):
    """parse(value) for a string value, any other or one that `parse` refuses a ConfigError naming `what`."""
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string such as {example}, got {value!r}")
    try:
        return parse(value)
    except errors as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _socket(value, what: str) -> str:
    return _parsed(value, what, "ipc://PATH", expand_socket, PathError)


def _direct_io(value, what: str) -> bool | None:
    if value not in DIRECT_IO:
        raise ConfigError(f"{what} must be one of {', '.join(DIRECT_IO)}, got {value!r}")
    return DIRECT_IO[value]


def _size(text, what: str) -> int | None:
    if text == "auto":
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _layers(text, what: str) -> tuple[tuple[int, int], ...] | None:
    return None if text is None else _parsed(text, what, "\"0-23\" (decoder layer ranges)", parse_ranges, ValueError)


def _per_model(values: list, flag: str, key: str, models: list) -> list:
    """A flag given once for all --model or once per --model, as one value (or None) per --model."""
    if values and not models:
        raise ConfigError(f"{flag} needs a --model to apply to (in a config file, set {key} in [[model]])")
    if values and len(values) not in (1, len(models)):
        raise ConfigError(f"give {flag} once, or once per --model ({len(models)} models, {len(values)} {flag})")
    return values * len(models) if len(values) == 1 else (values or [None] * len(models))


def resolve(args: argparse.Namespace) -> DaemonConfig:
    """Merge the TOML file (if any) with the flags; flags win."""
    table = _load_toml(args.config) if args.config else {}
    known = {"model", "socket", "runtime_dir", "log_level", "shm_mode", "loader_threads", "policy", "direct_io",
             "socket_mode", "socket_group", "curve_secret_key", "curve_clients",
             "processes", "memory_floor", "metrics", "metrics_public"}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"unknown key(s) in {args.config}: {', '.join(sorted(unknown))}")
    default_policy = args.policy or table.get("policy", DEFAULT_POLICY)
    default_direct = _direct_io(args.direct_io or table.get("direct_io", "auto"), "direct_io")
    models = []
    entries = table.get("model", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"model in {args.config} must be [[model]] tables, each with a path and a budget")
    for entry in entries:
        if "path" not in entry or "budget" not in entry:
            raise ConfigError(f"every [[model]] in {args.config} needs a path and a budget")
        unknown = set(entry) - set(MODEL_KEYS)
        if unknown:
            raise ConfigError(f"unknown key(s) in the [[model]] of {entry['path']} in {args.config}: "
                              f"{', '.join(sorted(unknown))} (known: {', '.join(MODEL_KEYS)})")
        path = _path(entry["path"], f"path of a [[model]] in {args.config}",
                     "a model directory or a Hugging Face repo id")
        profile = entry.get("profile")
        if profile is not None:
            profile = _path(profile, f"profile of {entry['path']} in {args.config}")
        direct = _direct_io(entry["direct_io"], f"direct_io of {entry['path']}") if "direct_io" in entry \
            else default_direct
        models.append(ModelConfig(path, _size(entry["budget"], f"budget of {entry['path']}"),
                                  entry.get("policy", default_policy), profile, direct,
                                  _layers(entry.get("layers"), f"layers of {entry['path']}")))
    profiles = _per_model(getattr(args, "profile", None) or [], "--profile", "profile", args.model)
    layers = _per_model(getattr(args, "layers", None) or [], "--layers", "layers", args.model)
    if args.model:
        if not args.budget:
            raise ConfigError("--budget is required with --model, e.g. --budget 8GiB")
        if len(args.budget) not in (1, len(args.model)):
            raise ConfigError(f"give --budget once, or once per --model ({len(args.model)} models, "
                              f"{len(args.budget)} budgets)")
        budgets = args.budget * len(args.model) if len(args.budget) == 1 else args.budget
        models += [ModelConfig(path, _size(b, "--budget"), default_policy, profile, default_direct,
                               _layers(served, "--layers"))
                   for path, b, profile, served in zip(args.model, budgets, profiles, layers)]
    elif args.budget:
        raise ConfigError("--budget needs a --model to apply to")
    if not models:
        raise ConfigError("nothing to serve: give --model DIR --budget SIZE, or --config FILE")
    for m in models:
        if m.policy not in POLICIES:
            raise ConfigError(f"unknown policy {m.policy!r} for {m.path}; choose one of {', '.join(POLICIES)}")
    directory = args.runtime_dir or (_path(table["runtime_dir"], "runtime_dir", "a directory") if "runtime_dir" in table
                                     else runtime_dir())
    socket = args.socket or (_socket(table["socket"], "socket") if "socket" in table else None) \
        or f"ipc://{directory / SOCKET_NAME}"
    if not socket.startswith(("ipc://", "tcp://")):
        raise ConfigError(f"socket {socket!r} must be ipc://PATH or tcp://HOST:PORT")
    curve = _curve(args.curve_secret_key or table.get("curve_secret_key"),
                   args.curve_clients or table.get("curve_clients"), socket)
    if socket.startswith("tcp://") and curve is None:
        check_tcp(socket)
    # sun_path holds 108 bytes on Linux and 104 on macOS.
    if socket.startswith("ipc://") and len(socket[len("ipc://"):].encode()) > 100:
        raise ConfigError(f"ipc socket path {socket[6:]!r} is longer than 100 bytes; choose a shorter "
                          "--runtime-dir or --socket")
    threads = args.loader_threads or table.get("loader_threads", 4)
    if not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"loader threads must be a positive integer, got {threads!r}")
    log_level = args.log_level or table.get("log_level", "info")
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"log level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if any(m.budget is None for m in models) and len(models) > 1:
        raise ConfigError("budget auto sizes one model's L2 from the machine's memory; with several models give "
                          "each a size (moe-l2 plan --model DIR prints one)")
    processes = args.processes if args.processes is not None else table.get("processes", 1)
    if not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"processes must be a positive integer, got {processes!r}")
    floor = args.memory_floor or table.get("memory_floor")
    floor = 0 if floor == "off" else None if floor is None else _size(floor, "memory floor")  # auto: the default
    metrics = args.metrics or table.get("metrics")
    return DaemonConfig(
        models=tuple(models), runtime_dir=directory, socket=socket, log_level=log_level,
        shm_mode=_octal(args.shm_mode or table.get("shm_mode", "600")), loader_threads=threads,
        socket_mode=_socket_mode(args.socket_mode or table.get("socket_mode", 0o600)),
        socket_group=_group(args.socket_group or table.get("socket_group")), curve=curve,
        processes=processes, memory_floor=floor,
        metrics=_metrics_address(metrics, args.metrics_public or table.get("metrics_public", False))
        if metrics else None)


def _metrics_address(text: str, public: bool) -> tuple[str, int]:
    """HOST:PORT; a loopback host unless `public`: the figures name models, paths and clients
    (docs/architecture.md, "A live view and metrics")."""
    host, _, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"metrics address {text!r} must be HOST:PORT, e.g. 127.0.0.1:9464")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not public:
        raise ConfigError(f"metrics address {text!r} is reachable from other hosts, and the metrics name "
                          "models, paths and clients: use 127.0.0.1:PORT, or add --metrics-public "
                          "(metrics_public = true) if that is meant")
    return host, int(port)
