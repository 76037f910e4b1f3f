"""`moe-l2 service install|status|uninstall`: moe-l2d as a service of this machine, started by its first client.

install writes the socket and service units and the daemon's TOML (systemd), or a LaunchAgent/LaunchDaemon
plist and the TOML (launchd), from daemon/service_files.py, and enables them. Its flags are the daemon's own
(OPTIONS), checked by the daemon's own checks. It replaces and removes only files it wrote (they carry
service_files.MARKER), and where it cannot act it says why and what to do instead.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

from moe_l2.atomic_file import AtomicFile
from moe_l2.daemon import service_files as files
from moe_l2.daemon.config import MODEL, OPTIONS, ConfigError, DaemonConfig, File, add_flags, resolve
from moe_l2.daemon.service_files import LABEL, MARKER, SYSTEM, UNIT, USER, Service
from moe_l2.model import ModelFiles
from moe_l2.model.location import expand_path, resolve_model
from moe_l2.runtime import SOCKET_NAME, SYSTEM_DIRS, login_agent_dir

# Where the service's socket is, the service decides: where its clients look (src/moe_l2/runtime.py).
SET_BY_THE_SERVICE = ("socket", "runtime_dir")
FLAGS = tuple(o for o in OPTIONS if o.name not in SET_BY_THE_SERVICE)
# A daemon for the whole machine serves other users: its socket and segments open to its group.
SYSTEM_DEFAULTS = {"socket_mode": "660", "shm_mode": "640"}
SCOPES = {USER: "a service of your user (the default unless root)",
          SYSTEM: "a service of the whole machine, run as its own account (the default as root)"}
USERADD = "sudo useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin"


class Refused(RuntimeError):
    """What this command cannot do here, and what to do instead."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="install|status|uninstall",
                                    help="install: write and enable the service; status: its files and state; "
                                         "uninstall: disable it and remove what install wrote")
    for action, text in (("install", "write moe-l2d's service files for this machine and enable them: the "
                                     "first client starts the daemon"),
                         ("status", "the service's files and its state (asks the service manager, never the "
                                    "daemon, so that it starts nothing)"),
                         ("uninstall", "stop and disable the service and remove the files install wrote")):
        p = actions.add_parser(action, help=text, description=text)
        scope = p.add_mutually_exclusive_group()
        for name, meaning in SCOPES.items():
            scope.add_argument(f"--{name}", dest="scope", action="store_const", const=name, help=meaning)
        if action == "install":
            p.add_argument("--dry-run", action="store_true", help="print the files and commands; change nothing")
            add_flags(p, FLAGS)


def run(args: argparse.Namespace) -> int:
    scope = args.scope or (SYSTEM if os.geteuid() == 0 else USER)
    try:
        if sys.platform.startswith("linux"):
            manager = Systemd(scope)
        elif sys.platform == "darwin":
            manager = Launchd(scope)
        else:
            raise Refused(f"moe-l2 knows no service manager on {sys.platform}: run moe-l2d --config FILE under "
                          "yours")
        return {"install": install, "status": status, "uninstall": uninstall}[args.action](manager, args)
    except Refused as exc:
        print(f"moe-l2 service {args.action}: cannot: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"moe-l2 service {args.action}: error: {exc}", file=sys.stderr)
        return 2


def home() -> Path:
    """The user's home from the password database, as the daemon's clients find it (moe_l2.runtime)."""
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def user_config_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or home() / ".config")


def ours(path: Path) -> bool:
    try:
        return MARKER in path.read_text(errors="replace")
    except OSError:
        return False


def program() -> str:
    """This installation's moe-l2d: beside the interpreter (a venv, pipx), else on PATH."""
    beside = Path(sys.executable).parent / "moe-l2d"
    found = str(beside) if beside.exists() else shutil.which("moe-l2d")
    if found is None:
        raise Refused(f"no moe-l2d beside {sys.executable} or on PATH: install mlx-moe-l2 into this environment first")
    return os.path.abspath(found)


