"""The daemon's own listening sockets as the OS makes them: a socket file bound with exactly its mode and group
(the gate's public one, the ROUTER's private one, the fill socket), and tcp://HOST:PORT resolved as libzmq
resolves it (docs/security.md)."""

from __future__ import annotations

import os
import socket

import psutil


def bind_socket_file(bind, path: str, mode: int, group: int | None) -> None:
    """bind() a socket file that gets exactly `mode` (and `group`), never the umask's bits, with nobody able to
    connect in between: it is created under umask 077 (docs/security.md)."""
    previous = os.umask(0o077)
    try:
        bind()
    finally:
        os.umask(previous)
    if group is not None:
        os.chown(path, -1, group, follow_symlinks=False)
    os.chmod(path, mode, follow_symlinks=False)


def tcp_sockaddr(address: str) -> tuple[int, tuple]:
    """(family, sockaddr) of tcp://HOST:PORT as libzmq resolves it: IPv4 first, * for any, or an interface;
    ValueError where it cannot."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{address!r} needs a numeric port, e.g. tcp://127.0.0.1:5557")
    host = "0.0.0.0" if host == "*" else host.strip("[]")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return family, socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM)[0][4]
        except socket.gaierror:
            continue
    for addr in psutil.net_if_addrs().get(host, []):  # an interface name, e.g. tcp://eth0:5557
        if addr.family in (socket.AF_INET, socket.AF_INET6):
            return addr.family, (addr.address.split("%")[0], int(port))
    raise ValueError(f"cannot resolve the host of {address!r}: give an IP address, a host name or an interface")
