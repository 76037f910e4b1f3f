"""moe-l2d's service files, made in one place: systemd's socket and service units, launchd's plist, and the
daemon's TOML config. `moe-l2 service install` writes them for this machine; the copies in systemd/ are the
system scope's with the paths of systemd/README.md (`shipped_files`; tests/test_service_files.py checks that
they agree). The socket's path, mode and group come from the daemon's options, and the daemon refuses a socket
that differs (daemon/activation.py). docs/architecture.md, "Runtime directory".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from moe_l2.control import SERVICE_USERS
from moe_l2.runtime import SOCKET_NAME, SYSTEM_DIRS

from moe_l2.daemon.activation import SOCKET_NAME as HANDED_NAME

SYSTEM, USER = "system", "user"
UNIT = "moe-l2d"  # moe-l2d.service and moe-l2d.socket
LABEL = "com.moe-l2.moe-l2d"  # the launchd job
# What the files `moe-l2 service install` writes say of themselves: it replaces and removes only files that
# say so, never one someone else wrote.
MARKER = "Written by `moe-l2 service install`"
INSTALLED = f"{MARKER}; `moe-l2 service uninstall` removes it."
SHIPPED = "Made by daemon/service_files.py; `moe-l2 service install` writes it for the machine it runs on."
# %t/moe-l2: /run/moe-l2 for the system's manager, $XDG_RUNTIME_DIR/moe-l2 for a user's, where clients look.
SYSTEMD_RUNTIME = SYSTEM_DIRS[0].name
# A system service's config; where systemd/README.md installs moe-l2d by hand, and the id it gives _moe-l2.
SHIPPED_PROGRAM = "/usr/local/bin/moe-l2d"
SYSTEM_CONFIG = {"systemd": Path("/etc/moe-l2/moe-l2d.toml"), "launchd": Path("/usr/local/etc/moe-l2/moe-l2d.toml")}
SHIPPED_MACOS_ID = 480
# A macOS system daemon's state dir (warm_start): made at install, owned by _moe-l2, 0700.
SYSTEM_STATE_DIR = Path("/usr/local/var/lib/moe-l2")
# A system service's account, per manager: the accounts clients trust like root (Linux's, then macOS').
ACCOUNTS = dict(zip(("systemd", "launchd"), SERVICE_USERS))


@dataclass(frozen=True)
class Service:
    """One installation of moe-l2d as a service: what its files say."""

    scope: str  # SYSTEM or USER
    program: str  # moe-l2d
    config: Path  # its TOML
    socket_mode: int  # the daemon's socket_mode, as the manager creates the socket
    account: str | None  # the system scope's account (moe-l2, _moe-l2); None: the installing user
    group: str | None  # the socket's group (socket_group, else the account's); None: the user's own
    header: str = INSTALLED
    # launchd has no RuntimeDirectory= and no %t: the literal places, and the ids the socket file gets.
    runtime_dir: Path | None = None
    state_dir: Path | None = None  # a system daemon's (its account has no home); an agent's is platformdirs'
    log: Path | None = None
    owner: tuple[int, int] | None = None  # (uid, gid) of the socket file

    @property
    def directory_mode(self) -> int:
        """The runtime dir's: open to all where others connect (the socket's own mode decides who may)."""
        return 0o755 if self.scope == SYSTEM or self.socket_mode & 0o070 else 0o700


# ---- systemd ------------------------------------------------------------------------------------------------

def systemd_socket(s: Service) -> str:
    owner = [f"SocketUser={s.account}"] if s.account else []
    group = [f"SocketGroup={s.group}"] if s.group else []
    return "\n".join([
        f"# {s.header}",
        "# moe-l2d's socket: systemd listens here and starts moe-l2d.service on the first connection. Clients that",
        "# connect before the daemon is ready wait in the backlog and are served once it is. The daemon checks the",
        "# socket it is handed against its options (socket_mode, socket_group) and refuses one that differs.",
        "",
        "[Unit]",
        "Description=moe-l2 expert cache daemon's socket",
        "",
        "[Socket]",
        "# %t: /run for the system, $XDG_RUNTIME_DIR for a user; where clients look for the daemon.",
        f"ListenStream=%t/{SYSTEMD_RUNTIME}/{SOCKET_NAME}",
        f"FileDescriptorName={HANDED_NAME}",
        *owner, *group,
        f"SocketMode={s.socket_mode:04o}",
        "# Stopped (uninstalled), the socket leaves no file behind for clients to find and wait on.",
        "RemoveOnStop=yes",
        "# The directory, where the socket makes it before the daemon first runs; the service's",
        "# RuntimeDirectory= then gives it to the daemon's account.",
        f"DirectoryMode={s.directory_mode:04o}",
        "",
        "[Install]",
        "WantedBy=sockets.target",
        "",
    ])


_LIFECYCLE = """\
Type=notify
# READY=1 comes from the Python process itself, never from a child.
NotifyAccess=main
ExecStart={program} --config {config}
# Restart after a crash or a kill (a signal, e.g. SIGSEGV, SIGBUS or the OOM killer's SIGKILL), not after
# the daemon exits by itself: it does that only for a configuration or start-up error it has logged
# (exit status 2: bad flags or config; 1: cannot serve, e.g. a missing model, a budget the machine
# cannot back, an unsafe runtime directory, a socket that differs from its options), which a restart
# would only repeat. Same policy as the launchd plist's KeepAlive = {{Crashed = true}}.
Restart=on-abnormal
RestartSec=2s
# Start: the daemon fingerprints every model file's headers and checks free memory before READY=1;
# the clients that started it wait in the socket's backlog meanwhile.
TimeoutStartSec=2min
# Stop: on SIGTERM the daemon stops accepting, stops its loaders and unlinks its segments; the socket
# unit keeps listening, and the next client starts it again. SIGKILL after this.
TimeoutStopSec=30s
"""

_ACCOUNT = """
# A fixed system account, not DynamicUser=: clients are other users who must be in the
# daemon's group to connect to the socket and read the 0640 segments, and a dynamic uid/gid
# cannot be given members. DynamicUser= would also imply RemoveIPC=yes (below).
# useradd --system keeps the uid below SYS_UID_MAX, so logind's RemoveIPC= never applies to it.
User={account}
Group={group}
"""

_RUNTIME = """
# %t/moe-l2 (exported as $RUNTIME_DIRECTORY), where the socket unit listens: the daemon's socket, its
# lock and its segment list.
RuntimeDirectory={runtime}
RuntimeDirectoryMode={mode:04o}
# Kept when the daemon stops: the socket unit's socket lives there (removed, it could never be reached
# again), and so does the list of segments a crashed daemon leaves for the next one.
RuntimeDirectoryPreserve=yes
# %S/moe-l2 (exported as $STATE_DIRECTORY: /var/lib/moe-l2, or ~/.local/state/moe-l2 for a user unit)
# keeps what L2 held across restarts and reboots, preloaded at the next start (warm_start); private.
StateDirectory={runtime}
StateDirectoryMode=0700
"""

_SYSTEM_LIMITS = """\
# shm_open() applies the umask: 0007 keeps 0640 segments 0640.
UMask=0007

