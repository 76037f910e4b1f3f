"""The control plane: a ZeroMQ ROUTER socket answering the messages of moe_l2.protocol.

One thread owns the socket and the dispatch; loads run on the loader pool, so no request waits for a disk.
A bad request costs its sender an error reply and nothing else. Every request is bounded (moe_l2.protocol's
limits); the one kind whose legal size still costs real time, a report, is validated at once and then folded
in slices between the other requests, so that no flood of reports delays a heartbeat (docs/security.md).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field, replace

import zmq
from zmq.auth.thread import ThreadAuthenticator

from moe_l2 import __version__, protocol
from moe_l2.protocol import ProtocolError

from moe_l2.daemon.config import CurveKeys
from moe_l2.daemon.gate import SOCKET_BUFFER_BYTES, Gate
from moe_l2.daemon.zmtp import FRAME_LIMIT
from moe_l2.daemon.loader import Loader
from moe_l2.daemon.refusals import RefusalLog
from moe_l2.daemon.served import ServedModel
from moe_l2.daemon.sockets import bind_socket_file
from moe_l2.daemon.stats import OwnRss, shm_lock_figures

log = logging.getLogger("moe-l2d.server")

# A client heartbeats (hello) every couple of seconds; one silent for this long is no longer counted.
CLIENT_TIMEOUT_S = 30.0
# Clients remembered at once; past this the longest silent is forgotten (it is counted again at its next
# hello), so hellos from ever new identities cannot grow the table.
MAX_CLIENTS = 1024
# Messages taken off the socket before the next slice of report work, and the length of that slice. A
# connection's pipe holds PIPE_MESSAGES: while messages flow, the batch waits up to REFILL_MS for libzmq to refill
# it, so that a client's heartbeat behind its own reports is read (and answered) within a few batches.
RECEIVE_BATCH = 64
WORK_SLICE_S = 0.01
REFILL_MS = 1
# Report work is measured in looked-up ids: each costs the policy tens of microseconds, a routed pick (one
# counter) about ROUTED_PER_LOOKUP times less. A piece is at most REPORT_CHUNK_IDS of that (about 20 ms);
# past MAX_PENDING_IDS waiting a report is refused with Busy (its sender loses only statistics).
REPORT_CHUNK_IDS = 512
# A report whose sender waits for its misses is folded in as it is received when it costs at most this (a decode
# step's lookups in a layer, about a millisecond): bigger ones, and any behind queued work, take their turn.
URGENT_REPORT_IDS = 64
ROUTED_PER_LOOKUP = 64
MAX_PENDING_IDS = 1 << 16
# Requests waiting behind their sender's reports, at most (past that they are refused with Busy).
MAX_QUEUED_CALLS = 256
# Messages libzmq queues per connection each way (ZMQ_RCVHWM, ZMQ_SNDHWM; its default is 1000): with the gate's
# bound on parts and frames, what one connection can make the daemon hold (docs/security.md, "Connections and
# memory"). Past it libzmq stops reading that connection, and drops replies to a peer that does not read them.
PIPE_MESSAGES = 8
# A peer a reply could not be sent to (its pipe full: it does not read them; or gone) is forgotten as a client,
# and for this long after, its requests that have a reply are dropped undone: their replies would be dropped
# too. Reports and prefetches, which have none, are still carried out (a closing client's last reports).
DEAF_S = 1.0
# Where the daemon's own threads ask it (the metrics exporter, through src/moe_l2/control.py): an endpoint of the
# server's ZeroMQ context, which needs no socket permission and bypasses CurveZMQ, never leaving the process.
INPROC_ADDRESS = "inproc://moe-l2d"


@dataclass(frozen=True)
class ReportPiece:
    """A slice of a report that ServedModel.report folds in as it would the whole (report_pieces): lookups per
    layer [hits, misses], routed picks, its cost in looked-up ids, per layer the experts its loads must not evict
    and the misses its sender read itself and gives (not loaded); folded: its lookups reached the policy through
    the fill socket already (protocol.Report)."""

    layers: dict
    routed: dict
    cost: int
    keep: dict = field(default_factory=dict)
    given: dict = field(default_factory=dict)
    folded: bool = False


@dataclass
class Client:
    """An attached client, as its hellos and reports say: its name (L2Client names itself host:pid:nonce,
    client/connection.py), its last hello (time.monotonic()), its model, the MoE layers it streams (() when it did
    not say), where its lookups got their bytes as its reports said (protocol.TIER_COUNTERS) and its L0's rows held
    and ceiling (None when not said)."""

    name: str
    seen: float
    model: ServedModel
    layers: tuple[int, ...] = ()
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(protocol.TIER_COUNTERS, 0))
    l0_rows: int | None = None
    l0_ceiling: int | None = None


@dataclass(frozen=True)
class QueuedWork:
    """An item of the work queue: a report piece of `model` to fold in, or (model None) a request its sender
    made after reports still queued, answered in its turn."""

    identity: bytes
    model: ServedModel | None
    piece: ReportPiece | None = None
    request: protocol.Message | None = None


class Server:
    def __init__(self, address: str, models: list[ServedModel], loader: Loader, epoch: int, *,
                 socket_mode: int = 0o600, socket_group: int | None = None, curve: CurveKeys | None = None,
                 governor=None, gate: Gate | None = None, fills=None):
        """`address` is the public one; with a gate (daemon/gate.py) in front, which owns it, the ROUTER binds the
        gate's private socket instead. Without one (benchmarks, tests of the server alone) it binds `address`."""
        self.address = address
        self.gate = gate
        self.governor = governor  # daemon/governor.py, for the memory figures of `stats`
        self.fills = fills  # daemon/fills.py's FillDesk, for its figures in `stats`
        self.models = {m.files.fingerprint: m for m in models}
        self.loader = loader
        self.epoch = epoch
        self.started = time.time()
        self.clients: collections.OrderedDict[bytes, Client] = collections.OrderedDict()  # oldest hello first
        self.requests = 0
        self.errors = 0
        self.unanswered = 0  # requests of peers that do not read their replies, dropped undone
        self._deaf: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # identity -> when, oldest first
        # Report pieces waiting to be folded in, and the requests their senders made after them (see _run_work);
        # the pieces' total cost; how many requests wait; per identity, how many of its items are queued.
        self._work: collections.deque = collections.deque()
        self._pending_ids = 0
        self._queued_calls = 0
        self._waiting: dict[bytes, int] = {}
        self.model_paths = {m.files.fingerprint: os.path.realpath(m.files.path) for m in models}
        self._rss = OwnRss()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Twice MAX_FRAME_BYTES: frames up to this get a FrameTooLarge reply; the gate closes the connection of
        # a larger one, and so would libzmq (its sender's request() refuses to send one).
        self._socket.setsockopt(zmq.MAXMSGSIZE, FRAME_LIMIT)
        self._socket.setsockopt(zmq.RCVHWM, PIPE_MESSAGES)
        self._socket.setsockopt(zmq.SNDHWM, PIPE_MESSAGES)
        self._socket.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A send to a full pipe fails (EAGAIN) instead of vanishing, so that _send can tell a pipe that is full
        # from one that only looks full.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._auth = None
        if curve is not None:
            # CurveZMQ: encrypted, and only the clients whose public certificates are in curve.clients get in.
            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(curve.clients))
            self._socket.curve_secretkey = curve.secret
            self._socket.curve_publickey = curve.public
            self._socket.curve_server = True
        if gate is not None:
            gate.bind_inner(self._socket)
        elif address.startswith("ipc://"):
            bind_socket_file(lambda: self._socket.bind(address), address[len("ipc://"):], socket_mode, socket_group)
        else:
            self._socket.bind(address)
        self._refusals = RefusalLog(log, "requests")
        self._socket.bind(INPROC_ADDRESS)
        self._handlers = {
            protocol.Hello: self._hello, protocol.Stats: self._stats, protocol.Hint: self._hint,
            protocol.Prefetch: self._prefetch, protocol.Report: self._report, protocol.Pin: self._pin,
            protocol.Unpin: self._unpin, protocol.Bye: self._bye,
        }

    def serve(self, should_stop) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not should_stop():
            if self._work or poller.poll(100):
                for _ in range(RECEIVE_BATCH):
                    message = self._receive()
                    if message is None and not (self._work and self._socket.poll(REFILL_MS)):
                        break
                    if message is not None:
                        self._handle(*message)
                self._run_work(WORK_SLICE_S)
            self._expire_clients()
            self._refusals.flush()

    def _receive(self) -> tuple[list[bytes], int] | None:
        """One message, part by part: at most protocol.MAX_PARTS parts are kept, the rest counted and
        dropped. None when nothing is waiting."""
        try:
            frames = [self._socket.recv(zmq.NOBLOCK)]
        except zmq.Again:
            return None
        dropped = 0
        while self._socket.getsockopt(zmq.RCVMORE):
            part = self._socket.recv()  # libzmq delivers a message whole: its other parts are here
            if len(frames) < protocol.MAX_PARTS:
                frames.append(part)
            else:
                dropped += 1
        return frames, dropped

    def _handle(self, frames: list[bytes], dropped: int = 0) -> None:
        identity = frames[0]
        self.requests += 1
        try:
            if dropped:
                raise ProtocolError("TooManyParts", f"a request has at most {protocol.MAX_PARTS - 1} frames "
                                                    f"(an optional empty delimiter, the payload); this one had "
                                                    f"{len(frames) - 1 + dropped}")
            if len(frames) < 2:
                raise ProtocolError("MalformedFrame", "a request needs one payload frame")
            request = protocol.decode_request(frames[-1])
        except ProtocolError as exc:
            self._send(identity, self._refuse(exc.req_id, exc.ename, exc.evalue))
            return
        if identity in self._deaf and not isinstance(request, (protocol.Report, protocol.Prefetch)):
            self.unanswered += 1
            return
        if identity in self._waiting and not isinstance(request, (protocol.Hello, protocol.Report)):
            # This connection's earlier reports are still being folded in: keep its order (a stats after a
            # report sees the report; a hint after a report does not claim its counts). Heartbeats never wait;
            # a report queues its pieces behind anyway.
            if self._queued_calls >= MAX_QUEUED_CALLS:
                self._send(identity, self._refuse(request.id, "Busy", "moe-l2d has too many requests waiting "
                                                                      "behind reports: send fewer reports"))
                return
            self._queued_calls += 1
            self._enqueue(QueuedWork(identity, None, request=request))
            return
        self._answer(identity, request)

    def _answer(self, identity: bytes, request: protocol.Message) -> None:
        try:
            reply = self._handlers[type(request)](identity, request)
        except ProtocolError as exc:
            reply = self._refuse(request.id, exc.ename, exc.evalue)
        except Exception as exc:  # a handler bug must not take the daemon down
            log.exception("request failed")
            reply = self._refuse(request.id, "InternalError", f"{type(exc).__name__}: {exc}")
        if reply is not None:
            self._send(identity, reply)

    def _send(self, identity: bytes, reply: bytes) -> None:
        """Never blocks: a reply to a peer whose pipe is full (PIPE_MESSAGES) or gone is dropped.

        libzmq learns that the peer has read its messages from commands that a send takes in at most once a
        millisecond or so: a pipe the peer has drained can still look full, and a reply to a client that reads
        every one was lost under load. So a full pipe is looked at again after the pending commands are taken in
        (reading ZMQ_EVENTS does that at once), and the reply is dropped only if it is full still. A peer a reply
        was dropped for is deaf for DEAF_S (see there)."""
        gone = False
        for attempt in range(2):
            try:
                self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
                return
            except zmq.Again:
                if attempt == 0:
                    self._socket.getsockopt(zmq.EVENTS)
            except zmq.ZMQError as exc:  # the peer is gone (EHOSTUNREACH)
                log.debug("reply dropped: %s", exc)
                gone = True
                break
        if not gone and identity not in self._deaf:
            self._refusals.refused("NotReading", "a peer does not read its replies: forgotten as a client, and what "
                                   "it asks is dropped undone for %g s", DEAF_S)
        self._deaf.pop(identity, None)
        self._deaf[identity] = time.monotonic()
        self.clients.pop(identity, None)

    def _enqueue(self, item: QueuedWork) -> None:
        self._work.append(item)
        self._waiting[item.identity] = self._waiting.get(item.identity, 0) + 1

    def _run_work(self, budget_s: float) -> None:
        """Fold queued report pieces in, and answer the requests queued behind them, for about budget_s (at
        least one item)."""
        deadline = time.monotonic() + budget_s
        while self._work:
            item = self._work.popleft()
            left = self._waiting.pop(item.identity) - 1
            if left:
                self._waiting[item.identity] = left
            if item.model is None:
                self._queued_calls -= 1
                self._answer(item.identity, item.request)
            else:
                self._pending_ids -= item.piece.cost
                self._fold(item.model, item.identity, item.piece)
            if time.monotonic() >= deadline:
                return

    def _fold(self, model: ServedModel, identity: bytes, piece: ReportPiece) -> None:
        """Count a report piece of `identity`'s and load its misses (but those its sender gives)."""
        try:
            model.report(piece.layers, piece.routed, self.loader, piece.keep, piece.given, source=identity,
                         folded=piece.folded)
        except Exception:  # validated when received: only a bug gets here
            self.errors += 1
            log.exception("report work failed")

    def _refuse(self, req_id: int, ename: str, evalue: str) -> bytes:
        self.errors += 1
        self._refusals.refused(ename, "refused request: %s: %s", ename, evalue)
        return protocol.encode_error(req_id, ename, evalue)

    def _model(self, fingerprint: str) -> ServedModel:
        try:
            return self.models[fingerprint]
        except KeyError:
            raise ProtocolError("UnknownModel", f"no served model has fingerprint {protocol.quote(fingerprint)}; "
                                "served: " + ", ".join(self.model_paths.values())) from None

    def _hello(self, identity: bytes, req: protocol.Hello) -> bytes:
        model = self.models.get(req.fingerprint)
        if model is None:
            # The client sends its model's real path: a string compare, no file system call on its behalf.
            same_path = [fp for fp, path in self.model_paths.items() if path == req.model]
            if same_path:
                raise ProtocolError(
                    "FingerprintMismatch",
                    f"{protocol.quote(req.model)} differs from the files the daemon loaded (fingerprint "
                    f"{protocol.quote(req.fingerprint)} vs {same_path[0]}): the model changed on disk; "
                    "restart moe-l2d")
            self._model(req.fingerprint)
        for layer in req.layers:
            if not 0 <= layer < model.geometry.n_layers:
                raise ProtocolError("BadField", f"hello: the client streams MoE layer {layer}, but {model.files.path} "
                                                f"has MoE layers 0..{model.geometry.n_layers - 1}")
        if not 0 <= req.l0_rows <= req.l0_ceiling <= protocol.MAX_COUNTER and (req.l0_rows, req.l0_ceiling) != (0, 0):
            raise ProtocolError("BadField", f"hello: an L0 of {req.l0_rows} rows held of at most {req.l0_ceiling}: "
                                            f"give 0 <= l0_rows <= l0_ceiling <= {protocol.MAX_COUNTER}")
        client = Client(req.client, time.monotonic(), model, tuple(sorted(set(req.layers))),
                        l0_rows=req.l0_rows if req.l0_ceiling else None, l0_ceiling=req.l0_ceiling or None)
        known = self.clients.pop(identity, None)
        if known is not None and known.name == req.client:
            client.tiers = known.tiers  # its reports' sums go on
        self.clients[identity] = client
        while len(self.clients) > MAX_CLIENTS:
            self.clients.popitem(last=False)
        g = model.geometry
        return protocol.HelloReply(
            epoch=self.epoch, fingerprint=model.files.fingerprint, index_segment=model.index_name,
            data_segments=list(model.data_names.values()), n_layers=g.n_layers, n_experts=g.n_experts,
            n_slots=g.n_slots, record_bytes=g.record_bytes, slot_stride=g.slot_stride,
            layers=list(model.layers)).encode(req.id)

    def _expire_clients(self) -> None:
        now = time.monotonic()
        while self.clients and next(iter(self.clients.values())).seen < now - CLIENT_TIMEOUT_S:
            self.clients.popitem(last=False)
        while self._deaf and next(iter(self._deaf.values())) < now - DEAF_S:
            self._deaf.popitem(last=False)

    def attached_clients(self) -> int:
        self._expire_clients()
        return len(self.clients)

    def _client_list(self) -> list[dict]:
        """Attached clients by name (L2Client names itself host:pid:nonce, client/connection.py), their model,
        and the decoder layers they said they stream (None: not said), with those the daemon does not serve
        and they read from their files (docs/architecture.md, "Served layers")."""
        now = time.monotonic()
        out = []
        for c in self.clients.values():
            parts = c.name.split(":")
            pid = int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None
            ids = c.model.files.layer_ids
            out.append({"name": c.name, "pid": pid, "idle_s": now - c.seen, "model": str(c.model.files.path),
                        "layer_ids": [ids[layer] for layer in c.layers] if c.layers else None,
                        "unserved_layer_ids": [ids[layer] for layer in c.layers if layer not in c.model.layers],
                        "tiers": dict(c.tiers), "l0_rows": c.l0_rows, "l0_ceiling": c.l0_ceiling})
        return out

    def _stats(self, identity: bytes, req: protocol.Stats) -> bytes:
        return protocol.encode_reply(
            req.id,
            daemon={
                "version": __version__, "pid": os.getpid(), "epoch": self.epoch, "socket": self.address,
                "uptime_s": time.time() - self.started, "rss_bytes": self._rss.read(),
                "clients": self.attached_clients(), "client_list": self._client_list(),
                "requests": self.requests, "errors": self.errors, "unanswered": self.unanswered,
                "loads_in_flight": self.loader.in_flight,
                "shm_bytes": sum(m.shm_bytes for m in self.models.values()),
                **shm_lock_figures(self.models.values()),
                "memory": self.governor.figures() if self.governor is not None else None,
                "gate": self.gate.figures() if self.gate is not None else None,
                "fills": self.fills.figures() if self.fills is not None else None,
            },
            models=[m.describe(routing=req.routing) for m in self.models.values()],
        )

    def _hint(self, identity: bytes, req: protocol.Hint) -> bytes:
        """Predict the domain of req.text (or take req.domain), pin and load its top experts; the reply names
        the domain, the confidence and the experts pinned per layer. NoProfile without a profile."""
        try:
            result = self._model(req.model).hint(req.text, req.domain, self.loader)
        except ProtocolError as exc:
            if exc.ename != "NoProfile":
                raise
            # An answer, not a refused request: clients keep working without hints (architecture.md,
            # "Control plane"), so it counts in neither `errors` nor the warning log.
            return protocol.encode_error(req.id, exc.ename, exc.evalue)
        return protocol.encode_reply(req.id, **result)

    def _prefetch(self, identity: bytes, req: protocol.Prefetch) -> None:
        self._checked(req).demand(req.layer, req.experts, self.loader)

    def _report(self, identity: bytes, req: protocol.Report) -> None:
        """Check the whole report now (a refusal reaches its sender before any later reply on the
        connection), queue it in pieces folded in between other requests, or fold it in now when its sender
        waits for its misses, it is small and nothing is queued. Layers the daemon does not serve are left out
        (their clients read them from the model files). The check here is the only one of its ids: `notify` and
        `given` only pick among the checked misses (report_pieces)."""
        model = self._model(req.model)
        layers, routed = model.served_part(req.layers), model.served_part(req.routed)
        model.check_ids({layer: [*hits, *misses] for layer, (hits, misses) in layers.items()})
        model.check_ids(routed)
        notify, given = model.served_part(req.notify), model.served_part(req.given)
        model.counters.add_prefetch(req.prefetch)  # a few integers: counted at once
        model.counters.add_tiers(req.tiers)
        client = self.clients.get(identity)
        if client is not None and client.model is model:
            for name, n in req.tiers.items():
                client.tiers[name] += n
        pieces = report_pieces(layers, routed, REPORT_CHUNK_IDS, given)
        if req.folded:
            pieces = [replace(piece, folded=True) for piece in pieces]
        cost = sum(piece.cost for piece in pieces)
        if notify and not self._work and cost <= URGENT_REPORT_IDS:
            # A client waits for its misses (load-through, asleep on their slot_of entries), nothing is queued before
            # it and it is small: folded in now, so that the misses go to the loaders at once, not after the receive
            # batch has waited for more.
            for piece in pieces:
                self._fold(model, identity, piece)
            return
        if self._pending_ids + cost > MAX_PENDING_IDS:
            raise ProtocolError("Busy", f"moe-l2d is {self._pending_ids} looked-up expert ids behind; this "
                                        "report was dropped: send fewer, smaller reports")
        self._pending_ids += cost
        for piece in pieces:
            self._enqueue(QueuedWork(identity, model, piece))

    def _checked(self, req: protocol.Prefetch | protocol.Pin) -> ServedModel:
        """The model a prefetch, pin or unpin names, the request checked whole: a pin's kind, then its layer and
        experts (ServedModel.check_ids), which nothing after checks again."""
        model = self._model(req.model)
        if isinstance(req, protocol.Pin) and req.kind not in protocol.PIN_KINDS:
            raise ProtocolError("BadField", f"pin kind {protocol.quote(req.kind)} is not one of "
                                            f"{', '.join(protocol.PIN_KINDS)}")
        model.check_ids({req.layer: req.experts})
        return model

    def _pin(self, identity: bytes, req: protocol.Pin) -> bytes:
        pinned, refused = self._checked(req).pin(req.layer, req.experts, req.kind, self.loader)
        return protocol.encode_reply(req.id, pinned=pinned, refused=refused)

    def _unpin(self, identity: bytes, req: protocol.Unpin) -> bytes:
        self._checked(req).unpin(req.layer, req.experts, req.kind)
        return protocol.encode_reply(req.id)

    def _bye(self, identity: bytes, req: protocol.Bye) -> bytes:
        self.clients.pop(identity, None)
        return protocol.encode_reply(req.id)

    @property
    def context(self) -> zmq.Context:
        """The server's ZeroMQ context: its sockets reach INPROC_ADDRESS."""
        return self._context

    def close(self) -> None:
        self._refusals.flush(final=True)
        self._rss.close()
        self._socket.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()


