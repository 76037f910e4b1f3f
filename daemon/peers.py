"""Who is at the other end of a local socket, and when that process is gone.

`peer_credentials` asks the kernel (SO_PEERCRED on Linux; LOCAL_PEERCRED and LOCAL_PEERPID on macOS) for the uid
and pid of the process that connected: what the fill desk (daemon/fills.py) lets write into L2, and whose exit it
waits for; `peer_uid` for the uid alone, by which the gate (daemon/gate.py) caps connections. `ExitWatch` is a
descriptor that becomes readable once that process has exited: a pidfd on Linux (os.pidfd_open), a kqueue with
EVFILT_PROC NOTE_EXIT on macOS. A pid taken at connect may be reused only once its process is gone; a watch opened
after that waits for the new process instead, which only keeps a reservation longer, never frees one early
(docs/security.md, "Who may write L2").
"""

from __future__ import annotations

import os
import select
import socket
import struct
from dataclasses import dataclass

# <sys/un.h> on macOS and the BSDs: SOL_LOCAL level options; struct xucred {u_int version; uid_t uid; ...}.
SOL_LOCAL, LOCAL_PEERCRED, LOCAL_PEERPID, XUCRED_BYTES = 0, 1, 2, 76


@dataclass(frozen=True)
class Credentials:
    uid: int
    pid: int


def peer_credentials(sock: socket.socket) -> Credentials | None:
    """The connecting process' uid and pid, from the kernel; None where it cannot say (not a local socket)."""
    try:
        if hasattr(socket, "SO_PEERCRED"):
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            return Credentials(uid, pid)
        uid = struct.unpack_from("=II", sock.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, XUCRED_BYTES))[1]
        pid = struct.unpack("i", sock.getsockopt(SOL_LOCAL, LOCAL_PEERPID, 4))[0]
        return Credentials(uid, pid)
    except OSError:
        return None


def peer_uid(sock: socket.socket) -> int | None:
    """The connecting process' uid, from the kernel; None where it cannot say (not a local socket)."""
    try:
        if hasattr(socket, "SO_PEERCRED"):
            cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return struct.unpack("3i", cred)[1]
        return struct.unpack_from("=II", sock.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, XUCRED_BYTES))[1]
    except OSError:
        return None


class ExitWatch:
    """A descriptor readable once process `pid` has exited (OSError where it cannot be watched, e.g. it is gone
    already: ProcessLookupError)."""

    def __init__(self, pid: int):
        self.pid = pid
        if hasattr(os, "pidfd_open"):
            self._fd = os.pidfd_open(pid)
            self._kqueue = None
        else:
            self._kqueue = select.kqueue()
            try:
                self._kqueue.control([select.kevent(pid, filter=select.KQ_FILTER_PROC, flags=select.KQ_EV_ADD,
                                                    fflags=select.KQ_NOTE_EXIT)], 0, 0)
            except OSError:
                self._kqueue.close()
                raise
            self._fd = self._kqueue.fileno()

    def fileno(self) -> int:
        return self._fd

    def exited(self) -> bool:
        """Whether the process is gone (without blocking)."""
        return bool(select.select([self._fd], [], [], 0)[0])

    def close(self) -> None:
        if self._kqueue is not None:
            self._kqueue.close()
        else:
            os.close(self._fd)