# Segment lifetime is the daemon's job on both systemd and launchd: it unlinks its segments on
# SIGTERM, and after a crash the restarted daemon reclaims what its predecessor left.
# RemoveIPC=yes would instead wipe every POSIX shm object of the account whenever the unit stops.
RemoveIPC=no

# Many model shards stay open for pread, plus one fd per segment while it is mapped.
LimitNOFILE=65536
# The daemon mlock()s its segments so that the kernel never swaps L2 out; an unprivileged account
# may lock only RLIMIT_MEMLOCK bytes (often 8 MiB), so lift the limit. Without it the daemon still
# runs, with its pages committed but unlocked, and says so in its log and in `moe-l2 stats`.
# The segments are tmpfs pages charged to this unit's cgroup: a MemoryMax= here must exceed the
# sum of all model budgets.
LimitMEMLOCK=infinity

# Hardening. /dev/shm stays writable: ProtectSystem=strict leaves /dev alone and
# PrivateDevices= bind-mounts the host's /dev/shm into the private /dev.
NoNewPrivileges=yes
CapabilityBoundingSet=
ProtectSystem=strict
ReadWritePaths=/dev/shm
# Read-only, not yes/tmpfs: models often live in home directories (the account still needs
# read permission there, e.g. through a group or an ACL).
ProtectHome=read-only
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
"""

_USER_LIMITS = """\
# A user's manager can neither raise LimitMEMLOCK= nor build the mount namespaces of the system
# unit's hardening; the daemon then runs with its pages unlocked and says so. What seccomp can
# do without privileges stays.
NoNewPrivileges=yes
"""

_FILTERS = """\
# AF_UNIX: the ipc:// socket and sd_notify. A tcp:// socket is not socket-activated: the daemon
# refuses one handed over; run it from a unit without moe-l2d.socket, with AF_INET AF_INET6 here.
RestrictAddressFamilies=AF_UNIX
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
# Safe: the daemon generates no code (it preads records into shm and memcpys); the Python,
# numpy, mlx, pyzmq, posix_ipc and psutil extensions have neither executable stacks nor text
# relocations, and mlx ops (mx.compile included) run under the kernel's MDWE. A build that
# JITs inside the daemon (a GPU backend) would need this dropped.
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
# Not narrowed further with ~@resources: BLAS/OpenMP thread pools in numpy and mlx may set CPU
# affinity and NUMA memory policy.
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
"""


def systemd_service(s: Service) -> str:
    system = s.scope == SYSTEM
    return "".join([
        f"# {s.header}\n",
        "# moe-l2d, the machine-wide L2 expert cache, started by the first client that connects to\n"
        f"# moe-l2d.socket (systemd/README.md); its options are in {s.config}.\n",
        "\n[Unit]\nDescription=moe-l2 expert cache daemon (L2, shared memory)\n",
        "# The socket unit listens before the daemon runs and hands it the listening socket.\n"
        f"Requires={UNIT}.socket\nAfter={UNIT}.socket{' local-fs.target' if system else ''}\n",
        "# Models on a network or late-mounted disk: add RequiresMountsFor=/path/to/models in a drop-in.\n",
        "\n[Service]\n",
        _LIFECYCLE.format(program=s.program, config=s.config),
        _ACCOUNT.format(account=s.account, group=s.group) if system else "",
        _RUNTIME.format(runtime=SYSTEMD_RUNTIME, mode=s.directory_mode),
        "\n", _SYSTEM_LIMITS if system else _USER_LIMITS,
        _FILTERS,
        "\n[Install]\n# Enabling the service enables its socket: the daemon starts on the first connection.\n",
        f"Also={UNIT}.socket\n",
    ])


# ---- launchd ------------------------------------------------------------------------------------------------

_PLIST = """\
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<!--
  {header}

  moe-l2d as a macOS {kind}, started by the first client that connects to its socket: launchd
  listens there, and the daemon takes the socket with launch_activate_socket, refusing one that
  differs from its options (systemd/README.md).

  Shared memory on macOS: POSIX shm names are limited to 31 characters (PSHMNAMLEN), which is why
  moe-l2 keeps every segment name that short on all platforms, and there is no /dev/shm: segments
  cannot be listed or removed by hand, only unlinked by name. Leftovers of a crash are reclaimed
  by the restarted daemon (KeepAlive below); a reboot frees them all.
