"""Where the daemon's socket lives: the same answer for the daemon, its clients and the CLI.

Every process of a user must resolve the same directory, whatever shell, ssh session, sudo or cron job it
runs in, so nothing here depends on $TMPDIR: macOS sets it to a per-user folder in GUI shells only, and it
is unset (hence /tmp) under ssh, sudo and cron (docs/architecture.md, "Runtime directory").
"""

from __future__ import annotations

import hashlib
import os
import pwd
import sys
from pathlib import Path

SOCKET_NAME = "moe-l2d.sock"
# Where the service files in systemd/ put the machine-wide daemon (systemd, then launchd).
SYSTEM_DIRS = (Path("/run/moe-l2"), Path("/usr/local/var/run/moe-l2"))
# The last resort: a fixed place, not $TMPDIR. The daemon refuses it unless it owns it (daemon/main.py).
FALLBACK_PARENT = Path("/tmp")


def login_agent_dir(home: Path | None = None) -> Path:
    """Where `moe-l2 service install --user` puts a macOS login agent's socket: launchd makes it at a fixed path,
    in a directory that must outlive a reboot (/tmp does not). `home`: the user's, from the password database
    (not $HOME, which sudo may keep)."""
    return (home or Path(pwd.getpwuid(os.getuid()).pw_dir)) / "Library" / "Application Support" / "moe-l2"


def resolve_runtime_dir() -> tuple[Path, str]:
    """The runtime directory and where the answer came from (for messages):
    $MOE_L2_RUNTIME_DIR, else systemd's $RUNTIME_DIRECTORY, else the system daemon's directory when its socket
    is there, else (macOS) the login agent's when its socket is there, else $XDG_RUNTIME_DIR/moe-l2, else
    /run/user/UID/moe-l2 when the login manager made that directory (the same place as $XDG_RUNTIME_DIR, for the
    cron jobs and sudo shells that lack the variable), else /tmp/moe-l2-UID."""
    if os.environ.get("MOE_L2_RUNTIME_DIR"):
        return Path(os.environ["MOE_L2_RUNTIME_DIR"]), "$MOE_L2_RUNTIME_DIR"
    if os.environ.get("RUNTIME_DIRECTORY"):
        # systemd may list several directories separated by ':'; ours is the first.
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]), "$RUNTIME_DIRECTORY"
    for directory in SYSTEM_DIRS:
        if (directory / SOCKET_NAME).exists():
            return directory, "the system daemon's socket"
    if sys.platform == "darwin" and (login_agent_dir() / SOCKET_NAME).exists():
        return login_agent_dir(), "the login agent's socket (moe-l2 service install --user)"
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "moe-l2", "$XDG_RUNTIME_DIR"
    uid = os.getuid()
    run_user = Path(f"/run/user/{uid}")
    try:
        if run_user.is_dir() and run_user.stat().st_uid == uid:
            return run_user / "moe-l2", f"{run_user} (the login manager's runtime dir)"
    except OSError:
        pass
    return FALLBACK_PARENT / f"moe-l2-{uid}", "the fallback (no $MOE_L2_RUNTIME_DIR or $XDG_RUNTIME_DIR)"


def runtime_dir() -> Path:
    return resolve_runtime_dir()[0]


def default_socket(directory: Path | None = None) -> str:
    return f"ipc://{(directory or runtime_dir()) / SOCKET_NAME}"


def canonical_address(address: str) -> str:
    """One spelling per socket: an ipc:// path made absolute, its directory's links resolved (the socket itself
    is the daemon's to create and unlink, so its own name is kept). `ipc://moe.sock` run in /srv and
    `ipc:///srv/moe.sock` are then one daemon's, with one lock. Other addresses are kept as given."""
    if not address.startswith("ipc://"):
        return address
    directory, name = os.path.split(os.path.abspath(address[len("ipc://"):]))
    return f"ipc://{os.path.join(os.path.realpath(directory), name)}"


def instance_tag(address: str) -> str:
    """8 hex digits naming the daemon of `address` in its lock, its segment list and its segments' names."""
    return hashlib.sha1(canonical_address(address).encode()).hexdigest()[:8]


def no_daemon_message(address: str) -> str:
    """What a client that expected a daemon at `address` and found none tells its user, and what to do."""
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        found = f"no moe-l2d socket at {address[len('ipc://'):]}"
    else:
        found = f"no moe-l2d answered on {address}"
    if not address.startswith("ipc://"):  # an address given: the runtime dir played no part in it
        return (f"{found}; reading experts from the model files only: start moe-l2d with --socket {address}, or "
                "point this process at the address the daemon listens on (moe-l2 stats --socket ADDRESS asks one)")
    directory, source = resolve_runtime_dir()
    return (f"{found}; reading experts from the model files only. The runtime dir {directory} came from {source}: "
            "if moe-l2d runs, point this process at it with --socket, or set MOE_L2_RUNTIME_DIR to the daemon's "
            f"runtime dir (the system daemon's: {' or '.join(str(d) for d in SYSTEM_DIRS)})")
