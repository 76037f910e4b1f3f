"""The control plane: a ZeroMQ ROUTER socket answering the messages of moe_l2.protocol.

One thread owns the socket and the dispatch; loads run on the loader pool, so no request waits for a disk.
A bad request costs its sender an error reply and nothing else.
"""

from __future__ import annotations

import logging
import os
import time

import psutil
import zmq

from moe_l2 import __version__, protocol
from moe_l2.protocol import ProtocolError

from .loader import Loader
from .served import ServedModel
from .stats import shm_lock_figures

log = logging.getLogger("moe-l2d.server")

# A client heartbeats (hello) every couple of seconds; one silent for this long is no longer counted.
CLIENT_TIMEOUT_S = 30.0


class Server:
    def __init__(self, address: str, models: list[ServedModel], loader: Loader, epoch: int, governor=None):
        self.address = address
        self.governor = governor  # daemon/governor.py, for the memory figures of `stats`
        self.models = {m.files.fingerprint: m for m in models}
        self.loader = loader
        self.epoch = epoch
        self.started = time.time()
        self.clients: dict[bytes, tuple[str, float]] = {}
        self.requests = 0
        self.errors = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Far above MAX_FRAME_BYTES: larger frames still get an error reply; this only bounds memory.
        self._socket.setsockopt(zmq.MAXMSGSIZE, 64 * protocol.MAX_FRAME_BYTES)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.bind(address)
        self._handlers = {
            protocol.Hello: self._hello, protocol.Stats: self._stats, protocol.Hint: self._hint,
            protocol.Prefetch: self._prefetch, protocol.Report: self._report, protocol.Pin: self._pin,
            protocol.Unpin: self._unpin, protocol.Bye: self._bye,
        }

    def serve(self, should_stop) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not should_stop():
            if not poller.poll(100):
                continue
            while True:
                try:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[-1]
        self.requests += 1
        req_id = 0
        try:
            if len(frames) < 2:
                raise ProtocolError("MalformedFrame", "a request needs one payload frame")
            request = protocol.decode_request(payload)
            req_id = request.id
            reply = self._handlers[type(request)](identity, request)
        except ProtocolError as exc:
            reply = self._refuse(req_id, exc.ename, exc.evalue)
        except (IndexError, ValueError, KeyError) as exc:
            reply = self._refuse(req_id, "OutOfRange" if isinstance(exc, IndexError) else "BadRequest",
                                 str(exc).strip("'\""))
        except Exception as exc:  # a handler bug must not take the daemon down
            log.exception("request failed")
            reply = self._refuse(req_id, "InternalError", f"{type(exc).__name__}: {exc}")
        if reply is not None:
            try:
                self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the peer is gone or not reading; it was its request
                log.debug("reply dropped: %s", exc)

    def _refuse(self, req_id: int, ename: str, evalue: str) -> bytes:
        self.errors += 1
        log.warning("refused request: %s: %s", ename, evalue)
        return protocol.encode_error(req_id, ename, evalue)

    def _model(self, fingerprint: str) -> ServedModel:
        try:
            return self.models[fingerprint]
        except KeyError:
            raise ProtocolError("UnknownModel", f"no served model has fingerprint {fingerprint!r}; served: "
                                + ", ".join(str(m.files.path) for m in self.models.values())) from None

    def _hello(self, identity: bytes, req: protocol.Hello) -> bytes:
        model = self.models.get(req.fingerprint)
        if model is None:
            same_path = [m for m in self.models.values()
                         if os.path.realpath(m.files.path) == os.path.realpath(req.model)]
            if same_path:
                raise ProtocolError(
                    "FingerprintMismatch",
                    f"{req.model} differs from the files the daemon loaded (fingerprint {req.fingerprint} vs "
                    f"{same_path[0].files.fingerprint}): the model changed on disk; restart moe-l2d")
            self._model(req.fingerprint)
        self.clients[identity] = (req.client, time.monotonic())
        g = model.geometry
        return protocol.encode_reply(
            req.id, epoch=self.epoch, fingerprint=model.files.fingerprint, index_segment=model.index_name,
            data_segments=model.data_names, n_layers=g.n_layers, n_experts=g.n_experts, n_slots=g.n_slots,
            record_bytes=g.record_bytes, slot_stride=g.slot_stride)

    def attached_clients(self) -> int:
        cutoff = time.monotonic() - CLIENT_TIMEOUT_S
        self.clients = {k: v for k, v in self.clients.items() if v[1] >= cutoff}
        return len(self.clients)

    def _client_list(self) -> list[dict]:
        """Attached clients by name; L2Client names itself host:pid:nonce (client/connection.py)."""
        now = time.monotonic()
        out = []
        for name, seen in self.clients.values():
            parts = name.split(":")
            pid = int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None
            out.append({"name": name, "pid": pid, "idle_s": now - seen})
        return out

    def _stats(self, identity: bytes, req: protocol.Stats) -> bytes:
        process = psutil.Process()
        return protocol.encode_reply(
            req.id,
            daemon={
                "version": __version__, "pid": os.getpid(), "epoch": self.epoch, "socket": self.address,
                "uptime_s": time.time() - self.started, "rss_bytes": process.memory_info().rss,
                "clients": self.attached_clients(), "client_list": self._client_list(),
                "requests": self.requests, "errors": self.errors,
                "loads_in_flight": self.loader.in_flight,
                "shm_bytes": sum(m.shm_bytes for m in self.models.values()),
                **shm_lock_figures(self.models.values()),
                "memory": self.governor.figures() if self.governor is not None else None,
            },
            models=[m.describe(routing=req.routing) for m in self.models.values()],
        )

    def _hint(self, identity: bytes, req: protocol.Hint) -> bytes:
        """Predict the domain of req.text (or take req.domain), pin and load its top experts; the reply names
        the domain, the confidence and the experts pinned per layer. NoProfile without a profile."""
        result = self._model(req.model).hint(req.text, req.domain, self.loader)
        return protocol.encode_reply(req.id, **result)

    def _prefetch(self, identity: bytes, req: protocol.Prefetch) -> None:
        self._model(req.model).demand(req.layer, req.experts, self.loader)

    def _report(self, identity: bytes, req: protocol.Report) -> None:
        self._model(req.model).report(req.layers, req.routed, self.loader)

    def _pin_kind(self, kind: str) -> str:
        if kind not in protocol.PIN_KINDS:
            raise ProtocolError("BadField", f"pin kind {kind!r} is not one of {', '.join(protocol.PIN_KINDS)}")
        return kind

    def _pin(self, identity: bytes, req: protocol.Pin) -> bytes:
        pinned, refused = self._model(req.model).pin(req.layer, req.experts, self._pin_kind(req.kind),
                                                      self.loader)
        return protocol.encode_reply(req.id, pinned=pinned, refused=refused)

    def _unpin(self, identity: bytes, req: protocol.Unpin) -> bytes:
        self._model(req.model).unpin(req.layer, req.experts, self._pin_kind(req.kind))
        return protocol.encode_reply(req.id)

    def _bye(self, identity: bytes, req: protocol.Bye) -> bytes:
        self.clients.pop(identity, None)
        return protocol.encode_reply(req.id)

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