-->
<plist version="1.0">
<dict>
    <key>Label</key>
    <string>{label}</string>

    <key>ProgramArguments</key>
    <array>
        <string>{program}</string>
        <string>--config</string>
        <string>{config}</string>
        <!-- launchd has no RuntimeDirectory=: this one is made once, at install, owned by the
             daemon's account, and persists (/var/run is emptied at boot, where a non-root daemon
             could not make its directory again). -->
        <string>--runtime-dir</string>
        <string>{runtime_dir}</string>{state_dir}
    </array>

    <!-- The daemon's socket. Its name is the one the daemon asks launch_activate_socket for; its
         mode, owner and group are what the daemon's own bind would give it (SockPathMode is
         decimal: 432 is 0660, 384 is 0600). -->
    <key>Sockets</key>
    <dict>
        <key>{handed}</key>
        <dict>
            <key>SockFamily</key>
            <string>Unix</string>
            <key>SockType</key>
            <string>stream</string>
            <key>SockPassive</key>
            <true/>
            <key>SockPathName</key>
            <string>{socket}</string>
            <key>SockPathMode</key>
            <integer>{mode}</integer>
            <key>SockPathOwner</key>
            <integer>{uid}</integer>
            <key>SockPathGroup</key>
            <integer>{gid}</integer>
        </dict>
    </dict>
{account}
    <!-- Not at load: the first client starts it. -->
    <key>RunAtLoad</key>
    <false/>
    <!-- Restart after a crash (a signal such as SIGSEGV or SIGBUS), not after the daemon exits by
         itself: it does that only for a configuration or start-up error it has logged (status 2:
         bad flags or config; 1: cannot serve), and SuccessfulExit = false would relaunch it every
         10 s for nothing. launchd cannot exclude chosen exit statuses; the systemd unit's
         Restart=on-abnormal is the same policy. -->
    <key>KeepAlive</key>
    <dict>
        <key>Crashed</key>
        <true/>
    </dict>
    <!-- SIGTERM, then SIGKILL after this many seconds: time to finish loads and unlink segments. -->
    <key>ExitTimeOut</key>
    <integer>30</integer>

    <!-- Not Background: that throttles CPU and disk I/O, and late preloads turn L2 hits back into
         preads in the clients. Standard is launchd's unthrottled default for daemons. -->
    <key>ProcessType</key>
    <string>Standard</string>

    <!-- launchd jobs start with a soft limit of 256 open files; model shards stay open.
         10240 stays within macOS' default kern.maxfilesperproc. -->
    <key>SoftResourceLimits</key>
    <dict>
        <key>NumberOfFiles</key>
        <integer>10240</integer>
    </dict>

    <key>StandardOutPath</key>
    <string>{log}</string>
    <key>StandardErrorPath</key>
    <string>{log}</string>
