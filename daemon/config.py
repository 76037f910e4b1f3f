"""moe-l2d's configuration: command-line flags, or a TOML file (the form systemd and launchd use)."""

from __future__ import annotations

import argparse
import ipaddress
import tomllib
from dataclasses import dataclass
from pathlib import Path

from moe_l2 import __version__
from moe_l2.runtime import SOCKET_NAME, runtime_dir
from moe_l2.sizes import parse_size

from moe_l2.cache.policy import DEFAULT_POLICY, POLICIES
from moe_l2.model import DIRECT_IO

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    budget: int | None  # None: "auto", sized at start by moe_l2.plan
    policy: str = DEFAULT_POLICY
    profile: Path | None = None  # domain profile from `moe-l2 profile`, loaded and checked at start
    direct_io: bool | None = None  # None: the model's default (on for packed models)


@dataclass(frozen=True)
class DaemonConfig:
    models: tuple[ModelConfig, ...]
    runtime_dir: Path
    socket: str
    log_level: str = "info"
    shm_mode: int = 0o600
    loader_threads: int = 4
    processes: int = 1  # client processes expected, for --budget auto
    memory_floor: int | None = None  # the governor's floor; None: moe_l2.plan.default_floor; 0: off
    metrics: tuple[str, int] | None = None  # Prometheus endpoint (host, port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-l2d",
        description="Keep MoE expert weights in POSIX shared memory for every inference process on this machine.")
    parser.add_argument("--config", type=Path, help="TOML file (see systemd/moe-l2d.toml.example)")
    parser.add_argument("--model", action="append", type=Path, default=[], metavar="DIR",
                        help="model directory to serve; repeat for several models")
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
    parser.add_argument("--profile", action="append", type=Path, default=[], metavar="FILE",
                        help="domain profile (moe-l2 profile) for hints; once for all models or once per --model")
    parser.add_argument("--socket", help="ZeroMQ address to bind (default ipc://RUNTIME_DIR/moe-l2d.sock)")
    parser.add_argument("--runtime-dir", type=Path, help="directory for the socket and lock file")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None)
    parser.add_argument("--shm-mode", default=None, help="octal mode of the segments (default 600)")
    parser.add_argument("--loader-threads", type=int, default=None, help="parallel loads (default 4)")
    parser.add_argument("--version", action="version", version=f"moe-l2d {__version__}")
    return parser


def _octal(text: str | int) -> int:
    if isinstance(text, int):
        return text
    try:
        mode = int(text, 8)
    except ValueError:
        raise ConfigError(f"shm mode {text!r} is not an octal number such as 600 or 640") from None
    if mode & ~0o666 or not mode & 0o600 == 0o600:
        raise ConfigError(f"shm mode {text!r} must give the owner read and write and nothing executable")
    return mode


def _load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None


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


def resolve(args: argparse.Namespace) -> DaemonConfig:
    """Merge the TOML file (if any) with the flags; flags win."""
    table = _load_toml(args.config) if args.config else {}
    known = {"model", "socket", "runtime_dir", "log_level", "shm_mode", "loader_threads", "policy", "direct_io",
             "processes", "memory_floor", "metrics", "metrics_public"}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"unknown key(s) in {args.config}: {', '.join(sorted(unknown))}")
    default_policy = args.policy or table.get("policy", DEFAULT_POLICY)
    default_direct = _direct_io(args.direct_io or table.get("direct_io", "auto"), "direct_io")
    models = []
    for entry in table.get("model", []):
        if "path" not in entry or "budget" not in entry:
            raise ConfigError(f"every [[model]] in {args.config} needs a path and a budget")
        profile = entry.get("profile")
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise ConfigError(f"profile of {entry['path']} in {args.config} must be a file name")
        direct = _direct_io(entry["direct_io"], f"direct_io of {entry['path']}") if "direct_io" in entry \
            else default_direct
        models.append(ModelConfig(Path(entry["path"]), _size(entry["budget"], f"budget of {entry['path']}"),
                                  entry.get("policy", default_policy), Path(profile) if profile else None, direct))
    profiles = getattr(args, "profile", None) or []
    if profiles and not args.model:
        raise ConfigError("--profile needs a --model to apply to (in a config file, set profile in [[model]])")
    if profiles and len(profiles) not in (1, len(args.model)):
        raise ConfigError(f"give --profile once, or once per --model ({len(args.model)} models, "
                          f"{len(profiles)} profiles)")
    if args.model:
        if not args.budget:
            raise ConfigError("--budget is required with --model, e.g. --budget 8GiB")
        if len(args.budget) not in (1, len(args.model)):
            raise ConfigError(f"give --budget once, or once per --model ({len(args.model)} models, "
                              f"{len(args.budget)} budgets)")
        budgets = args.budget * len(args.model) if len(args.budget) == 1 else args.budget
        profiles = profiles * len(args.model) if len(profiles) == 1 else (profiles or [None] * len(args.model))
        models += [ModelConfig(path, _size(b, "--budget"), default_policy, profile, default_direct)
                   for path, b, profile in zip(args.model, budgets, profiles)]
    elif args.budget:
        raise ConfigError("--budget needs a --model to apply to")
    if not models:
        raise ConfigError("nothing to serve: give --model DIR --budget SIZE, or --config FILE")
    for m in models:
        if m.policy not in POLICIES:
            raise ConfigError(f"unknown policy {m.policy!r} for {m.path}; choose one of {', '.join(POLICIES)}")
    directory = args.runtime_dir or (Path(table["runtime_dir"]) if "runtime_dir" in table else runtime_dir())
    socket = args.socket or table.get("socket") or f"ipc://{directory / SOCKET_NAME}"
    if not socket.startswith(("ipc://", "tcp://")):
        raise ConfigError(f"socket {socket!r} must be ipc://PATH or tcp://HOST:PORT")
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
