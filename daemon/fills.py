"""The fill desk: records that clients of the daemon's own uid read themselves, copied into L2 by those clients
(src/moe_l2/fill_protocol.py has the conversation, docs/architecture.md "Fills" the design, docs/security.md "Who may
write L2" the argument).

One thread owns the fill socket (mode 0600, beside the control socket) and its connections. A connection is
taken only from a process the kernel says runs as the daemon's uid (daemon/peers.py): that process can open the
data segments writable anyway, so it is the daemon's own principal; any other is told `refused` and closed. For
each record a donor gives that the policy admits, the desk reserves a slot as a load would (ServedModel.reserve: seq
odd, the evicted expert unmapped, so every reader passes the slot by) and offers it; the donor's `filled` sends the
slot to a loader thread that checks its bytes and publishes them (ServedModel.take_donation), `cancelled` frees it.
A donor's every lookup (`look`) reaches the policy here, in order with its gives, and not through its reports.

A slot offered is never given to anything else while its donor may still write into it: not on a timeout, not when
the connection closes (a stopped process keeps its mapping and may write later), only on `filled`, `cancelled` or
once the donor process is gone (ExitWatch). Each donor holds at most MAX_OFFERS slots at once; what it gives past
that the daemon reads itself.
"""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import socket
import threading
from dataclasses import dataclass, field
from functools import partial

from moe_l2.cache.store import Reservation
from moe_l2.fill_protocol import FillProtocolError, FrameReader, encode
from moe_l2.protocol import ProtocolError

from moe_l2.daemon.peers import Credentials, ExitWatch, peer_credentials
from moe_l2.daemon.refusals import RefusalLog
from moe_l2.daemon.served import ServedModel
from moe_l2.daemon.sockets import bind_socket_file

log = logging.getLogger("moe-l2d.fills")

# Slots one donor process may hold offered at once: a bound on what a stuck donor keeps from everyone else, and
# room for a prefill's misses in two layers of a 128-expert model (past it the daemon reads the rest itself).
MAX_OFFERS = 256
# Donor connections at once (and donors gone quiet whose process has not exited yet).
MAX_DONORS = 256
RECEIVE_BYTES = 64 << 10
TICK_S = 0.5
_SOURCES = itertools.count()


@dataclass(eq=False)
class Offer:
    model: ServedModel
    layer: int
    reservation: Reservation


@dataclass(eq=False)
class Donor:
    """One donor process' connection, its exit watch and the slots offered to it, by (model, layer, expert)."""

    sock: socket.socket | None
    peer: Credentials
    watch: ExitWatch
    reader: FrameReader = field(default_factory=lambda: FrameReader(("look", "give", "filled", "cancelled")))
    offers: dict[tuple[str, int, int], Offer] = field(default_factory=dict)
    # Its lookups' client for the policy (the learned one follows each client's own): every lookup of a process
    # that gives comes here (`look`), none through its reports.
    source: tuple = field(default_factory=lambda: ("fill", next(_SOURCES)))