</dict>
</plist>
"""

_PLIST_ACCOUNT = """
    <!-- A dedicated account; its primary group is the clients' group, so the segments get that
         group without any chown. -->
    <key>UserName</key>
    <string>{account}</string>
    <key>GroupName</key>
    <string>{group}</string>
    <!-- 007 (decimal 7) leaves the group's bits of what the daemon makes alone. (macOS' shm_open()
         ignores the umask: segments get shm_mode as given.) -->
    <key>Umask</key>
    <integer>7</integer>
"""


_PLIST_STATE_DIR = """
        <!-- What L2 held, preloaded at the next start (warm_start): the daemon's account has no home
             to keep it in, so a directory made at install, owned by that account, mode 0700. -->
        <string>--state-dir</string>
        <string>{state_dir}</string>"""

def launchd_plist(s: Service) -> str:
    system = s.scope == SYSTEM
    text = {k: escape(str(v)) for k, v in dict(
        header=s.header, label=LABEL, program=s.program, config=s.config, runtime_dir=s.runtime_dir,
        handed=HANDED_NAME, socket=s.runtime_dir / SOCKET_NAME, log=s.log, account=s.account, group=s.group).items()}
    account = _PLIST_ACCOUNT.format(**text) if system else ""
    state_dir = "" if s.state_dir is None else _PLIST_STATE_DIR.format(state_dir=escape(str(s.state_dir)))
    return _PLIST.format(**{**text, "account": account, "state_dir": state_dir}, kind="LaunchDaemon" if system else "LaunchAgent",
                         mode=s.socket_mode, uid=s.owner[0], gid=s.owner[1])


# ---- the daemon's TOML --------------------------------------------------------------------------------------

def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value)).replace("\x7f", "\\u007f")  # a TOML basic string; TOML forbids a raw DEL


def config_toml(top: dict, models: list[dict], restart: str, header: str = INSTALLED) -> str:
    """The daemon's config: `top` keys, then one [[model]] table per model; values as flags give them."""
    lines = [f"# {header}", "# moe-l2d's options (moe-l2d --help; systemd/moe-l2d.toml.example explains each key).",
             f"# After an edit: {restart}"]
    lines += ["", *(f"{key} = {toml_value(value)}" for key, value in top.items())] if top else []
    for model in models:
        lines += ["", "[[model]]", *(f"{key} = {toml_value(value)}" for key, value in model.items())]
    return "\n".join(lines) + "\n"


# ---- what systemd/ ships ------------------------------------------------------------------------------------

def shipped_files() -> dict[str, str]:
    """systemd/'s unit, socket and plist: the system scope with systemd/README.md's paths and account."""
    linux, macos = ACCOUNTS["systemd"], ACCOUNTS["launchd"]
    systemd = Service(SYSTEM, SHIPPED_PROGRAM, SYSTEM_CONFIG["systemd"], 0o660, linux, linux, SHIPPED)
    launchd = Service(SYSTEM, SHIPPED_PROGRAM, SYSTEM_CONFIG["launchd"], 0o660, macos, macos,
                      f"{SHIPPED}\n  SockPathOwner and SockPathGroup are _moe-l2's ids ({SHIPPED_MACOS_ID} in "
                      "systemd/README.md).",
                      runtime_dir=Path("/usr/local/var/run/moe-l2"), state_dir=SYSTEM_STATE_DIR, log=Path("/Library/Logs/moe-l2/moe-l2d.log"),
                      owner=(SHIPPED_MACOS_ID, SHIPPED_MACOS_ID))
    return {f"{UNIT}.service": systemd_service(systemd), f"{UNIT}.socket": systemd_socket(systemd),
            f"{LABEL}.plist": launchd_plist(launchd)}
