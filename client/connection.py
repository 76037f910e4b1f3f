"""L2Client: a client's link to moe-l2d for one model.

A background thread owns the ZeroMQ socket: it says hello (attach, and every heartbeat after), maps the
daemon's segments read-only, and sends the miss reports that the hot path queues without waiting. When the
daemon is absent, dies or comes back with a new epoch, the attachment is dropped or replaced; the pool then
reads from the model file and never notices anything but the tier it was served from.

A client uses a daemon only when the socket file, its directory and every segment it maps belong to a trusted
user (its own, root, the service account, or MOE_L2_TRUSTED_UIDS), and no segment is writable by others: any
local user can listen on a socket path or a TCP port while the real daemon is down (docs/security.md).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import pwd
import queue
import stat
import threading
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.auth

from moe_l2 import _native, protocol
from moe_l2.layout import Geometry, IndexHeader
from moe_l2.model import ModelFiles
from moe_l2.runtime import default_socket, no_daemon_message

log = logging.getLogger("moe-l2.client")

# How soon to say hello again when the socket could not even take the message.
RETRY_S = 0.05
# Expert ids per queued report entry: a merged frame holds at most about twice this many (hits, misses and
# picks of its last entry), within protocol.MAX_IDS and far below protocol.MAX_FRAME_BYTES.
MAX_REPORT_IDS = protocol.MAX_IDS // 4
# The accounts the service files run moe-l2d as (systemd/README.md: Linux, macOS), trusted like root.
SERVICE_USERS = ("moe-l2", "_moe-l2")


class UntrustedDaemon(ValueError):
    """The socket or a segment belongs to a user this client does not trust, or others may write it."""


def trusted_uids(extra=()) -> frozenset[int]:
    """This process's user, root, the service account if it exists, `extra`, and $MOE_L2_TRUSTED_UIDS (user
    names or ids, comma-separated)."""
    uids = {os.getuid(), 0, *extra}
    names = [*SERVICE_USERS, *filter(None, (n.strip() for n in os.environ.get("MOE_L2_TRUSTED_UIDS", "").split(",")))]
    for name in names:
        if name.isdigit():
            uids.add(int(name))
            continue
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            if name not in SERVICE_USERS:
                log.warning("MOE_L2_TRUSTED_UIDS names user %r, who does not exist; ignored", name)
    return frozenset(uids)


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_socket(address: str, trusted: frozenset[int]) -> None:
    """Raise UntrustedDaemon unless an ipc socket and its directory belong to a trusted user (lstat: a link
    is refused, not followed). A tcp:// address has no owner to check; its segments are checked on attach."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    for what, where in (("directory", os.path.dirname(os.path.abspath(path))), ("socket", path)):
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            return  # nothing listens there yet: nothing to trust or refuse
        if st.st_uid not in trusted:
            raise UntrustedDaemon(f"the {what} {where} belongs to {_owner(st.st_uid)}, whom this client does not "
                                  "trust: another user may be posing as moe-l2d; if that user runs your daemon, "
                                  "add it to MOE_L2_TRUSTED_UIDS")
        if what == "socket" and not stat.S_ISSOCK(st.st_mode):
            raise UntrustedDaemon(f"{where} is not a socket (mode {stat.filemode(st.st_mode)}): remove it and "
                                  "restart moe-l2d")


def check_segment(segment, trusted: frozenset[int]) -> None:
    """Raise UntrustedDaemon unless the mapped segment (fstat of its descriptor) belongs to a trusted user and
    no one else may write it."""
    if segment.owner_uid not in trusted:
        raise UntrustedDaemon(f"segment {segment.name} belongs to {_owner(segment.owner_uid)}, whom this client "
                              "does not trust: another user may be posing as moe-l2d; if that user runs your "
                              "daemon, add it to MOE_L2_TRUSTED_UIDS")
    if segment.mode & 0o022:
        raise UntrustedDaemon(f"segment {segment.name} has mode {segment.mode:o}: users other than its owner "
                              "could change the weights; start moe-l2d with --shm-mode 640 or 600")


@dataclass(frozen=True)
class Attachment:
    """The segments of one daemon epoch; replaced whole, never changed, so a copy in progress keeps its own.
    `data` has one entry per MoE layer: None for a layer the daemon does not serve (moe-l2d --layers), which
    the pool reads from the model files without asking the daemon."""

    epoch: int
    geometry: Geometry
    index: object
    data: tuple
    layers: frozenset[int]  # the MoE layers the daemon serves
    slots: tuple[int, ...]  # per MoE layer, its slots in L2 (0 where unserved)

    def serves(self, layer: int) -> bool:
        return layer in self.layers


