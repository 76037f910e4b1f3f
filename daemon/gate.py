"""The gate: the daemon's public control socket, owned by the daemon itself in front of libzmq.

libzmq can be told neither to cap its connections nor to count a message's parts: past the descriptor limit
its ipc listener asserts on EMFILE and the daemon dies of SIGABRT, and it buffers every part of an unfinished
multipart message where no limit sees them. So one thread binds the public address (ipc:// with the socket's
mode and group, or tcp://), accepts each connection itself and relays its bytes to the server's ROUTER, which
binds a private ipc socket (mode 0600, in the daemon's private state dir). On the way the gate

- caps connections: in all, from the descriptor limit (each relayed connection costs FDS_PER_CONNECTION), and per
  peer uid on ipc (SO_PEERCRED, LOCAL_PEERCRED on macOS), so that one local user cannot lock the others out;
  past a cap a connection is closed at once;
- reads the ZMTP 3 framing of what the client sends (a 64-byte greeting, then frames: a flags byte, MORE=1,
  LONG=2, COMMAND=4, and a size of 1 or 8 bytes) and closes the connection at a frame over FRAME_LIMIT, a
  message of more parts than the protocol allows, a message left unfinished for UNFINISHED_S, or a greeting not
  whole within HANDSHAKE_S. Under CurveZMQ every message frame is an encrypted command whose parts cannot be
  counted: there frames are bounded in size and the connection's bytes in rate; under NULL, commands (PINGs)
  are bounded in rate;
- buffers at most BUFFER_BYTES per direction per connection (and the kernel SOCKET_BUFFER_BYTES), stops reading
  a side while its peer lags, stops reading and relaying a client that leaves what it was sent unread, and
  closes it once it has read nothing for STALLED_S;
- logs refusals through a RefusalLog, never aborts on a full descriptor table, and gives freed heap back to the
  system (malloc_trim) once a flood has passed (docs/security.md, "Connections and memory").
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import logging
import os
import resource
import selectors
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil

from moe_l2.daemon.http import MAX_CONNECTIONS as HTTP_CONNECTIONS
from moe_l2.daemon.peers import peer_uid
from moe_l2.daemon.refusals import RefusalLog
from moe_l2.daemon.sockets import bind_socket_file, tcp_sockaddr
from moe_l2.daemon.zmtp import COMMAND_LIMIT, Framing, Refused

log = logging.getLogger("moe-l2d.gate")

# A relayed connection holds three descriptors: the client's, the gate's to the ROUTER, and libzmq's accepted one.
FDS_PER_CONNECTION = 3
# Descriptors kept out of the connection cap, beyond those open when the gate starts: the metrics server's
# connections, and the daemon's own short reads (/proc/meminfo, a process' status), logs and scrapes.
RESERVE_FDS = HTTP_CONNECTIONS + 64
# One peer uid may hold at most this share of the connection cap.
USER_SHARE = 4
HANDSHAKE_S = 5.0
UNFINISHED_S = 5.0
BUFFER_BYTES = 16 << 10
# The kernel's send buffer of each socket a relayed connection has (the client's, the gate's to the ROUTER; the
# ROUTER's own, ZMQ_SNDBUF, daemon/server.py), where Linux's default is 208 KiB: what a client sends and does not
# read the answers of waits in its own socket, not as requests queued for the server (docs/security.md).
SOCKET_BUFFER_BYTES = 4 << 10
# A client whose socket is full (it leaves what the daemon sends it unread) is closed once it has read nothing
# for this long.
STALLED_S = 10.0
# CurveZMQ: a connection's bytes per second, and the burst it may send at once.
CURVE_BYTES_PER_S = 16 << 20
CURVE_BURST_BYTES = 2 * COMMAND_LIMIT
# NULL: after its READY a client sends commands only as heartbeats (ZMQ_HEARTBEAT_IVL; clients of moe-l2 send
# none): more than this burst, refilled at this rate, closes the connection.
COMMANDS_PER_S = 20
COMMAND_BURST = 20
# After accept fails for want of descriptors, the listener rests this long; a ROUTER with a full backlog is
# connected to again after INNER_RETRY_S, until the handshake's deadline.
ACCEPT_PAUSE_S = 0.1
INNER_RETRY_S = 0.01
# A connection whose one side closed passes on what the other side still has to say (a client's last reports,
# which the ROUTER takes as fast as the server reads them) while bytes move, and is closed after this long
# without any moving (libzmq reads a half-closed connection's rest at the pace the server takes its messages).
DRAIN_S = 5.0
TICK_S = 0.5
# Heap given back (malloc_trim) after this much relayed traffic, counting a closed connection as
# CLOSED_CONNECTION_BYTES, once a tick relays less than a sixteenth of it.
TRIM_AFTER_BYTES = 8 << 20
CLOSED_CONNECTION_BYTES = 64 << 10
# <malloc.h>: mallopt's parameter for the most arenas glibc makes.
M_ARENA_MAX = -8
# macOS refuses a soft descriptor limit above OPEN_MAX (<sys/syslimits.h>) when the hard one is unlimited.
MACOS_OPEN_MAX = 10240

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class GateError(RuntimeError):
    pass


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (descriptors are the gate's headroom); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, MACOS_OPEN_MAX):
        if target != resource.RLIM_INFINITY and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        log.info("raised the descriptor limit from %d to %d", soft, target)
        return target
    return soft


def _malloc_trim():
    """glibc's malloc_trim, or None (macOS, musl): freed heap pages that glibc keeps would stay in RSS.

    Threads started from now on (the gate's, libzmq's) allocate from glibc's main arena (mallopt M_ARENA_MAX): the
    top of a thread's own arena is never given back, malloc_trim or not (docs/security.md, "Connections and
    memory")."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    libc.mallopt(M_ARENA_MAX, 1)
    return trim


