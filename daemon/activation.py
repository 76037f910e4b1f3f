"""Socket activation: the listening socket a service manager made for moe-l2d, so that the first client starts
the daemon and is served once it is ready (docs/architecture.md, "Control plane").

systemd (a socket unit) passes descriptors from 3 on with $LISTEN_FDS, $LISTEN_PID and $LISTEN_FDNAMES
(sd_listen_fds(3), spoken here without libsystemd); launchd (the plist's Sockets key) hands them over through
launch_activate_socket(3) in libSystem. Connections made before the daemon is ready wait in the socket's
backlog, and the gate accepts them once it runs.

The socket is checked as strictly as one the daemon binds itself (sockets.bind_socket_file): an AF_UNIX stream
socket, listening, bound to the configured path, owned by the daemon's user, with the configured mode and, where
the mode lets a group connect, the configured group. Anything else is refused with what is wrong and the fix
(docs/security.md, "Only permitted users reach the control plane").
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import stat
import sys
from dataclasses import dataclass

from moe_l2.runtime import canonical_address

SD_LISTEN_FDS_START = 3  # <systemd/sd-daemon.h>
LISTEN_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# The name of the daemon's socket: FileDescriptorName= in moe-l2d.socket, the Sockets key of the launchd plist
# (daemon/service_files.py writes both). Among several sockets, the daemon takes the one of this name.
SOCKET_NAME = "moe-l2d"
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"


class ActivationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Handed:
    """The descriptors a service manager handed over, and their names (empty where it gave none)."""

    manager: str  # "systemd" or "launchd", for messages
    fds: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def fix(self) -> str:
        return ("check ListenStream=, SocketUser=, SocketGroup= and SocketMode= in moe-l2d.socket"
                if self.manager == "systemd" else "check the Sockets entry of the launchd plist") + \
            " (moe-l2 service install writes them from the daemon's options)"


def take() -> Handed | None:
    """The sockets this process was started with, each made close-on-exec, or None: $LISTEN_FDS, else (macOS)
    launchd's. The variables are unset, so that no child takes them for its own."""
    handed = _from_systemd(os.environ)
    if handed is None and sys.platform == "darwin":
        handed = _from_launchd(SOCKET_NAME)
    for fd in handed.fds if handed else ():
        try:
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        except OSError:
            raise ActivationError(f"{handed.manager} said it passed descriptor {fd}, but this process has no such "
                                  f"descriptor; {handed.fix}") from None
    return handed


def _from_systemd(environ) -> Handed | None:
    if "LISTEN_FDS" not in environ:
        return None
    pid, count, names = (environ.pop(name, None) for name in LISTEN_VARIABLES)
    if pid != str(os.getpid()):
        raise ActivationError(
            f"$LISTEN_FDS is set but $LISTEN_PID is {pid or 'unset'}, not this process ({os.getpid()}): the sockets "
            "were passed to another process, e.g. a wrapper that started moe-l2d instead of exec'ing it. Make "
            "moe-l2d itself the unit's ExecStart= (or exec it), or unset LISTEN_FDS LISTEN_PID LISTEN_FDNAMES to "
            "have it bind its socket itself")
    if not (count or "").isdigit() or int(count) < 1:
        raise ActivationError(f"$LISTEN_FDS is {count!r}, not a number of descriptors")
    fds = tuple(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)))
    labels = tuple(names.split(":")) if names else ("",) * len(fds)
    if len(labels) != len(fds):
        raise ActivationError(f"$LISTEN_FDNAMES names {len(labels)} sockets but $LISTEN_FDS passes {len(fds)}")
    return Handed("systemd", fds, labels)