def attach_segments(files: ModelFiles, index_name: str, trusted: frozenset[int] | None = None,
                    layers=None) -> Attachment:
    """Map the daemon's segments read-only. `layers`: the served MoE layers the hello reply names (None: a
    daemon from before --layers, which serves all); the index header must name the same."""
    trusted = trusted_uids() if trusted is None else trusted
    index = _native.Segment.open(index_name, readonly=True)
    check_segment(index, trusted)
    header = IndexHeader.unpack(index.view())
    if header.fingerprint != files.fingerprint:
        raise ValueError(f"segment {index_name} holds model {header.fingerprint}, not {files.fingerprint}")
    if header.geometry.record_bytes != files.layout.nbytes or header.geometry.n_experts != files.n_experts:
        raise ValueError(f"segment {index_name} has a record layout other than {files.path}'s")
    if index.nbytes < header.geometry.index_bytes:
        raise ValueError(f"segment {index_name} is smaller than its header says")
    served = frozenset(layer for layer, name in enumerate(header.data_names) if name)
    if served != frozenset(range(files.n_layers) if layers is None else layers):
        raise ValueError(f"segment {index_name} has data segments for MoE layers {sorted(served)}, but the daemon's "
                         f"hello names {'all' if layers is None else sorted(layers)}")
    data = tuple(_native.Segment.open(name, readonly=True) if name else None for name in header.data_names)
    g = header.geometry
    slots = g.layer_slots(served)
    for layer, n in slots.items():
        check_segment(data[layer], trusted)
        if data[layer].nbytes < n * g.slot_stride:
            raise ValueError(f"data segment {data[layer].name} is smaller than its header says")
    return Attachment(header.epoch, g, index, data, served, tuple(slots.get(layer, 0) for layer in range(g.n_layers)))


def request(address: str | None, message: protocol.Message, timeout_s: float = 5.0) -> protocol.Reply:
    """One request and its reply on a short-lived socket (the CLI's way to talk to the daemon).

    A fire-and-forget message is followed by a stats request on the same connection: the daemon handles a
    connection's messages in order, so the first reply is either the refusal of the message or the barrier's.
    No socket file at an ipc:// address, or one this user may not use, fails at once (check_access).
    """
    address = address or default_socket()
    frame = message.encode()
    if len(frame) > protocol.MAX_FRAME_BYTES:
        raise ValueError(f"a {message.TYPE} of {len(frame)} bytes exceeds the daemon's {protocol.MAX_FRAME_BYTES}-"
                         f"byte limit: split it (at most {protocol.MAX_IDS} expert ids per request)")
    check_access(address)
    keys = curve_keys(address)
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        connect(sock, address, keys)
        sock.send(frame)
        if not message.REPLIES:
            sock.send(protocol.Stats(id=message.id).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"moe-l2d did not answer on {address} within {timeout_s:g} s: is it running? "
                               "(systemctl status moe-l2d, or start it with moe-l2d --model DIR --budget SIZE)")
        reply = protocol.decode_reply(sock.recv())
        return reply if message.REPLIES or not reply.ok else protocol.Reply(id=message.id, ok=True)
    finally:
        sock.close(0)


def wait_idle(address: str, timeout_s: float = 10.0) -> None:
    """Until the daemon has no loads in flight (those that earlier misses and prefetches asked for)."""
    deadline = time.monotonic() + timeout_s
    while (time.monotonic() < deadline
           and request(address, protocol.Stats(id=1)).payload["daemon"]["loads_in_flight"]):
        time.sleep(0.05)


def curve_keys(address: str) -> tuple[bytes, bytes, bytes] | None:
    """For a tcp:// daemon that uses CurveZMQ: (its public key, this client's public and secret keys), from the
    certificate files named by $MOE_L2_CURVE_SERVER_KEY (the daemon's public certificate) and
    $MOE_L2_CURVE_CLIENT_CERT (this client's secret certificate). None when neither is set."""
    server, cert = os.environ.get("MOE_L2_CURVE_SERVER_KEY"), os.environ.get("MOE_L2_CURVE_CLIENT_CERT")
    if not address.startswith("tcp://") or not (server or cert):
        return None
    if not (server and cert):
        raise ValueError("CurveZMQ needs both $MOE_L2_CURVE_SERVER_KEY (the daemon's public certificate) and "
                         "$MOE_L2_CURVE_CLIENT_CERT (this client's secret certificate)")
    server_public, _ = zmq.auth.load_certificate(server)
    public, secret = zmq.auth.load_certificate(cert)
    if secret is None:
        raise ValueError(f"{cert} has no secret key: give this client's .key_secret certificate")
    return server_public, public, secret


def connect(sock, address: str, keys: tuple[bytes, bytes, bytes] | None) -> None:
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(address)


