"""Where the daemon's socket lives: the same answer for the daemon, its clients and the CLI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SOCKET_NAME = "moe-l2d.sock"
# Where the service files in systemd/ put the machine-wide daemon (systemd, then launchd).
SYSTEM_DIRS = (Path("/run/moe-l2"), Path("/usr/local/var/run/moe-l2"))


def runtime_dir() -> Path:
    """$MOE_L2_RUNTIME_DIR, else systemd's $RUNTIME_DIRECTORY, else the system daemon's directory when its
    socket is there, else $XDG_RUNTIME_DIR/moe-l2, else the temp dir."""
    if os.environ.get("MOE_L2_RUNTIME_DIR"):
        return Path(os.environ["MOE_L2_RUNTIME_DIR"])
    if os.environ.get("RUNTIME_DIRECTORY"):
        # systemd may list several directories separated by ':'; ours is the first.
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    for directory in SYSTEM_DIRS:
        if (directory / SOCKET_NAME).exists():
            return directory
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "moe-l2"
    return Path(tempfile.gettempdir()) / f"moe-l2-{os.getuid()}"


def default_socket(directory: Path | None = None) -> str:
    return f"ipc://{(directory or runtime_dir()) / SOCKET_NAME}"
