"""A small HTTP server for `moe-l2d --metrics`, bounded against every local user (docs/security.md, "The
metrics endpoint").

Anyone on the machine can connect to a loopback port, so no connection may cost the daemon more than a
descriptor and a few KiB for a few seconds: one selector thread serves every connection on non-blocking
sockets (never a thread per connection); at most MAX_CONNECTIONS are open, and past that the oldest is closed
to make room (an attacker's idle connections are always older than a scraper's, which sends its request at
once), logged at most once per LOG_INTERVAL_S; a request head (at most MAX_HEAD_BYTES) must arrive whole
within HEAD_TIMEOUT_S of the connection's accept, and a connection on which nothing moves for IDLE_TIMEOUT_S
is closed. Only GET and HEAD of the paths in `pages` are answered; every response closes its connection.

Pages are computed on one worker thread, never on the selector thread, one at a time: requests for a page
being computed wait for that computation, and a page is reused for FRESH_S, so however many scrapers there
are, the daemon's server thread is asked at most once per page per FRESH_S (docs/architecture.md, "A live
view and metrics").
"""

from __future__ import annotations

import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

log = logging.getLogger("moe-l2d.http")

MAX_CONNECTIONS = 64
MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 3.0
FRESH_S = 1.0
LOG_INTERVAL_S = 60.0
# After accept fails for want of descriptors, the listener rests this long instead of spinning on it.
ACCEPT_PAUSE_S = 0.5
TICK_S = 0.25  # how often the timeouts are checked
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Page:
    status: int
    content_type: str
    body: bytes


@dataclass(frozen=True)
class Fresh:
    """A page the worker computed, and when (time.monotonic()): requests of its path take it for FRESH_S."""

    page: Page
    at: float


def message(status: int, text: str) -> Page:
    return Page(status, TEXT, (text + "\n").encode())


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    opened: float
    active: float  # when a byte last moved either way
    head: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the response, once there is one
    head_only: bool = False  # a HEAD request: the response without its body
    waiting_for: str | None = None  # the page being computed for it: no timeout runs, we are the slow side


