"""L2Client: a client's link to moe-l2d for one model.

A background thread owns the ZeroMQ socket: it says hello (attach, and every heartbeat after), maps the
daemon's segments read-only, and sends the miss reports that the hot path queues without waiting. When the
daemon is absent, dies or comes back with a new epoch, the attachment is dropped or replaced; the pool then
reads from the model file and never notices anything but the tier it was served from.

A client uses a daemon only when the socket file, its directory and every segment it maps belong to a trusted
user (its own, root, the service account, or MOE_L2_TRUSTED_UIDS), and no segment is writable by others: any
local user can listen on a socket path or a TCP port while the real daemon is down (docs/security.md). The
socket's checks, the CurveZMQ keys, the bounded socket and `request` are src/moe_l2/control.py's, shared with every
other asker of the daemon.

Until a peer has passed those checks it is given nothing and nothing is taken from it but its hello's reply: a
connection is made only after the socket's checks, libzmq never reconnects it to whatever listens there next,
and a peer that sends more than UNTRUSTED_FRAMES other frames before it is trusted loses its connection. What a
daemon can make a client log is bounded (LogLimit) and shown without terminal escapes (protocol.printable).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from moe_l2 import _native, protocol
from moe_l2.control import (UntrustedDaemon, access_problem, check_socket, curve_keys, dealer, owner, request,
                            trusted_uids)
from moe_l2.layout import Geometry, IndexHeader
from moe_l2.model import ModelFiles
from moe_l2.runtime import default_socket, no_daemon_message

from moe_l2.client.log_limit import LogLimit

log = logging.getLogger("moe-l2.client")

# How soon to say hello again when the socket could not even take the message.
RETRY_S = 0.05
# At close, how long queued reports may still take to reach a live daemon: a long prefill's picks pass at the
# pace the daemon folds them in (its gate and ROUTER queue a few messages a connection, docs/security.md).
CLOSE_LINGER_MS = 2000
# Expert ids per queued report entry: a merged frame holds at most about twice this many (hits, misses and
# picks of its last entry), within protocol.MAX_IDS and far below protocol.MAX_FRAME_BYTES.
MAX_REPORT_IDS = protocol.MAX_IDS // 4
# Replies taken off the socket per pass of the connection thread: a peer that floods replies cannot keep it from
# its heartbeat, its time-outs and close().
RECEIVE_BATCH = 64
# Frames other than its hello's reply that a peer not yet trusted may send on one connection before it is closed:
# a daemon sends none (its refusals answer what an attached client sent), bar the few in flight when
# a client detaches; a fake daemon pushes as many as it likes (docs/security.md).
UNTRUSTED_FRAMES = 8
# How long a new connection may take to come up before it is given up for a new one: libzmq never retries it
# (ZMQ_RECONNECT_IVL -1), and a daemon that just started takes a few ms.
CONNECT_S = 0.5


@dataclass
class LinkCounts:
    """What the connection thread said to the daemon and took off its socket."""

    refused: int = 0    # hellos not said: the socket belonged to a user this client does not trust
    hellos: int = 0     # hellos sent (each may have a reply)
    frames: int = 0     # frames received
    untrusted: int = 0  # of those, from a peer not (yet) past the hello's checks, other than its reply: dropped
    hang_ups: int = 0   # connections closed for sending more than UNTRUSTED_FRAMES of those


class Increments:
    """Running totals (`source()`, a map of counter names to integers) as reports carry them: what grew since
    the previous take."""

    def __init__(self) -> None:
        self.source = None
        self._sent: dict[str, int] = {}

    def take(self) -> dict[str, int]:
        if self.source is None:
            return {}
        totals = self.source()
        out = {k: n - self._sent.get(k, 0) for k, n in totals.items()}
        self._sent = totals
        return {k: n for k, n in out.items() if n > 0}


def check_segment(segment, trusted: frozenset[int]) -> None:
    """Raise UntrustedDaemon unless the mapped segment (fstat of its descriptor) belongs to a trusted user and
    no one else may write it."""
    if segment.owner_uid not in trusted:
        raise UntrustedDaemon(f"segment {segment.name} belongs to {owner(segment.owner_uid)}, whom this client "
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
    slot_indexes: tuple  # per MoE layer, its _native.SlotIndex (copy, lend, check); None where unserved

    def serves(self, layer: int) -> bool:
        return layer in self.layers


def attach_segments(files: ModelFiles, index_name: str, trusted: frozenset[int] | None = None,
                    layers=None) -> Attachment:
    """Map the daemon's segments read-only. `layers`: the served MoE layers the hello reply names (None: a
    daemon from before --layers, which serves all); the index header must name the same.

    Whoever answered hello named the segments, so each is opened as untrusted: never blocking on what holds the
    name, and only a segment at least as large as the geometry says (the index first as large as its header,
    then, from the header, as large as the whole index), so that no read goes past a mapping."""
    trusted = trusted_uids() if trusted is None else trusted
    index = _native.Segment.open(index_name, readonly=True, min_size=IndexHeader.min_bytes(files.n_layers))
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
    g = header.geometry
    slots = g.layer_slots(served)
    data = tuple(_native.Segment.open(name, readonly=True, min_size=slots[layer] * g.slot_stride) if name else None
                 for layer, name in enumerate(header.data_names))
    for layer in slots:
        check_segment(data[layer], trusted)
    slot_indexes = tuple(g.slot_index(index, layer, slots[layer], data[layer]) if layer in slots else None
                         for layer in range(g.n_layers))
    return Attachment(header.epoch, g, index, data, served, tuple(slots.get(layer, 0) for layer in range(g.n_layers)),
                      slot_indexes)


def wait_idle(address: str, timeout_s: float = 10.0) -> None:
    """Until the daemon has no loads in flight (those that earlier misses and prefetches asked for) and no slot
    offered to a donor (client/donor.py); RuntimeError when it still has some after timeout_s, since what a
    caller reads next (the daemon's figures) would not count them."""
    deadline = time.monotonic() + timeout_s
    while loads := _in_flight(request(address, protocol.Stats(id=1)).payload["daemon"]):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"moe-l2d on {address} still has {loads} loads in flight after {timeout_s:g} s: its "
                               "disk may be slow or stuck (moe-l2 stats shows them; its log names failed reads)")
        time.sleep(0.05)