def execute(command: list[str], check: bool = True, hint: str = "") -> subprocess.CompletedProcess:
    print("$ " + " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise Refused(f"{' '.join(command)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}"
                      + (f"; {hint}" if hint else ""))
    return done


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class Systemd:
    name = "systemd"

    def __init__(self, scope: str):
        self.scope = scope
        self.account = files.ACCOUNTS[self.name]
        self.ctl = ["systemctl", *(["--user"] if scope == USER else [])]
        self.unit_dir = Path("/etc/systemd/system") if scope == SYSTEM else user_config_dir() / "systemd" / "user"
        self.config = files.SYSTEM_CONFIG["systemd"] if scope == SYSTEM else \
            user_config_dir() / "moe-l2" / "moe-l2d.toml"
        runtime = SYSTEM_DIRS[0] if scope == SYSTEM else \
            Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}") / files.SYSTEMD_RUNTIME
        self.socket = runtime / SOCKET_NAME
        self.units = [self.unit_dir / f"{UNIT}.socket", self.unit_dir / f"{UNIT}.service"]
        self.restart = f"{' '.join(self.ctl)} restart {UNIT}"
        self.logs = f"journalctl {'--user ' if scope == USER else ''}-u {UNIT}"
        self.hint = f"{' '.join(self.ctl)} status {UNIT}.socket and {self.logs} say more"

    def service(self, config: DaemonConfig) -> Service:
        account = self.account if self.scope == SYSTEM else None
        group = group_name(config.socket_group) if config.socket_group is not None else account
        return Service(self.scope, program(), self.config, config.socket_mode, account, group)

    def files(self, service: Service) -> dict[Path, str]:
        return dict(zip(self.units, (files.systemd_socket(service), files.systemd_service(service))))

    def unreachable(self) -> str | None:
        """Why systemd cannot be asked here, and what to do instead; None when it can."""
        if shutil.which("systemctl") is None:
            return ("this machine has no systemctl: run moe-l2d --config FILE under its init system (--dry-run "
                    "prints the config to start from)")
        if self.scope == USER:
            return self._user_manager_problem()
        if not os.path.isdir("/run/systemd/system"):
            return ("systemd is not this machine's init (there is no /run/systemd/system: a container?): run "
                    "moe-l2d --config FILE under the init it has (--dry-run prints the config to start from)")
        return None

    def account_problem(self) -> str | None:
        if self.scope == USER:
            return None
        try:
            pwd.getpwnam(self.account)
        except KeyError:
            return (f"there is no account {self.account} for the daemon yet: create it ({USERADD} {self.account}), "
                    "then run this again")
        return None

    def _user_manager_problem(self) -> str | None:
        probe = subprocess.run([*self.ctl, "show-environment"], capture_output=True, text=True)
        if probe.returncode == 0:
            return None
        user = pwd.getpwuid(os.getuid()).pw_name
        return (f"no systemd user instance runs for {user} ({' '.join(self.ctl)} says: "
                f"{(probe.stderr or probe.stdout).strip()}). Log in through a session that starts one (a desktop "
                "or ssh login; after su or sudo, XDG_RUNTIME_DIR and the bus are not yours), or keep one running "
                f"without a login: sudo loginctl enable-linger {user}. Or install for the whole machine: sudo "
                "moe-l2 service install --system with the same options")

    def commands(self) -> list[list[str]]:
        # try-restart: a daemon already running (installed before) takes the new config.
        return [[*self.ctl, "daemon-reload"], [*self.ctl, "enable", "--now", f"{UNIT}.socket"],
                [*self.ctl, "try-restart", f"{UNIT}.service"]]

    def prepare(self, service: Service) -> None:
        """Nothing: the socket unit makes the runtime dir, and the journal keeps the log."""

    def disable(self) -> None:
        execute([*self.ctl, "disable", "--now", f"{UNIT}.socket", f"{UNIT}.service"], check=False)

    def forget(self) -> None:
        execute([*self.ctl, "daemon-reload"], check=False)

    def state(self) -> list[str]:
        lines = []
        for unit in (f"{UNIT}.socket", f"{UNIT}.service"):
            enabled, active = (subprocess.run([*self.ctl, verb, unit], capture_output=True, text=True).stdout.strip()
                               or "unknown" for verb in ("is-enabled", "is-active"))
            lines.append(f"{unit}: {enabled}, {active}")
        return lines