def check_access(address: str) -> None:
    """Fail at once, naming the cause, where ZeroMQ itself would only wait and the caller report 'is it
    running?': no socket file at an ipc:// address (ConnectionRefusedError: no daemon will answer there), or one
    this user may not connect to (PermissionError)."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConnectionRefusedError(f"no moe-l2d at {address}: the socket file does not exist; start the daemon "
                                     "(systemctl start moe-l2d, or moe-l2d --model DIR --budget SIZE), or give "
                                     "its address with --socket or MOE_L2_RUNTIME_DIR") from None
    except PermissionError:
        raise PermissionError(f"cannot reach {path}: its directory is closed to this user; ask the admin to "
                              "add you to the daemon's group (docs/security.md)") from None
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(f"no permission to connect to {path} (owner {_owner(st.st_uid)}, group {st.st_gid}, "
                              f"mode {stat.S_IMODE(st.st_mode):o}): ask the admin to add you to that group, or "
                              "to start moe-l2d with --socket-mode 660 (docs/security.md)")


_WARNED_NO_DAEMON: set[str] = set()


class L2Client:
    def __init__(self, files: ModelFiles, address: str | None = None, *, heartbeat_s: float = 1.0,
                 timeout_s: float = 2.0, wait_s: float = 1.0, trusted: frozenset[int] | None = None,
                 layers=None, flush_s: float = 0.02):
        """layers: the MoE layers this process streams (a pipeline rank's), which its hello tells the daemon for
        `stats`; None: all. flush_s: the longest a queued report waits before it is sent (the connection
        thread's poll)."""
        self.files = files
        self.layers = sorted(layers) if layers is not None else []
        self.address = address or default_socket()
        self.trusted = trusted_uids() if trusted is None else trusted
        self.curve = curve_keys(self.address)
        # Sent in hello: the daemon compares real paths as strings, never touching the file system for us.
        self.model_path = os.path.realpath(files.path)
        self.heartbeat_s = heartbeat_s
        self.flush_ms = max(1, round(flush_s * 1000))
        self.timeout_s = timeout_s
        self.name = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.attachment: Attachment | None = None
        self.attaches = 0
        self.last_error = ""
        self._reports: queue.SimpleQueue = queue.SimpleQueue()
        # A byte here wakes the connection thread to send the queued reports now (report(now=True)).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._prefetch_source = None
        self._prefetch_sent: dict[str, int] = {}
        # Hints and prefetch requests, (message class, its fields but id and model), sent in order.
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="moe-l2-client", daemon=True)
        self._thread.start()
        if wait_s > 0 and not self.wait_attached(wait_s) and self.address not in _WARNED_NO_DAEMON:
            # Once per address and process: a client running from disk only must not go unnoticed.
            _WARNED_NO_DAEMON.add(self.address)
            log.warning("%s", no_daemon_message(self.address))

    @property
    def attached(self) -> bool:
        return self.attachment is not None

    def wait_attached(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.attachment is not None:
                return True
            time.sleep(0.02)
        return self.attachment is not None

    def report(self, layer: int, hits: list[int], misses: list[int], routed: list[int], now: bool = False) -> None:
        """Queue what one lookup found in L2 and what the router picked; returns at once (the daemon
        loads the misses and counts the picks). Nothing for a layer the daemon does not serve. now: send it
        without waiting for the next flush (a caller waits for the misses: load-through)."""
        attachment = self.attachment
        if attachment is not None and not attachment.serves(layer):
            return
        self._reports.put((layer, hits, misses, routed[:MAX_REPORT_IDS]))
        for start in range(MAX_REPORT_IDS, len(routed), MAX_REPORT_IDS):  # a long prefill, pick by pick
            self._reports.put((layer, [], [], routed[start:start + MAX_REPORT_IDS]))
        if now:
            self._wake()

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Ask the daemon to load these experts of a layer into L2 (next-layer prefetch with a shared L0);
        sent at once, returns at once. Nothing for a layer the daemon does not serve."""
        attachment = self.attachment
        if attachment is None or not attachment.serves(layer):
            return
        self._requests.put((protocol.Prefetch, {"layer": layer, "experts": experts}))
        self._wake()

    def _wake(self) -> None:
        """Have the connection thread send what is queued now rather than at its next flush."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def count_prefetch(self, source) -> None:
        """Send what next-layer prefetch did with the reports: `source()` returns its running totals
        (protocol.PREFETCH_COUNTERS); each report carries the increments since the previous one."""
        self._prefetch_source = source

    def _prefetch_increments(self) -> dict[str, int]:
        if self._prefetch_source is None:
            return {}
        totals = self._prefetch_source()
        out = {k: n - self._prefetch_sent.get(k, 0) for k, n in totals.items()}
        self._prefetch_sent = totals
        return {k: n for k, n in out.items() if n > 0}

    def hint(self, text: str) -> None:
        """Tell the daemon what the next prompt is about (it may preload and pin that domain's experts);
        returns at once. A daemon without a profile ignores it."""
        self._requests.put((protocol.Hint, {"text": text}))

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # do not queue for a daemon that is not there
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        connect(sock, self.address, self.curve)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        pending: tuple[int, float] | None = None
        next_hello = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if pending is not None and now - pending[1] > self.timeout_s:
                    self._detach("moe-l2d did not answer the heartbeat")
                    pending = None
                if pending is None and now >= next_hello:
                    msg = protocol.Hello(id=next(self._ids), model=self.model_path,
                                         fingerprint=self.files.fingerprint, client=self.name, layers=self.layers)
                    if self._send(sock, msg):
                        pending = (msg.id, now)
                        next_hello = now + self.heartbeat_s
                    else:
                        # Not connected (yet): the ipc pipe of a daemon that just started takes a few ms.
                        self._detach("moe-l2d is not running")
                        next_hello = now + min(self.heartbeat_s, RETRY_S)
                self._flush_reports(sock)
                self._flush_requests(sock)
                # Not past the next hello (or its retry), however long reports may wait.
                until_hello = max(0, math.ceil((next_hello - time.monotonic()) * 1000))
                events = dict(poller.poll(min(self.flush_ms, until_hello)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if sock in events:
                    while True:
                        try:
                            reply = protocol.decode_reply(sock.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        except protocol.ProtocolError as exc:
                            self._detach(exc.evalue)
                            continue
                        if pending is not None and reply.id == pending[0]:
                            pending = None
                            self._on_hello(reply)
                        elif not reply.ok:
                            # Hints to a daemon without a profile are refused by design: not worth a warning.
                            level = logging.DEBUG if reply.ename == "NoProfile" else logging.WARNING
                            log.log(level, "moe-l2d refused a message: %s: %s", reply.ename, reply.evalue)
            self._flush_reports(sock)
            self._send(sock, protocol.Bye(id=next(self._ids), client=self.name))
        finally:
            sock.close(linger=200)  # long enough to hand the last reports to a live daemon

    @staticmethod
    def _send(sock, message: protocol.Message) -> bool:
        try:
            sock.send(message.encode(), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _flush_reports(self, sock) -> None:
        """Send the queued reports, merged, in frames well under the daemon's frame limit."""
        while True:
            layers: dict[int, list[list[int]]] = collections.defaultdict(lambda: [[], []])
            routed: dict[int, list[int]] = collections.defaultdict(list)
            ids = 0
            try:
                while ids < MAX_REPORT_IDS:
                    layer, hits, misses, picks = self._reports.get_nowait()
                    if hits or misses:
                        layers[layer][0].extend(hits)
                        layers[layer][1].extend(misses)
                    routed[layer].extend(picks)
                    ids += len(hits) + len(misses) + len(picks)
            except queue.Empty:
                pass
            if routed and self.attachment is not None:
                self._send(sock, protocol.Report(id=next(self._ids), model=self.files.fingerprint,
                                                 layers=dict(layers), routed=dict(routed),
                                                 prefetch=self._prefetch_increments()))
            if ids < MAX_REPORT_IDS:
                return

    def _flush_requests(self, sock) -> None:
        """Send the queued hints and prefetch requests (dropped while detached: both are only advice)."""
        try:
            while True:
                message, fields = self._requests.get_nowait()
                if self.attachment is not None:
                    self._send(sock, message(id=next(self._ids), model=self.files.fingerprint, **fields))
        except queue.Empty:
            pass

    def _on_hello(self, reply: protocol.Reply) -> None:
        if not reply.ok:
            self._detach(f"{reply.ename}: {reply.evalue}")
            return
        try:
            hello = protocol.HelloReply.decode(reply)
        except protocol.ProtocolError as exc:
            self._detach(exc.evalue)
            return
        current = self.attachment
        if current is not None and current.epoch == hello.epoch:
            return
        try:
            check_socket(self.address, self.trusted)
            self.attachment = attach_segments(self.files, hello.index_segment, self.trusted, hello.layers)
        except UntrustedDaemon as exc:
            self._refuse_daemon(f"refusing moe-l2d on {self.address}: {exc}; reading experts from "
                                f"{self.files.path}")
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._detach(f"cannot map the daemon's segments: {exc}")
            return
        self.attaches += 1
        self.last_error = ""
        log.info("attached to moe-l2d epoch %d on %s", self.attachment.epoch, self.address)

    def _refuse_daemon(self, why: str) -> None:
        """Log an untrusted daemon once per reason (the heartbeat meets it every second), then detach."""
        if why != self.last_error:
            log.warning("%s", why)
        self._detach(why)

    def _detach(self, why: str) -> None:
        if self.attachment is not None:
            log.warning("detached from moe-l2d (%s); reading experts from %s", why, self.files.path)
        # Segments are unmapped when the last copy using them drops its reference, never under it.
        self.attachment = None
        self.last_error = why

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.attachment = None
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