class Timer(NamedTuple):
    """A deadline of the gate's loop: `what` is due for `relay` (None: the listener's rest) at `when`
    (time.monotonic()); `token` says which state it was set for (a message's number, bytes moved). A tuple, so
    that the heap orders timers by `when`, then by `seq`, which is unique."""

    when: float
    seq: int
    relay: Relay | None
    what: str
    token: int


class Relay:
    """One accepted connection, its twin to the ROUTER, and what is on its way each way."""

    __slots__ = ("client", "inner", "uid", "up", "down", "framing", "masks", "client_done", "inner_done",
                 "closed", "paused", "tokens", "tokens_at", "timed_message", "moved", "inner_shut", "stall_timed",
                 "unread")

    def __init__(self, client: socket.socket, uid: int | None, curve: bool, now: float):
        self.client = client
        self.inner: socket.socket | None = None
        self.uid = uid
        self.up = bytearray()  # client -> ROUTER
        self.down = bytearray()  # ROUTER -> client
        self.framing = Framing(curve)
        self.masks: dict[socket.socket, int] = {client: 0}
        self.client_done = self.inner_done = self.closed = self.paused = self.inner_shut = self.stall_timed = False
        # CurveZMQ's bytes, or NULL's commands, it may still send at once.
        self.tokens, self.tokens_at = float(CURVE_BURST_BYTES if curve else COMMAND_BURST), now
        self.timed_message = -1  # the message whose UNFINISHED_S deadline is set
        self.moved = 0  # bytes passed on either way, which a drain's deadline watches
        self.unread = 0  # bytes of answers that came after the client hung up