class Launchd:
    name = "launchd"

    def __init__(self, scope: str):
        self.scope = scope
        self.account = files.ACCOUNTS[self.name]
        system = scope == SYSTEM
        self.plist = (Path("/Library/LaunchDaemons") if system else home() / "Library" / "LaunchAgents") / \
            f"{LABEL}.plist"
        self.units = [self.plist]
        self.config = files.SYSTEM_CONFIG["launchd"] if system else user_config_dir() / "moe-l2" / "moe-l2d.toml"
        self.runtime_dir = SYSTEM_DIRS[1] if system else login_agent_dir(home())
        self.socket = self.runtime_dir / SOCKET_NAME
        self.log = (Path("/Library/Logs") if system else home() / "Library" / "Logs") / "moe-l2" / "moe-l2d.log"
        self.domain = "system" if system else f"gui/{os.getuid()}"
        self.restart = f"launchctl kickstart -k {self.domain}/{LABEL}"
        self.logs = f"tail -f {self.log}"
        self.hint = ("a user's agents load into gui/UID, which exists only while that user is logged in at the Mac "
                     "(not over ssh alone): log in there, or install with --system" if not system else "")

    def service(self, config: DaemonConfig) -> Service:
        """launchd's socket keys take ids, so the account must exist even for --dry-run."""
        account = self.account if self.scope == SYSTEM else None
        try:
            owner = pwd.getpwnam(account) if account else pwd.getpwuid(os.getuid())
        except KeyError:
            raise Refused(f"there is no account {account} for the daemon yet: create it as systemd/README.md shows "
                          "(dscl), then run this again") from None
        gid = config.socket_group if config.socket_group is not None else owner.pw_gid
        return Service(self.scope, program(), self.config, config.socket_mode, account,
                       group_name(gid) if account or config.socket_group is not None else None,
                       runtime_dir=self.runtime_dir, state_dir=files.SYSTEM_STATE_DIR if account else None,
                       log=self.log, owner=(owner.pw_uid, gid))

    def files(self, service: Service) -> dict[Path, str]:
        return {self.plist: files.launchd_plist(service)}

    def account_problem(self) -> None:
        """None: service() needs the account's ids, and refuses without it."""

    def unreachable(self) -> None:
        """None: every Mac has launchctl (bootstrap says when a login session has no GUI domain)."""

    def commands(self) -> list[list[str]]:
        return [["launchctl", "enable", f"{self.domain}/{LABEL}"],
                ["launchctl", "bootstrap", self.domain, str(self.plist)]]

    def prepare(self, service: Service) -> None:
        """launchd makes neither the socket's directory, nor the log's, nor a system daemon's state dir; and bootstrap refuses a label already
        loaded, so an earlier install's job is booted out first."""
        made = [(self.runtime_dir, service.directory_mode), (self.log.parent, 0o755)]
        if service.state_dir is not None:
            made.append((service.state_dir, 0o700))
        for directory, mode in made:
            directory.mkdir(mode=mode, parents=True, exist_ok=True)
            os.chown(directory, *service.owner)
            os.chmod(directory, mode)
        self.disable()

    def disable(self) -> None:
        execute(["launchctl", "bootout", f"{self.domain}/{LABEL}"], check=False)

    def forget(self) -> None:
        """bootout forgot the job; its socket file would still send clients to it."""
        if self.socket.is_socket():
            self.socket.unlink()

    def state(self) -> list[str]:
        done = subprocess.run(["launchctl", "print", f"{self.domain}/{LABEL}"], capture_output=True, text=True)
        if done.returncode != 0:
            return [f"{self.domain}/{LABEL}: not loaded"]
        shown = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith(("state =", "pid ="))]
        return [f"{self.domain}/{LABEL}: {', '.join(shown) or 'loaded'}"]


# ---- install ------------------------------------------------------------------------------------------------

def daemon_options(args: argparse.Namespace, scope: str, socket: Path) -> tuple[DaemonConfig, dict, list[dict]]:
    """The daemon's options as `args` give them, the system scope's defaults added, checked by the daemon's own
    checks with the service's `socket`: the config, and the top-level keys and one table per model as the flags
    spelled them, paths made absolute and models resolved to their directories (the service runs with another
    working dir and cache)."""
    if not args.model:
        raise ConfigError("install needs the models to serve: --model DIR --budget SIZE (repeat for several)")
    for name, value in SYSTEM_DEFAULTS.items() if scope == SYSTEM else ():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for o in FLAGS:
        given = getattr(args, o.dest)
        if isinstance(o.kind, File) and given is not None:
            try:
                absolute = [_absolute(o.name, v) for v in given] if o.scope == MODEL else _absolute(o.name, given)
            except ValueError as exc:
                raise ConfigError(f"{o.option}: {exc}") from None
            setattr(args, o.dest, absolute)
    given = {o.dest: getattr(args, o.dest, None) for o in OPTIONS}
    config = resolve(argparse.Namespace(**{**given, "config": None, "socket": f"ipc://{socket}"}))
    top = {o.name: getattr(args, o.dest) for o in FLAGS if o.scope != MODEL and getattr(args, o.dest) is not None}
    models = [{} for _ in args.model]
    for o in (o for o in FLAGS if o.scope == MODEL and getattr(args, o.dest)):
        values = getattr(args, o.dest)  # once for all models, or once each: resolve checked which
        for model, value in zip(models, values * len(models) if len(values) == 1 else values):
            model[o.name] = value
    return config, top, models


