"""systemd's readiness protocol (sd_notify), spoken directly: one datagram to $NOTIFY_SOCKET."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("moe-l2d")


def sd_notify(state: str) -> bool:
    """Send e.g. "READY=1"; returns False when not started by systemd with Type=notify, or it is gone.

    A supervisor that stopped listening must not stop the daemon from serving or from cleaning up.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        # Python creates sockets close-on-exec everywhere (PEP 446); SOCK_CLOEXEC is Linux-only.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", address, exc)
        return False
    return True