class FillDesk:
    def __init__(self, path: str, models: list[ServedModel], loader, epoch: int):
        self.path = path
        self.models = {m.files.fingerprint: m for m in models}
        self.loader = loader
        self.epoch = epoch
        self.uid = os.geteuid()
        self.turned_away = 0  # connections of another uid (or of no known peer), refused
        self._donors: set[Donor] = set()
        self._refusals = RefusalLog(log, "fill connections")
        try:
            os.unlink(path)  # a predecessor's: the daemon's lock is held
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_socket_file(lambda: self._listener.bind(path), path, 0o600, None)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="moe-l2d-fills", daemon=True)

    def start(self) -> "FillDesk":
        self._thread.start()
        return self

    def figures(self) -> dict:
        """For `stats`: donors connected, donors whose connection closed with slots still offered (their process
        has not exited), the slots offered now, and connections refused."""
        donors = list(self._donors)
        return {"donors": sum(d.sock is not None for d in donors),
                "awaiting_exit": sum(d.sock is None for d in donors),
                "offers": sum(len(d.offers) for d in donors), "turned_away": self.turned_away}

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._wake_w.send(b"\0")
            self._thread.join()
        for donor in list(self._donors):
            self._forget(donor)
        self._refusals.flush(final=True)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(TICK_S):
                what = key.data
                if what == "accept":
                    self._accept()
                elif what == "wake":
                    self._wake_r.recv(64)
                elif key.fileobj is what.watch:  # the donor process exited
                    self._reclaim(what)
                else:
                    self._serve(what)
            self._refusals.flush()

    def _serve(self, donor: Donor) -> None:
        """Read a donor's messages; a bug costs that connection (its slots wait for its exit), never the desk."""
        try:
            self._read(donor)
        except Exception:
            log.exception("fill desk: closed a donor's connection (pid %d) after an internal error", donor.peer.pid)
            self._hang_up(donor)

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._refusals.refused("accept", "cannot accept a fill connection: %s", exc.strerror)
                return
            peer = peer_credentials(sock)
            if peer is None or peer.uid != self.uid:
                self._turn_away(sock, "its process runs as another user than moe-l2d: it may not write L2 "
                                      "(docs/security.md, \"Who may write L2\"); the daemon loads its misses")
            elif len(self._donors) >= MAX_DONORS:
                self._turn_away(sock, f"{MAX_DONORS} donors are connected, the most the daemon takes")
            else:
                self._open(sock, peer)

    def _turn_away(self, sock: socket.socket, why: str) -> None:
        self.turned_away += 1
        self._refusals.refused("peer", "refused a fill connection: %s", why)
        try:
            sock.send(encode("refused", reason=why))
        except OSError:
            pass
        sock.close()

    def _open(self, sock: socket.socket, peer: Credentials) -> None:
        sock.setblocking(False)
        try:
            watch = ExitWatch(peer.pid)
        except OSError:  # gone already (or unwatchable): nothing it offers could be reclaimed
            sock.close()
            return
        donor = Donor(sock, peer, watch)
        self._donors.add(donor)
        self._selector.register(watch, selectors.EVENT_READ, donor)
        self._selector.register(sock, selectors.EVENT_READ, donor)
        self._send(donor, encode("welcome", epoch=self.epoch))

    def _send(self, donor: Donor, frame: bytes) -> None:
        """Small frames on a blocking-free socket: a donor that does not read its offers loses them (the slots
        stay its own until it says filled or cancelled, or exits), never the desk's time."""
        try:
            donor.sock.send(frame)
        except (BlockingIOError, OSError):
            self._refusals.refused("send", "a fill donor (pid %d) does not read: a message to it was dropped",
                                   donor.peer.pid)

    def _read(self, donor: Donor) -> None:
        try:
            data = donor.sock.recv(RECEIVE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._hang_up(donor)
            return
        try:
            for message in donor.reader.feed(data):
                self._handle(donor, message)
        except FillProtocolError as exc:
            self._refusals.refused("protocol", "closed a fill connection (pid %d): %s", donor.peer.pid, exc)
            self._hang_up(donor)

    def _handle(self, donor: Donor, message) -> None:
        model = self.models.get(message.model)
        served = model is not None and message.layer in model.stores
        if message.type == "look":
            if served:
                self._look(donor, model, message.layer, message.experts)
            return
        if message.type == "give":
            # Every give is answered by one offer, empty for another daemon's model or a layer not served.
            reserved = self._give(donor, model, message.layer, message.experts, message.keep) if served else []
            self._send(donor, encode("offer", model=message.model, layer=message.layer,
                                     slots=[[r.expert, r.slot] for r in reserved]))
            return
        if not served:
            return
        key = (message.model, message.layer, message.expert)
        offer = donor.offers.get(key)
        if offer is None or offer.reservation.slot != message.slot:
            return  # not this donor's slot: never end a fill on its word
        r = offer.reservation
        if message.type == "cancelled":
            # The donor's row was taken before it could copy: the daemon reads the record instead, so that L2
            # still holds every record read once (at the cost of a second read of this one).
            model.counters.add_fills("cancelled")
        work = (partial(model.take_donation, message.layer, r, message.checksum) if message.type == "filled"
                else partial(model.fill, message.layer, r))
        self.loader.submit(work, partial(model.abort_fill, message.layer, r))
        del donor.offers[key]  # after the loader counts it: an offer is always in flight somewhere (stats)

    def _look(self, donor: Donor, model: ServedModel, layer: int, experts: list[int]) -> None:
        """Fold a donor's lookup into the layer's policy, before the give that follows it: its slots and victims are
        then chosen as replay chooses them, knowing the batch (docs/decisions.md, "The policy sees a lookup before
        its give"); ignored when an id is out of range (checked here, where the lookup enters: check_ids)."""
        try:
            model.check_ids({layer: experts})
        except ProtocolError:
            return
        if experts:
            model.observe(layer, experts, donor.source)

    def _give(self, donor: Donor, model: ServedModel, layer: int, experts: list[int],
              keep: list[int]) -> list[Reservation]:
        """Reserve slots for the records the donor holds that L2 neither holds nor loads and its policy admits, up
        to its bound: the slots to offer; none when an id is out of range (checked here, where the give enters:
        check_ids)."""
        try:
            model.check_ids({layer: [*experts, *keep]})
        except ProtocolError:
            return []
        fp = model.files.fingerprint
        wanted = [e for e in dict.fromkeys(experts) if (fp, layer, e) not in donor.offers]
        room = max(0, MAX_OFFERS - len(donor.offers))
        kept = frozenset(keep).union(wanted)
        reservations = model.reserve(layer, wanted[:room], kept, optional=True)
        # Past the donor's bound the daemon reads them itself: a record reported as given is read by someone.
        model.demand(layer, wanted[room:], self.loader, kept)
        with model.lock:
            store = model.stores[layer]
            refused = sum(not store.has(e) for e in wanted)
        model.counters.add_fills("offered", len(reservations))
        model.counters.add_fills("refused", refused)
        for r in reservations:
            donor.offers[fp, layer, r.expert] = Offer(model, layer, r)
        return reservations

    def _hang_up(self, donor: Donor) -> None:
        """The connection closed: forget the donor, unless it still holds slots; those wait for its exit."""
        if donor.sock is not None:
            self._selector.unregister(donor.sock)
            donor.sock.close()
            donor.sock = None
        if not donor.offers or donor.watch.exited():
            self._reclaim(donor)

    def _reclaim(self, donor: Donor) -> None:
        """The donor process is gone (or holds nothing): its slots are free again, never published."""
        for offer in donor.offers.values():
            offer.model.counters.add_fills("reclaimed")
            offer.model.abort_fill(offer.layer, offer.reservation)
        donor.offers.clear()
        self._forget(donor)

    def _forget(self, donor: Donor) -> None:
        if donor not in self._donors:
            return
        self._donors.discard(donor)
        self._selector.unregister(donor.watch)
        donor.watch.close()
        if donor.sock is not None:
            self._selector.unregister(donor.sock)
            donor.sock.close()
            donor.sock = None