def _absolute(name: str, value: str) -> str:
    """A path the service can use from anywhere; a model is opened once here, as the daemon will open it, so
    that one it cannot serve is refused now rather than at the first client."""
    if name != "path":
        return os.path.abspath(expand_path(value))
    directory = resolve_model(value).absolute()  # a repo id: its directory in this user's cache
    try:
        ModelFiles.open(directory)
    except OSError as exc:
        raise ValueError(f"cannot read {directory}: {exc}") from None
    return str(directory)


def root_problem(manager) -> str | None:
    if manager.scope == SYSTEM and os.geteuid() != 0:
        return ("a service of the whole machine is installed and removed as root: run this again with sudo (or "
                "--user for a service of your own)")
    return None


def planned(manager, args: argparse.Namespace) -> tuple[Service, dict[Path, str]]:
    """The service `args` ask for, and every file it needs (path -> text)."""
    config, top, models = daemon_options(args, manager.scope, manager.socket)
    service = manager.service(config)
    return service, {**manager.files(service), manager.config: files.config_toml(top, models, manager.restart)}


def install(manager, args: argparse.Namespace) -> int:
    if not args.dry_run and (problem := root_problem(manager) or manager.unreachable() or manager.account_problem()):
        raise Refused(problem)
    service, written = planned(manager, args)
    if args.dry_run:
        for path, text in written.items():
            print(f"==> {path} <==\n{text}")
        print("==> then <==\n" + "\n".join(" ".join(c) for c in manager.commands()))
        return 0
    foreign = [str(p) for p in written if p.exists() and not ours(p)]
    if foreign:
        raise Refused(f"{', '.join(foreign)} exist and were not written by moe-l2 service install, which replaces "
                      "only its own files: move them away (a unit copied by hand from systemd/: disable it first), "
                      "then run this again")
    for path, text in written.items():
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        with AtomicFile(path, 0o644) as f:
            f.write(text.encode())
        print(f"wrote {path}")
    manager.prepare(service)
    for command in manager.commands():
        execute(command, hint=manager.hint)
    print(f"moe-l2d is installed as a {manager.scope} service ({manager.name}): the first client to connect to "
          f"{manager.socket} starts it (moe-l2 stats, generate, serve). Its log: {manager.logs}; after editing "
          f"{manager.config}: {manager.restart}")
    if service.account:
        print(f"Users in group {service.group} may connect: sudo usermod -aG {service.group} USER (from their next "
              "login)")
        warn_if_hidden(service.account, [service.program, os.path.realpath(sys.executable)])
    return 0


def warn_if_hidden(account: str, paths: list[str]) -> None:
    """A service account runs moe-l2d from this installation: say so when a directory on the way is closed to
    other users (a venv under /root or a home), since the daemon would then fail to start at the first client.
    Only a warning: a group or an ACL may still let the account in."""
    for path in paths:
        for directory in Path(path).parents:
            if not os.stat(directory).st_mode & 0o001:
                print(f"warning: {path} lies in {directory} (mode {os.stat(directory).st_mode & 0o777:o}), which "
                      f"{account} may not be able to enter: install mlx-moe-l2 where every user can read it (e.g. a "
                      "venv in /opt/moe-l2, systemd/README.md)", file=sys.stderr)
                return


# ---- status and uninstall -----------------------------------------------------------------------------------

def status(manager, args: argparse.Namespace) -> int:
    paths = [*manager.units, manager.config]
    print(f"moe-l2d as a {manager.scope} service ({manager.name}), socket {manager.socket}:")
    for path in paths:
        mark = "written by moe-l2 service install" if ours(path) else "not ours" if path.exists() else "missing"
        print(f"  {path}: {mark}")
    problem = manager.unreachable()
    for line in [f"cannot ask {manager.name}: {problem}"] if problem else manager.state():
        print(f"  {line}")
    installed = all(ours(path) for path in paths)
    if not installed:
        print(f"not installed: moe-l2 service install --{manager.scope} --model DIR --budget SIZE")
    return 0 if installed else 1


def uninstall(manager, args: argparse.Namespace) -> int:
    if problem := root_problem(manager) or manager.unreachable():
        raise Refused(problem)
    manager.disable()
    for path in (*manager.units, manager.config):
        if ours(path):
            path.unlink()
            print(f"removed {path}")
        elif path.exists():
            print(f"left {path}: moe-l2 service install did not write it")
    manager.forget()
    return 0