class Gate:
    """Bind `address` now (a GateError says why not), or take `listener`, the listening socket a service manager
    made for it (daemon/activation.py checked it); start() relays its connections to the ROUTER that binds
    `inner` (bind_inner). Connections queued before start() are served then."""

    def __init__(self, address: str, inner: Path, *, mode: int = 0o600, group: int | None = None,
                 curve: bool = False, listener: socket.socket | None = None):
        self.address = address
        self.inner = str(inner)
        self.curve = curve
        if len(self.inner.encode()) > 100:  # sun_path: 104 bytes on macOS, with its NUL
            raise GateError(f"the daemon's private socket {self.inner} is longer than 100 bytes: choose a shorter "
                            "--runtime-dir (tcp://) or socket directory (ipc://)")
        self._base_fds = psutil.Process().num_fds()
        self._set_caps(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        if self.max_connections < 1:
            raise GateError(f"the descriptor limit ({self.fd_limit}) leaves no room for connections: raise it "
                            "(LimitNOFILE= in the unit, ulimit -n)")
        self.refused: dict[str, int] = {}  # since start, per kind
        self.trims = 0
        self._refusals = RefusalLog(log, "connections")
        self._relays: set[Relay] = set()
        self._per_uid: dict[int, int] = {}
        self._timers: list[Timer] = []  # a heap
        self._seq = 0
        self._dirty = self._recent = 0
        self._next_tick = 0.0
        self._retrim_at = float("inf")
        self._trim = _malloc_trim()
        self._stop = False
        self._path = address[len("ipc://"):] if address.startswith("ipc://") else None
        # An inherited socket's file is the manager's: it listens on there after the daemon stops.
        self._owns_path = listener is None
        self._listener = listener if listener is not None else self._bind(mode, group)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, READ)
        self._thread = threading.Thread(target=self._run, name="moe-l2d-gate", daemon=True)

    def _bind(self, mode: int, group: int | None) -> socket.socket:
        try:
            if self._path is not None:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    os.unlink(self._path)  # a predecessor's: the daemon's lock is held
                except FileNotFoundError:
                    pass
                bind_socket_file(lambda: listener.bind(self._path), self._path, mode, group)
            else:
                try:
                    family, sockaddr = tcp_sockaddr(self.address)
                except ValueError as exc:
                    raise GateError(str(exc)) from None
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
                listener.bind(sockaddr)
            listener.listen(socket.SOMAXCONN)
        except OSError as exc:
            raise GateError(exc.strerror or str(exc)) from None
        return listener

    def _set_caps(self, fd_limit: int) -> None:
        self.fd_limit = fd_limit
        self.max_connections = (fd_limit - self._base_fds - RESERVE_FDS) // FDS_PER_CONNECTION
        self.max_per_user = max(1, self.max_connections // USER_SHARE)

    def bind_inner(self, zmq_socket) -> None:
        """Bind the ROUTER to the private socket, mode 0600 (a predecessor's file is replaced: libzmq unlinks)."""
        bind_socket_file(lambda: zmq_socket.bind(f"ipc://{self.inner}"), self.inner, 0o600, None)

    def start(self) -> "Gate":
        self._thread.start()
        log.info("accepting at most %d connections (%d per user) on %s, from a descriptor limit of %d",
                 self.max_connections, self.max_per_user, self.address, self.fd_limit)
        return self

    def figures(self) -> dict:
        return {"connections": len(self._relays), "max_connections": self.max_connections,
                "max_per_user": self.max_per_user, "fd_limit": self.fd_limit, "refused": dict(self.refused),
                "trims": self.trims}

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._wake_w.send(b"\0")
            self._thread.join()
        for relay in list(self._relays):
            self._close(relay)
        self._refusals.flush(final=True)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        for path in (self._path if self._owns_path else None, self.inner):
            if path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # ---- the loop ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            now = time.monotonic()
            until = min(self._timers[0].when if self._timers else now + TICK_S, self._next_tick)
            for key, mask in self._selector.select(max(0.0, until - now)):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._wake_r.recv(64)
                else:
                    self._on_event(key.data, key.fileobj, mask)
            now = time.monotonic()
            self._run_timers(now)
            if now >= self._next_tick:
                self._tick(now)

    def _timer(self, delay: float, relay: Relay | None, what: str, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._timers, Timer(time.monotonic() + delay, self._seq, relay, what, token))

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            relay, what, token = timer.relay, timer.what, timer.token
            if relay is None:  # the listener's rest is over
                self._selector.register(self._listener, READ)
            elif relay.closed:
                continue
            elif what == "greeting" and not relay.framing.greeted:
                self._refuse(relay, "handshake timeout", f"no ZMTP greeting within {HANDSHAKE_S:g} s")
            elif what == "message" and relay.framing.unfinished and relay.framing.messages == token:
                if relay.down:  # not read meanwhile: the stall's own deadline applies, then this one again
                    self._timer(UNFINISHED_S, relay, "message", token)
                else:
                    self._refuse(relay, "unfinished message", f"a message left unfinished for "
                                                              f"{UNFINISHED_S:g} s")
            elif what == "drain":
                if relay.moved == token:
                    self._close(relay)
                else:
                    self._timer(DRAIN_S, relay, "drain", relay.moved)
            elif what == "resume":
                relay.paused = False
                self._update(relay)
            elif what == "stalled":
                relay.stall_timed = False
                if relay.down and relay.moved == token:
                    self._refuse(relay, "not reading", f"what it was sent left unread for {STALLED_S:g} s")
                else:
                    self._update(relay)
            elif what == "connect" and relay.inner is None:
                self._connect_inner(relay)

    def _tick(self, now: float) -> None:
        self._next_tick = now + TICK_S
        self._refusals.flush()
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if fd_limit != self.fd_limit:  # a library lowered it (importing mlx_lm sets 2048): keep the headroom
            log.warning("the descriptor limit changed from %d to %d: the connection caps follow", self.fd_limit,
                        fd_limit)
            self._set_caps(fd_limit)
        quiet = self._recent < TRIM_AFTER_BYTES // 16
        if quiet and self._trim is not None and (self._dirty >= TRIM_AFTER_BYTES or now >= self._retrim_at):
            self._trim(0)  # the flood has passed: give its freed heap back
            self.trims += 1
            # Once more a while later: libzmq lets go of a closed connection's pipes only as the server takes in its
            # commands, after the trim that followed the flood.
            self._retrim_at = now + DRAIN_S if self._dirty >= TRIM_AFTER_BYTES else float("inf")
            self._dirty = 0
        self._recent = 0

    # ---- connections ---------------------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):  # then the relays get their turn
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: never die of it; rest, and say so now and then.
                self._count("accept failed")
                self._refusals.refused("accept failed", "cannot accept a connection on %s: %s; pausing %g s (are "
                                       "descriptors used up elsewhere? moe-l2 stats shows the gate's figures)",
                                       self.address, exc.strerror, ACCEPT_PAUSE_S)
                self._selector.unregister(self._listener)
                self._timer(ACCEPT_PAUSE_S, None, "accept")
                return
            client.setblocking(False)
            uid = peer_uid(client) if self._path is not None else None
            if len(self._relays) >= self.max_connections:
                self._turn_away(client, uid, "connection cap",
                                f"{len(self._relays)} connections are open, the most the descriptor limit "
                                f"({self.fd_limit}) allows; raise LimitNOFILE (ulimit -n), or see who holds them")
            elif uid is not None and self._per_uid.get(uid, 0) >= self.max_per_user:
                self._turn_away(client, uid, "per-user cap",
                                f"this user holds {self._per_uid[uid]} connections, the most one user may "
                                f"(a {USER_SHARE}th of {self.max_connections})")
            else:
                self._open(client, uid)

    def _turn_away(self, client: socket.socket, uid: int | None, kind: str, why: str) -> None:
        client.close()
        self._dirty += CLOSED_CONNECTION_BYTES
        self._count(kind)
        self._refusals.refused(kind, "closed a new connection%s: %s", "" if uid is None else f" of uid {uid}", why)

    def _open(self, client: socket.socket, uid: int | None) -> None:
        if client.family != socket.AF_UNIX:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as libzmq: requests are small
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        relay = Relay(client, uid, self.curve, time.monotonic())
        self._relays.add(relay)
        if uid is not None:
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self._timer(HANDSHAKE_S, relay, "greeting")
        self._connect_inner(relay)
        self._update(relay)

    def _connect_inner(self, relay: Relay) -> None:
        try:
            inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            self._refuse(relay, "no descriptor", f"cannot open a socket to the server: {exc.strerror}")
            return
        inner.setblocking(False)
        inner.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        try:
            inner.connect(self.inner)
        except OSError as exc:
            inner.close()
            if exc.errno not in (errno.EAGAIN, errno.ECONNREFUSED, errno.ENOENT):
                self._refuse(relay, "server unreachable", f"cannot reach the server: {exc.strerror}")
                return
            self._timer(INNER_RETRY_S, relay, "connect")  # the ROUTER's backlog is full: until the greeting's deadline
            return
        relay.inner = inner
        relay.masks[inner] = 0
        self._update(relay)

    def _refuse(self, relay: Relay, kind: str, why: str) -> None:
        self._count(kind)
        self._refusals.refused(kind, "closed a connection%s: %s", "" if relay.uid is None else f" of uid {relay.uid}",
                               why)
        self._close(relay)

    def _count(self, kind: str) -> None:
        self.refused[kind] = self.refused.get(kind, 0) + 1

    def _close(self, relay: Relay) -> None:
        if relay.closed:
            return
        relay.closed = True
        for sock, mask in relay.masks.items():
            if mask:
                self._selector.unregister(sock)
            sock.close()
        relay.up = relay.down = bytearray()
        self._relays.discard(relay)
        if relay.uid is not None:
            left = self._per_uid[relay.uid] - 1
            if left:
                self._per_uid[relay.uid] = left
            else:
                del self._per_uid[relay.uid]
        self._dirty += CLOSED_CONNECTION_BYTES

    # ---- bytes ---------------------------------------------------------------------------------------------

    def _on_event(self, relay: Relay, sock: socket.socket, mask: int) -> None:
        if relay.closed:
            return
        from_client = sock is relay.client
        if mask & READ:
            if from_client:
                self._read_client(relay)
            else:
                self._read_inner(relay)
        if mask & WRITE and not relay.closed:
            self._send(relay, sock, relay.down if from_client else relay.up)
        if not relay.closed:
            self._update(relay)

    def _read_client(self, relay: Relay) -> None:
        data = self._recv(relay, relay.client, BUFFER_BYTES - len(relay.up))
        if not data:
            if data is not None:
                relay.client_done = True
                self._timer(DRAIN_S, relay, "drain", relay.moved)
                self._unread(relay, len(relay.down))
                relay.down.clear()
            return
        framing = relay.framing
        commands = framing.commands
        try:
            framing.feed(data, None if self.curve else int(self._refill(relay, COMMANDS_PER_S, COMMAND_BURST)))
        except Refused as exc:
            self._refuse(relay, exc.kind, exc.detail)
            return
        if not self.curve:
            relay.tokens -= framing.commands - commands
        if framing.unfinished and relay.timed_message != framing.messages:
            relay.timed_message = framing.messages
            self._timer(UNFINISHED_S, relay, "message", framing.messages)
        if self.curve:
            relay.tokens = self._refill(relay, CURVE_BYTES_PER_S, CURVE_BURST_BYTES) - len(data)
            if relay.tokens < 0:  # in debt: not read until it is paid off
                relay.paused = True
                self._timer(-relay.tokens / CURVE_BYTES_PER_S, relay, "resume")
        relay.up += data
        self._dirty += len(data)
        self._recent += len(data)
        if relay.inner is not None:
            self._send(relay, relay.inner, relay.up)

    def _read_inner(self, relay: Relay) -> None:
        data = self._recv(relay, relay.inner, BUFFER_BYTES - len(relay.down))
        if not data:
            if data is not None:
                relay.inner_done = True
                self._timer(DRAIN_S, relay, "drain", relay.moved)
            return
        if relay.client_done:  # the client hung up: nobody reads the answers
            relay.moved += len(data)
            self._unread(relay, len(data))
            return
        relay.down += data
        self._send(relay, relay.client, relay.down)

    def _unread(self, relay: Relay, n: int) -> None:
        """Count answers to a client that hung up. Its last reports have none, so they pass; past BUFFER_BYTES it
        left requests behind that cost the server work for nobody, and the rest of them goes with the connection."""
        relay.unread += n
        if relay.unread > BUFFER_BYTES:
            self._refuse(relay, "hung up unread", f"it hung up leaving more than {BUFFER_BYTES} bytes of answers "
                                                  "unread")

    def _recv(self, relay: Relay, sock: socket.socket, room: int) -> bytes | None:
        """Up to `room` bytes; b"" at the end of the stream, None when nothing came (or the relay was closed)."""
        if room <= 0:
            return None
        try:
            return sock.recv(room)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:  # reset by the peer
            self._close(relay)
            return None

    def _send(self, relay: Relay, sock: socket.socket, buffer: bytearray) -> None:
        if not buffer:
            return
        try:
            sent = sock.send(buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(relay)
            return
        del buffer[:sent]
        relay.moved += sent

    def _refill(self, relay: Relay, rate: float, burst: float) -> float:
        """The relay's token bucket (CurveZMQ's bytes, NULL's commands) refilled for the time since last: what
        the client may send now."""
        now = time.monotonic()
        relay.tokens = min(burst, relay.tokens + (now - relay.tokens_at) * rate)
        relay.tokens_at = now
        return relay.tokens

    def _update(self, relay: Relay) -> None:
        """Watch each side for what it can do now; close once a finished side's last bytes are passed on."""
        if relay.closed:
            return
        if (relay.client_done and relay.inner is None) or (relay.inner_done and (not relay.down or relay.client_done)):
            self._close(relay)
            return
        if relay.client_done and not relay.up and not relay.inner_shut:
            # Half-close, never close, towards libzmq: it answers what it reads, and a write to a closed socket
            # would make it drop the client's last messages still unread in the socket (its last reports). It
            # closes its side once it has read the end; the drain's deadline bounds the wait.
            relay.inner_shut = True
            try:
                relay.inner.shutdown(socket.SHUT_WR)
            except OSError:
                self._close(relay)
                return
        # A client whose socket is full leaves what it was sent unread: it gets no more read or relayed until it
        # reads, so what it asks and never reads costs the server a few replies, then nothing.
        stalled = bool(relay.down) and not relay.client_done
        if stalled and not relay.stall_timed:
            relay.stall_timed = True
            self._timer(STALLED_S, relay, "stalled", relay.moved)
        client = ((READ if not (relay.client_done or relay.paused or stalled) and len(relay.up) < BUFFER_BYTES else 0)
                  | (WRITE if stalled else 0))
        self._watch(relay, relay.client, client)
        if relay.inner is not None:
            inner = ((READ if not (relay.inner_done or stalled) and len(relay.down) < BUFFER_BYTES else 0)
                     | (WRITE if relay.up and not stalled else 0))
            self._watch(relay, relay.inner, inner)

    def _watch(self, relay: Relay, sock: socket.socket, mask: int) -> None:
        old = relay.masks[sock]
        if mask == old:
            return
        if not old:
            self._selector.register(sock, mask, relay)
        elif not mask:
            self._selector.unregister(sock)
        else:
            self._selector.modify(sock, mask, relay)
        relay.masks[sock] = mask