def _in_flight(daemon: dict) -> int:
    return daemon["loads_in_flight"] + (daemon.get("fills") or {}).get("offers", 0)


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
        self.refused = False  # the last daemon met was refused as untrusted (and the refusal logged)
        self.counts = LinkCounts()
        self._said = LogLimit(log)
        self._sock: zmq.Socket | None = None  # made by _hello once the address passed check_socket, never before
        self._opened = 0.0  # when _sock was made
        self._untrusted = 0  # frames on _sock dropped as from a peer not yet trusted
        self._reports: queue.SimpleQueue = queue.SimpleQueue()
        # A byte here wakes the connection thread to send the queued reports now (report(now=True)).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Running totals the reports carry as increments: next-layer prefetch's and the lookups' tiers.
        self._prefetch = Increments()
        self._tiers = Increments()
        self._l0_source = None
        # Hints and prefetch requests, (message class, its fields but id and model), sent in order.
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="moe-l2-client", daemon=True)
        self._thread.start()
        if (wait_s > 0 and not self.wait_attached(wait_s) and not self.refused
                and self.address not in _WARNED_NO_DAEMON):
            # Once per address and process: a client running from disk only must not go unnoticed.
            _WARNED_NO_DAEMON.add(self.address)
            log.warning("%s", access_problem(self.address) or no_daemon_message(self.address))

    @property
    def attached(self) -> bool:
        return self.attachment is not None

    def wait_attached(self, timeout_s: float) -> bool:
        """True once attached to a daemon; False when timeout_s passed first (none answered, or it was refused:
        `last_error` says why)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.attachment is not None:
                return True
            time.sleep(0.02)
        return self.attachment is not None

    def report(self, layer: int, hits: list[int], misses: list[int], routed: list[int], now: bool = False,
               given=(), folded: bool = False) -> None:
        """Queue what one lookup found in L2 and what the router picked; returns at once (the daemon
        loads the misses and counts the picks). Nothing for a layer the daemon does not serve. now: send it
        without waiting for the next flush, and have the daemon fold it in at once (a caller waits for the misses:
        load-through, asleep on their slots). given: the misses a process that gives to L2 (client/donor.py) read
        itself, which the daemon must not load. folded: the lookup went to the policy through the donor already
        (Donor.look), so the daemon only counts it."""
        attachment = self.attachment
        if attachment is not None and not attachment.serves(layer):
            return
        self._reports.put((layer, hits, misses, routed[:MAX_REPORT_IDS], now, list(given), folded))
        for start in range(MAX_REPORT_IDS, len(routed), MAX_REPORT_IDS):  # a long prefill, pick by pick
            self._reports.put((layer, [], [], routed[start:start + MAX_REPORT_IDS], False, [], folded))
        if now:
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
        self._prefetch.source = source

    def count_tiers(self, source) -> None:
        """Send where the lookups got their bytes with the reports: `source()` returns the running totals
        (protocol.TIER_COUNTERS, TierCounts.by_source), for the daemon's `stats`; as increments, as above."""
        self._tiers.source = source

    def count_l0(self, source) -> None:
        """Tell the daemon, in every hello, the rows this process' L0 holds: `source()` returns (rows held now,
        the most it may hold), over all its layers (for `moe-l2 stats`)."""
        self._l0_source = source

    def hint(self, text: str) -> None:
        """Tell the daemon what the next prompt is about (it may preload and pin that domain's experts);
        returns at once. A daemon without a profile ignores it."""
        self._requests.put((protocol.Hint, {"text": text}))

    def _connect(self, poller: zmq.Poller) -> None:
        """A new connection, the one _hello and the reports use until it is closed (_hang_up)."""
        # Replies here are hello replies and refusals, as small as any request: a larger one is dropped unread
        # (ZMQ_MAXMSGSIZE), and the hello it answered times out (docs/security.md). Never reconnected: all it
        # brings comes from the peer whose socket was checked before it was made.
        self._sock = dealer(self.address, self.curve, protocol.MAX_FRAME_BYTES,
                            options=((zmq.IMMEDIATE, 1),  # do not queue for a daemon that is not there
                                     (zmq.RECONNECT_IVL, -1)))
        poller.register(self._sock, zmq.POLLIN)
        self._opened = time.monotonic()
        self._untrusted = 0

    def _hang_up(self, poller: zmq.Poller) -> None:
        if self._sock is not None:
            poller.unregister(self._sock)
            self._sock.close(0)
            self._sock = None

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        pending: tuple[int, float] | None = None
        next_hello = 0.0
        greeted = False  # said hello: then the daemon may count this client, and bye tells it to stop
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if pending is not None and now - pending[1] > self.timeout_s:
                    self._detach("moe-l2d did not answer the heartbeat")
                    pending = None
                    # Said again on a new connection, made after the socket's checks: libzmq never reconnects one
                    # it closed for a reply over the bound (a protocol error), nor any other (RECONNECT_IVL -1).
                    self._hang_up(poller)
                if pending is None and now >= next_hello:
                    pending, next_hello = self._hello(poller, now)
                    greeted |= pending is not None
                self._flush_reports()
                self._flush_requests()
                # Not past the next hello (or its retry), however long reports may wait.
                until_hello = max(0, math.ceil((next_hello - time.monotonic()) * 1000))
                events = dict(poller.poll(min(self.flush_ms, until_hello)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self._sock is not None and self._sock in events:
                    pending = self._receive(pending)
                    if self._untrusted > UNTRUSTED_FRAMES:
                        self._flooded()
                        self._hang_up(poller)
                        pending, next_hello = None, now + self.heartbeat_s
            self._flush_reports()
            if greeted and self._sock is not None:
                self._send(protocol.Bye(id=next(self._ids), client=self.name))
        finally:
            if self._sock is not None:
                self._sock.close(linger=CLOSE_LINGER_MS)

    def _hello(self, poller: zmq.Poller, now: float) -> tuple[tuple[int, float] | None, float]:
        """Say hello, on a new connection if there is none, unless the socket belongs to a user this client does
        not trust (then the impostor gets no connection and learns nothing, not even the model's path); (the
        hello pending and when it was sent, the time of the next)."""
        try:
            check_socket(self.address, self.trusted)
        except UntrustedDaemon as exc:
            self.counts.refused += 1
            self._hang_up(poller)
            self._refuse_daemon(f"refusing moe-l2d on {self.address}: {exc}; reading experts from "
                                f"{self.files.path}")
            return None, now + self.heartbeat_s
        if self._sock is None:
            self._connect(poller)
        rows, ceiling = self._l0_source() if self._l0_source is not None else (0, 0)
        msg = protocol.Hello(id=next(self._ids), model=self.model_path, fingerprint=self.files.fingerprint,
                             client=self.name, layers=self.layers, l0_rows=rows, l0_ceiling=ceiling)
        if self._send(msg):
            self.counts.hellos += 1
            return (msg.id, now), now + self.heartbeat_s
        # Not connected: not yet (the ipc pipe of a daemon that just started takes a few ms), or no more (a daemon
        # that stopped: a new connection, after the socket's checks, at the next try); or this user may not reach
        # the socket, which is worth saying rather than "not running".
        if now - self._opened > CONNECT_S:
            self._hang_up(poller)
        self._detach(access_problem(self.address) or "moe-l2d is not running")
        return None, now + min(self.heartbeat_s, RETRY_S)

    def _receive(self, pending: tuple[int, float] | None) -> tuple[int, float] | None:
        """Take what the daemon sent, RECEIVE_BATCH frames at most; the pending hello after them (None once
        answered). From a peer not yet trusted, only the hello's reply."""
        for _ in range(RECEIVE_BATCH):
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.counts.frames += 1
            if self.attachment is None:
                reply = self._hello_reply(frame, pending)
                if reply is None:
                    self.counts.untrusted += 1
                    self._untrusted += 1
                    if self._untrusted > UNTRUSTED_FRAMES:
                        break
                    continue
            else:
                try:
                    reply = protocol.decode_reply(frame)
                except protocol.ProtocolError as exc:
                    self._detach(exc.evalue)
                    continue
            if pending is not None and reply.id == pending[0]:
                pending = None
                self._on_hello(reply)
            elif not reply.ok:
                # Hints to a daemon without a profile are refused by design: not worth a warning.
                if reply.ename == "NoProfile":
                    log.debug("moe-l2d refused a hint: %s: %s", reply.ename, reply.evalue)
                else:
                    self._said.warning("refusal", "moe-l2d refused a message: %s: %s", reply.ename, reply.evalue)
        return pending

    def _hello_reply(self, frame: bytes, pending: tuple[int, float] | None) -> protocol.Reply | None:
        """The reply to the pending hello, if the frame is that: all a client takes from a peer not yet trusted
        (a frame only unpacked, never looked into)."""
        try:
            reply = protocol.decode_reply(frame)
        except protocol.ProtocolError as exc:
            self.last_error = exc.evalue  # what a hello's reply may have been (from another release?)
            return None
        return reply if pending is not None and reply.id == pending[0] else None

    def _flooded(self) -> None:
        self.counts.hang_ups += 1
        why = (f"moe-l2d on {self.address} sent more than {UNTRUSTED_FRAMES} messages before passing its hello's "
               "checks: closed the connection (another user may be posing as moe-l2d)")
        self._said.warning("flood", "%s; reading experts from %s", why, self.files.path)
        self.last_error = why

    def _send(self, message: protocol.Message) -> bool:
        try:
            self._sock.send(message.encode(), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _flush_reports(self) -> None:
        """Send the queued reports, merged, in frames well under the daemon's frame limit; lookups folded in
        through the donor and the others never share a frame (a daemon observes a frame's lookups or none)."""
        held = None  # the first report of the next frame, taken off the queue to see that its `folded` differs
        while True:
            layers: dict[int, list[list[int]]] = collections.defaultdict(lambda: [[], []])
            routed: dict[int, list[int]] = collections.defaultdict(list)
            notify: dict[int, list[int]] = collections.defaultdict(list)
            given: dict[int, list[int]] = collections.defaultdict(list)
            ids, folded = 0, None
            try:
                while ids < MAX_REPORT_IDS:
                    item, held = held or self._reports.get_nowait(), None
                    layer, hits, misses, picks, now, gave, folds = item
                    if folded is not None and folds != folded:
                        held = item
                        break
                    folded = folds
                    if hits or misses:
                        layers[layer][0].extend(hits)
                        layers[layer][1].extend(misses)
                    if now and misses:
                        notify[layer].extend(e for e in misses if e not in gave)  # awaited: the daemon folds it in now
                    if gave:
                        given[layer].extend(gave)
                    routed[layer].extend(picks)
                    ids += len(hits) + len(misses) * (2 if now else 1) + len(picks) + len(gave)
            except queue.Empty:
                pass
            if self.attachment is not None:
                # Counters alone go too: a run's last lookups are counted after their report was queued.
                prefetch, tiers = self._prefetch.take(), self._tiers.take()
                if routed or prefetch or tiers:
                    self._send(protocol.Report(id=next(self._ids), model=self.files.fingerprint,
                                               layers=dict(layers), routed=dict(routed), prefetch=prefetch,
                                               tiers=tiers, notify=dict(notify), given=dict(given),
                                               folded=bool(folded)))
            if ids < MAX_REPORT_IDS and held is None:
                return

    def _flush_requests(self) -> None:
        """Send the queued hints and prefetch requests (dropped while detached: both are only advice)."""
        try:
            while True:
                message, fields = self._requests.get_nowait()
                if self.attachment is not None:
                    self._send(message(id=next(self._ids), model=self.files.fingerprint, **fields))
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
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the text may quote a segment name it sent
            self._detach(f"cannot map the daemon's segments: {protocol.printable(str(exc), protocol.MAX_REPLY_REASON)}")
            return
        self.attaches += 1
        self.last_error = ""
        self.refused = False
        log.info("attached to moe-l2d epoch %d on %s", self.attachment.epoch, self.address)

    def _refuse_daemon(self, why: str) -> None:
        """Log an untrusted daemon (the heartbeat meets it every second), then detach."""
        self._said.warning("untrusted", "%s", why)
        self.refused = True  # said: no "no moe-l2d answered" after it
        self._detach(why)

    def _detach(self, why: str) -> None:
        if self.attachment is not None:
            self._said.warning("detached", "detached from moe-l2d (%s); reading experts from %s", why, self.files.path)
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

    def __enter__(self) -> "L2Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