def _from_launchd(name: str) -> Handed | None:
    """launch_activate_socket(name): None where this process is no launchd job (ESRCH) or its plist has no such
    socket (ENOENT: a plist from before socket activation; the daemon binds its socket itself)."""
    libsystem = ctypes.CDLL(LIBSYSTEM, use_errno=True)
    activate = libsystem.launch_activate_socket
    activate.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
                         ctypes.POINTER(ctypes.c_size_t)]
    activate.restype = ctypes.c_int
    fds, count = ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t(0)
    error = activate(name.encode(), ctypes.byref(fds), ctypes.byref(count))
    try:
        if error in (errno.ESRCH, errno.ENOENT):
            return None
        if error:
            raise ActivationError(f"launchd did not hand over the socket {name!r}: {os.strerror(error)}")
        return Handed("launchd", tuple(fds[i] for i in range(count.value)), (name,) * count.value)
    finally:
        if fds:
            libsystem.free(fds)  # the array is malloc'd for the caller


def listener(handed: Handed, address: str, mode: int, group: int | None) -> socket.socket:
    """The listening socket for `address` among those handed over, checked as the daemon's own bind would make
    it (`mode`, and `group` or else the daemon's where the mode lets a group connect); ActivationError says what
    is wrong and how to fix it."""
    if not address.startswith("ipc://"):
        raise ActivationError(f"{handed.manager} passed a socket, but the daemon's socket is {address}: socket "
                              "activation serves the ipc:// socket only; remove the socket unit, or give the "
                              "daemon the ipc:// socket it listens on")
    fd = _the_daemons_fd(handed)
    what = f"the socket {handed.manager} passed (descriptor {fd})"
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ActivationError(f"{what} is not a socket; {handed.fix}")
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"cannot use {what}: {exc.strerror}; {handed.fix}") from None
    try:
        _check(sock, what, address[len("ipc://"):], mode, group, handed.fix)
    except ActivationError:
        sock.detach()  # the manager's descriptor stays as it was; the daemon exits
        raise
    return sock


def _the_daemons_fd(handed: Handed) -> int:
    if len(handed.fds) == 1:
        return handed.fds[0]
    named = [fd for fd, name in zip(handed.fds, handed.names) if name == SOCKET_NAME]
    if len(named) != 1:
        names = ", ".join(map(repr, handed.names))
        raise ActivationError(f"{handed.manager} passed {len(handed.fds)} sockets ({names}), and not one named "
                              f"{SOCKET_NAME!r}: give the daemon's socket FileDescriptorName={SOCKET_NAME}, or pass "
                              "it alone")
    return named[0]


def _check(sock: socket.socket, what: str, path: str, mode: int, group: int | None, fix: str) -> None:
    if sock.family != socket.AF_UNIX:
        raise ActivationError(f"{what} is of family {_name(sock.family)}, not a unix socket (AF_UNIX) at {path}; "
                              f"{fix}")
    if sock.type != socket.SOCK_STREAM:
        raise ActivationError(f"{what} is of type {_name(sock.type)}, not a stream socket (SOCK_STREAM, "
                              f"ListenStream=); {fix}")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise ActivationError(f"{what} is not listening; {fix}")
    bound = sock.getsockname()
    if not isinstance(bound, str) or not bound or canonical_address(f"ipc://{bound}") != canonical_address(
            f"ipc://{path}"):
        raise ActivationError(f"{what} is bound to {bound!r}, but the daemon's socket is {path} (its socket and "
                              f"runtime_dir options); make them agree: {fix}")
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ActivationError(f"{what} has no file at {path}: {exc.strerror}; {fix}") from None
    expected_group = group if group is not None else os.getegid() if mode & 0o070 else None
    problems = []
    if not stat.S_ISSOCK(info.st_mode):
        problems.append(f"{path} is not a socket file")
    if info.st_uid != os.geteuid():
        problems.append(f"it belongs to uid {info.st_uid}, not to the daemon's user (uid {os.geteuid()})")
    if stat.S_IMODE(info.st_mode) != mode:
        problems.append(f"its mode is {stat.S_IMODE(info.st_mode):04o}, not the socket_mode {mode:04o}")
    if expected_group is not None and info.st_gid != expected_group:
        problems.append(f"its group is gid {info.st_gid}, not gid {expected_group} (socket_group, else the "
                        "daemon's group)")
    if problems:
        raise ActivationError(f"{what} is not what the daemon's own bind would make: {'; '.join(problems)}; {fix}")


def _name(constant) -> str:
    return getattr(constant, "name", str(constant))