def parse_head(head: bytes) -> tuple[str, str] | Page:
    """(method, path) of a complete request head, or the error page to answer it with."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return message(400, "a request line is METHOD PATH HTTP/1.x")
    method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
    if method not in ("GET", "HEAD"):
        return message(405, "only GET and HEAD are served")
    return method, target.split("?", 1)[0]


def response(page: Page, head_only: bool) -> bytes:
    status = HTTPStatus(page.status)
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {page.content_type}",
             f"Content-Length: {len(page.body)}", "Connection: close"]
    if page.status == 405:
        lines.append("Allow: GET, HEAD")
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (b"" if head_only else page.body)


class HttpServer:
    """Serves `pages` (path -> a function computing its Page) on HOST:PORT until close()."""

    def __init__(self, host: str, port: int, pages: dict[str, Callable[[], Page]]):
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self._listener = socket.create_server(address, family=family, backlog=MAX_CONNECTIONS)
        self._listener.setblocking(False)
        self.pages = pages
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # The worker's finished pages reach the selector thread through this pair; nothing else is shared.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._connections: set[Connection] = set()
        self._jobs: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[tuple[str, Page]] = queue.SimpleQueue()
        self._waiting: dict[str, list[Connection]] = {}  # path -> connections waiting for its computation
        self._fresh: dict[str, Fresh] = {}  # path -> its page last computed
        self._accept_paused_until = 0.0
        self._evicted = 0  # connections closed at the cap since the last line saying so
        self._next_log: dict[str, float] = {}  # what -> when a line about it may be logged again
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="moe-l2d-http", daemon=True)
        # A daemon thread: a page still being computed when the daemon stops is abandoned, not waited for.
        self._worker = threading.Thread(target=self._compute, name="moe-l2d-http-pages", daemon=True)

    def start(self) -> "HttpServer":
        self._worker.start()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join()
        self._jobs.put(None)
        for conn in self._connections:
            conn.sock.close()
        self._connections.clear()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full of wake-ups already (the selector thread will look), or closed at stop
            pass

    def _compute(self) -> None:
        while (path := self._jobs.get()) is not None:
            try:
                page = self.pages[path]()
            except Exception:  # the endpoint keeps serving; the scraper sees the failure
                log.exception("metrics page %s failed", path)
                page = message(500, f"{path} failed; the daemon's log says why")
            self._finished.put((path, page))
            self._wake()

    def _serve(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while not self._stopping:
            for key, events in self._selector.select(max(0.0, next_tick - time.monotonic())):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._take_finished()
                else:
                    self._handle(key.data, events)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self._expire(now)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept(exc)
                return  # anything else (a connection reset before accept) concerns that connection only
            if len(self._connections) >= MAX_CONNECTIONS:
                self._evict_oldest()
            sock.setblocking(False)
            now = time.monotonic()
            conn = Connection(sock, now, now)
            self._connections.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _may_log(self, what: str) -> bool:
        """At most one line per LOG_INTERVAL_S about `what`: a flood must not flood the journal too."""
        now = time.monotonic()
        if now < self._next_log.get(what, 0.0):
            return False
        self._next_log[what] = now + LOG_INTERVAL_S
        return True

    def _pause_accept(self, exc: OSError) -> None:
        self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
        if self._may_log("accept"):
            log.warning("metrics endpoint cannot accept a connection: %s; it tries again every %g s (is the "
                        "daemon's descriptor limit, LimitNOFILE or ulimit -n, too low?)", exc.strerror,
                        ACCEPT_PAUSE_S)

    def _evict_oldest(self) -> None:
        self._close(min(self._connections, key=lambda c: c.opened))
        self._evicted += 1
        if self._may_log("cap"):
            log.warning("metrics endpoint at its limit of %d open connections: closed the oldest, %d since the "
                        "last such line (at most one per %g s); a local process is holding connections open "
                        "(docs/security.md, \"The metrics endpoint\")", MAX_CONNECTIONS, self._evicted,
                        LOG_INTERVAL_S)
            self._evicted = 0

    def _handle(self, conn: Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                self._read(conn)
            elif events & selectors.EVENT_WRITE:
                self._write(conn)
        except OSError:  # reset by the peer, or the like: that connection's end only
            self._close(conn)

    def _read(self, conn: Connection) -> None:
        data = conn.sock.recv(4096)
        if not data:
            self._close(conn)
            return
        conn.active = time.monotonic()
        start = max(0, len(conn.head) - 3)
        conn.head += data
        end = conn.head.find(b"\r\n\r\n", start)
        if end < 0:
            end = conn.head.find(b"\n\n", start)
        if end < 0 and len(conn.head) <= MAX_HEAD_BYTES:
            return  # the rest of the head is still to come
        if end < 0 or end > MAX_HEAD_BYTES:
            self._respond(conn, message(431, f"a request head is at most {MAX_HEAD_BYTES} bytes"))
            return
        request = parse_head(bytes(conn.head[:end]))
        if isinstance(request, Page):
            self._respond(conn, request)
            return
        method, path = request
        conn.head_only = method == "HEAD"
        if path not in self.pages:
            self._respond(conn, message(404, f"no page {path[:64]}; try {' or '.join(sorted(self.pages))}"))
            return
        fresh = self._fresh.get(path)
        if fresh is not None and time.monotonic() - fresh.at < FRESH_S:
            self._respond(conn, fresh.page)
            return
        conn.waiting_for = path
        self._selector.unregister(conn.sock)
        if path not in self._waiting:
            self._waiting[path] = []
            self._jobs.put(path)
        self._waiting[path].append(conn)

    def _take_finished(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                path, page = self._finished.get_nowait()
            except queue.Empty:
                return
            self._fresh[path] = Fresh(page, time.monotonic())
            for conn in self._waiting.pop(path, []):
                conn.waiting_for = None
                conn.active = time.monotonic()
                self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
                try:
                    self._respond(conn, page)
                except OSError:  # the scraper went away while it waited
                    self._close(conn)

    def _respond(self, conn: Connection, page: Page) -> None:
        conn.out = memoryview(response(page, conn.head_only))
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: Connection) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:  # the scraper's window is full: the selector says when it has room
            return
        conn.active = time.monotonic()
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _expire(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        for conn in list(self._connections):
            if conn.waiting_for is not None:
                continue
            if (conn.out is None and now - conn.opened > HEAD_TIMEOUT_S) or now - conn.active > IDLE_TIMEOUT_S:
                self._close(conn)

    def _close(self, conn: Connection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            if conn.waiting_for is None:
                self._selector.unregister(conn.sock)
            else:
                self._waiting[conn.waiting_for].remove(conn)
            conn.sock.close()