def report_pieces(layers: dict[int, list[list[int]]], routed: dict[int, list[int]], size: int,
                  given: dict[int, list[int]] | None = None) -> list[ReportPiece]:
    """Split a report into pieces of at most `size` looked-up ids (routed picks count 1/ROUTED_PER_LOOKUP each)
    that ServedModel.report counts as it counts the whole: layer by layer, its hits, then its misses (one piece
    where they fit, so that the policy sees the layer's lookups as one batch); when the report names its routed
    picks, the lookup pieces carry an empty pick list (so their lookups are not counted as picks). A piece with
    misses keeps (never evicts for its loads) every expert the report names in its layer, as the whole report
    would, and carries the misses of its own that the report's `given` names (the client gives them: not
    loaded)."""
    pieces = []
    # In layer order: a layer's context is the same client's latest lookups at the layer before (the learned
    # policy), this token's where the report has them.
    for layer, (hits, misses) in sorted(layers.items()):
        no_picks = {layer: []} if routed else {}
        keep = {layer: frozenset([*hits, *misses, *routed.get(layer, ())])}
        read = set((given or {}).get(layer, ()))
        if len(hits) + len(misses) <= size:
            gave = [e for e in misses if e in read]
            pieces.append(ReportPiece({layer: [hits, misses]}, no_picks, len(hits) + len(misses), keep,
                                      {layer: gave} if gave else {}))
            continue
        for start in range(0, len(hits), size):
            chunk = hits[start:start + size]
            pieces.append(ReportPiece({layer: [chunk, []]}, no_picks, len(chunk)))
        for start in range(0, len(misses), size):
            chunk = misses[start:start + size]
            gave = [e for e in chunk if e in read]
            pieces.append(ReportPiece({layer: [[], chunk]}, no_picks, len(chunk), keep, {layer: gave} if gave else {}))
    step = size * ROUTED_PER_LOOKUP
    for layer, picks in routed.items():
        for start in range(0, len(picks), step):
            chunk = picks[start:start + step]
            pieces.append(ReportPiece({}, {layer: chunk}, -(-len(chunk) // ROUTED_PER_LOOKUP)))
    return pieces
