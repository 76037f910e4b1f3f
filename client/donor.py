"""Donor: gives moe-l2d the records this process read from the model file itself, off the token's path.

A miss is read by the process that needs it, into its L0 row, as with no daemon at all. As the read starts, `give`
queues the record here and returns, and this thread tells the daemon's fill desk (daemon/fills.py,
src/moe_l2/fill_protocol.py), so that the desk reserves a slot while the read runs; the read says as each record
lands (a packed model's: ModelFiles.read_into_rows' `landed`), `read_done` when it ended. Once the slot is offered
and the record whole, the thread copies the row into the offered slot through a writable mapping of the
layer's data segment (checksummed as it lands: _native.copy_record) and says `filled`, or `cancelled` when the
read failed or the row was handed out again since (its writes count moved: a fetch waits for an offered copy only
so long, client/layerpool.py's DONATION_WAIT_S).
One disk read per miss, the process's own, and L2 holds the record afterwards (docs/architecture.md, "Fills").
Every lookup of the process goes to the desk too (`look`), in order, ahead of the give of its misses: the daemon's
policy chooses a give's slot knowing the batch that made it, and the process's reports only count the lookups.

Only a process of the daemon's uid gets to fill: the desk refuses any other, whose data segments are not writable
to it anyway; such a process reports its misses for the daemon to load (`accepting` is False).
"""

from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from moe_l2 import _native
from moe_l2.control import UntrustedDaemon, check_socket
from moe_l2.fill_protocol import FillProtocolError, FrameReader, encode, fill_socket_path

log = logging.getLogger("moe-l2.client")

# How long a new connection waits for the desk's welcome, and closing for the answers to gives already sent.
ANSWER_S = 2.0
# How often the thread looks whether the attachment changed (a daemon restarted) while nothing else happens.
TICK_S = 0.2
# While a desk takes this process: the longest a lookup with no give after it waits to be sent, as a report waits
# for its connection's flush (L2Client's flush_s).
LOOK_S = 0.02


@dataclass(eq=False)
class Gift:
    """A record being read into an L0 row: the layer's pool, the row and its writes count when it was taken for
    the read. `read` is set by the reading thread (True: whole, False: the read failed); the rest by the donor's."""

    layer: int
    expert: int
    pool: object  # client/layerpool.py's LayerPool
    row: int
    writes: int
    read: bool | None = None
    slot: int | None = None  # offered for it
    done: bool = False  # copied, cancelled or dropped: its row released
    landed: object = None  # the pool's landed words (Rows.landed), whose word of `row` the read sets as it lands

    def whole(self) -> bool | None:
        """Whether the row holds the whole record: True once its own read landed or the read ended whole, False
        once the read failed, None while it runs."""
        # The word before `read`: by the time the row is handed out again (its word cleared, its writes count up,
        # which `_copy` checks), `read` is set, so a word loaded while it was unset is this read's.
        landed = self.landed is not None and self.landed.load_u32(4 * self.row)
        if self.read is not None:
            return self.read
        return True if landed else None


@dataclass
class Look:
    """A layer's lookup, every expert looked up in L2, for the desk's policy (Donor.look)."""

    layer: int
    experts: list[int]


@dataclass
class Give:
    """Records about to be read into rows of a layer's pool (Donor.give), and the experts their slots must not be
    taken from."""

    layer: int
    gifts: list[Gift]
    keep: list[int]


@dataclass
class DonorCounts:
    given: int = 0      # records told to the desk
    filled: int = 0     # copied into a slot offered
    cancelled: int = 0  # offered, but the row was refilled first
    mapped: int = 0     # slots mapped ahead of their first copy (Donor._prefault)


class Donor:
    def __init__(self, client, files):
        """client: the L2Client whose attachment (daemon epoch, segments) the donations follow."""
        self.client = client
        self.files = files
        self.counts = DonorCounts()
        self.refused = ""  # why the desk of the epoch attached now turned this process away, if it did
        self._path = fill_socket_path(client.address)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # Look and Give, in the order made
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._epoch: int | None = None  # the epoch whose desk welcomed us
        self._tried: int | None = None  # the epoch whose desk we last tried
        self._sock: socket.socket | None = None
        self._reader = FrameReader(("welcome", "refused", "offer"))
        self._writable: dict[int, object] = {}  # MoE layer -> its data segment, mapped writable
        self._mapped: set[tuple[int, int]] = set()  # (layer, slot) whose pages the writable mapping maps
        self._sent: collections.deque = collections.deque()  # per give sent, its gifts by expert, awaiting an offer
        self._sends = self._answers = 0  # gives appended to _sent, and taken off it (offered or dropped)
        self._answer_asks: queue.SimpleQueue = queue.SimpleQueue()  # wait_answered's events, each taken in turn
        self._answer_waits: list[tuple[int, threading.Event]] = []  # an event, set once _answers reaches its count
        self._offered: dict[Gift, None] = {}  # offered a slot, their record not whole yet, in the order offered
        self._thread = threading.Thread(target=self._run, name="moe-l2-donor", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        """The desk of the daemon attached now took this process: its misses are given, not loaded by the
        daemon."""
        attachment = self.client.attachment
        return attachment is not None and self._epoch == attachment.epoch

    def wait_accepted(self, timeout_s: float) -> bool:
        """Until the desk of the daemon attached now took this process (True), or timeout_s passed; False at once
        where it refused."""
        deadline = time.monotonic() + timeout_s
        while not self.accepting and time.monotonic() < deadline:
            if self.refused:
                return False
            time.sleep(0.01)
        return self.accepting

    def wait_answered(self, timeout_s: float) -> bool:
        """Until every record given so far was told to the desk and its give answered by an offer, or dropped
        (True), or timeout_s passed (False). What is left then the daemon counts: the slots it offered and its
        loads (client/connection.py's wait_idle)."""
        answered = threading.Event()
        self._answer_asks.put(answered)
        self._wake()
        return answered.wait(timeout_s)

    @property
    def wake_fd(self) -> int:
        """A byte written here wakes the donor's thread (what `give` leaves to the caller)."""
        return self._wake_w.fileno()

    def give(self, layer: int, pool, experts: list[int], rows: list[int], keep=(), landed=None) -> list[Gift]:
        """Queue records about to be read into these rows of the layer's pool; returns at once, with the gifts
        to pass to `read_done` once the read has ended; the caller wakes the thread (wake_fd) once the read has
        let go of the GIL. keep: experts of the layer the slots must not be taken from (the batch computing on L2's
        records in place).
        landed: the pool's landed words (Rows.landed), whose word of rows[i] the read sets as experts[i]'s record
        lands, and wakes the thread (ModelFiles.read_into_rows), which copies it then."""
        gifts = [Gift(layer, expert, pool, row, pool.giving(row, True), landed=landed)
                 for expert, row in zip(experts, rows)]
        self._queue.put(Give(layer, gifts, list(keep)))
        return gifts

    def look(self, layer: int, experts: list[int]) -> None:
        """Queue a lookup of the layer (every expert looked up in L2) for the desk's policy; returns at once. It goes
        out in order with the gives, before the give of its misses, or with the thread's next tick."""
        self._queue.put(Look(layer, experts))

    def read_done(self, gifts: list[Gift], whole: bool) -> None:
        """The gifts' read ended: their rows hold the whole records (whole), or the read failed."""
        for gift in gifts:
            gift.read = whole
        if gifts:
            self._wake()

    def _wake(self) -> None:
        # The GIL kept: woken by a send, the thread took the GIL from a fetch about to return (docs/benchmarks.md,
        # "A filled miss's CPU, thread by thread").
        _native.wake(self._wake_w.fileno())

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                self._follow_attachment(selector)
                for key, _ in selector.select(LOOK_S if self._sock is not None else TICK_S):
                    if key.fileobj is self._wake_r:
                        try:
                            self._wake_r.recv(4096)
                        except BlockingIOError:
                            pass
                    elif not self._receive():
                        self._disconnect(selector)
                        break
                self._send_queued()
                self._answer_whole()
                self._end_answer_waits()
            self._drain(selector)
        finally:
            self._disconnect(selector)
            selector.close()

    def _follow_attachment(self, selector) -> None:
        """Connect to the desk of the daemon attached now, once per epoch; drop a connection to an older one."""
        attachment = self.client.attachment
        epoch = attachment.epoch if attachment is not None else None
        if self._sock is not None and self._epoch != epoch:
            self._disconnect(selector)
        if epoch is None or epoch == self._tried or self._path is None:
            return
        self._tried = epoch
        try:
            self._connect(attachment)
        except (OSError, UntrustedDaemon, FillProtocolError, ValueError) as exc:
            self._disconnect(selector)
            self.refused = self.refused or str(exc)
            log.info("not filling moe-l2d's shared memory: %s", exc)
            return
        selector.register(self._sock, selectors.EVENT_READ)

    def _connect(self, attachment) -> None:
        check_socket(f"ipc://{self._path}", self.client.trusted)
        self.refused = ""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        sock.settimeout(ANSWER_S)
        sock.connect(self._path)
        self._reader = FrameReader(("welcome", "refused", "offer"))
        messages = []
        while not messages:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the fill desk closed the connection")
            messages = self._reader.feed(data)
        first = messages[0]
        if first.type == "refused":
            self.refused = first.reason
            raise PermissionError(f"moe-l2d refused: {first.reason}")
        if first.type != "welcome" or first.epoch != attachment.epoch:
            raise ValueError("the fill desk belongs to another moe-l2d than the one attached")
        # Writable mappings of the data segments the attachment mapped read-only and checked: the same objects
        # (same owner), or the fills stay off.
        writable = {}
        for layer in attachment.layers:
            seen = attachment.data[layer]
            segment = _native.Segment.open(seen.name, readonly=False, min_size=seen.nbytes)
            if segment.owner_uid != seen.owner_uid:
                raise UntrustedDaemon(f"segment {seen.name} changed owner since it was mapped")
            writable[layer] = segment
        self._writable, self._mapped = writable, set()
        self._epoch = attachment.epoch
        for message in messages[1:]:
            self._on_offer(message)

    def _disconnect(self, selector) -> None:
        if self._sock is not None:
            try:
                selector.unregister(self._sock)
            except (KeyError, ValueError):
                pass
            self._sock.close()
        self._sock, self._epoch = None, None
        self._writable, self._mapped = {}, set()
        while self._sent:
            self._answers += 1
            self._drop(self._sent.popleft()[1].values())
        self._drop(list(self._offered))

    def _send(self, frame: bytes) -> bool:
        """Frames are small and the desk reads at once: a full socket buffer waits for it, up to ANSWER_S."""
        try:
            self._sock.sendall(frame)
            return True
        except OSError:
            return False

    def _send_queued(self) -> None:
        """Tell the desk of the lookups and records queued, in order, a layer's consecutive gives as one give;
        dropped while no desk takes them."""
        # The waits asked for before the queue is taken: every give queued before one of them is taken below.
        asks = []
        while not self._answer_asks.empty():
            asks.append(self._answer_asks.get_nowait())
        # Consecutive gives of one layer, merged: an expert given again replaces its gift.
        layer, gifts, keep = None, {}, set()
        try:
            while True:
                item = self._queue.get_nowait()
                if isinstance(item, Look):
                    self._send_give(layer, gifts, keep)
                    layer, gifts, keep = None, {}, set()
                    if self._takes(item.layer):
                        self._send(encode("look", model=self.files.fingerprint, layer=item.layer,
                                          experts=item.experts))
                    continue
                if item.layer != layer:
                    self._send_give(layer, gifts, keep)
                    layer, gifts, keep = item.layer, {}, set()
                for gift in item.gifts:
                    self._drop([gifts.pop(gift.expert)] if gift.expert in gifts else [])
                    gifts[gift.expert] = gift
                keep.update(item.keep)
        except queue.Empty:
            pass
        self._send_give(layer, gifts, keep)
        self._answer_waits += [(self._sends, ask) for ask in asks]

    def _takes(self, layer: int) -> bool:
        """A desk is connected and the layer's data segment mapped writable."""
        return self._sock is not None and layer in self._writable

    def _send_give(self, layer: int | None, gifts: dict[int, Gift], keep: set[int]) -> None:
        if not gifts:
            return
        if self._takes(layer) and self._send(encode("give", model=self.files.fingerprint, layer=layer,
                                                    experts=list(gifts), keep=sorted(keep))):
            self._sent.append((layer, gifts))
            self._sends += 1
            self.counts.given += len(gifts)
        else:
            self._drop(gifts.values())

    def _end_answer_waits(self) -> None:
        """Set the wait_answered events whose gives are all answered."""
        waiting = []
        for sends, ask in self._answer_waits:
            if sends <= self._answers:
                ask.set()
            else:
                waiting.append((sends, ask))
        self._answer_waits = waiting

    def _receive(self) -> bool:
        """Take the desk's offers; False once the connection is gone or broke the protocol."""
        try:
            data = self._sock.recv(65536)  # readable: returns at once
        except OSError:
            return False
        if not data:
            return False
        try:
            for message in self._reader.feed(data):
                self._on_offer(message)
        except FillProtocolError as exc:
            log.warning("dropped the fill connection to moe-l2d: %s", exc)
            return False
        return True

    def _on_offer(self, message) -> None:
        """Copy each record offered into its slot and say filled, or cancelled; one offer answers each give."""
        if message.type != "offer" or not self._sent:
            raise FillProtocolError(f"an unexpected {message.type!r} from the fill desk")
        layer, gifts = self._sent.popleft()
        self._answers += 1
        if message.layer != layer or message.model != self.files.fingerprint:
            raise FillProtocolError("an offer for another give than the one sent")
        reading = []
        for expert, slot in message.slots:
            gift = gifts.pop(expert, None)
            if gift is None:
                self._answer(Gift(layer, expert, None, -1, -1, read=False, slot=slot))
                continue
            if not gift.done:
                gift.pool.offer(gift.row)
            gift.slot = slot
            if gift.whole() is None:
                self._offered[gift] = None  # copied once its record has landed (_answer_whole)
                reading.append(gift)
            else:
                self._answer(gift)
        self._drop(gifts.values())  # those L2 holds or loads already, or has no room for
        for gift in reading:
            if gift.whole() is None:
                self._prefault(gift)

    def _prefault(self, gift: Gift) -> None:
        """Map the offered slot's pages while the read still runs: a first write into a page of a mapping costs a
        fault, which made the copy after the read 5 times as long (docs/benchmarks.md, "The donor's copy"). A slot
        this mapping wrote before is left alone: asking again would walk its pages, and where the kernel or moe-l2d's
        governor took them back since, the copy faults them in as before."""
        key, stride = (gift.layer, gift.slot), self._slot_stride(gift.layer, gift.slot)
        if stride is None or key in self._mapped:
            return  # not one of the layer's slots (_copy refuses it), or mapped already
        try:
            self._writable[gift.layer].prefault(gift.slot * stride, stride)
        except OSError as exc:
            log.debug("could not map slot %d of layer %d ahead of its copy: %s", gift.slot, gift.layer, exc)
            return
        self._mapped.add(key)
        self.counts.mapped += 1

    def _slot_stride(self, layer: int, slot: int) -> int | None:
        """The slot stride of the daemon attached now, where `slot` is one of the layer's slots; else None."""
        attachment = self.client.attachment
        if attachment is None or not 0 <= slot < attachment.slots[layer]:
            return None
        return attachment.geometry.slot_stride

    def _answer_whole(self) -> None:
        """Answer the offers whose records landed or whose reads ended since."""
        for gift in [gift for gift in self._offered if gift.whole() is not None]:
            del self._offered[gift]
            self._answer(gift)

    def _answer(self, gift: Gift) -> None:
        """Copy an offered gift into its slot and say filled, or say cancelled."""
        checksum = self._copy(gift, gift.slot) if gift.whole() and not gift.done else None
        self._drop([gift])
        fields = {"model": self.files.fingerprint, "layer": gift.layer, "expert": gift.expert, "slot": gift.slot}
        if checksum is None:
            self.counts.cancelled += 1
            self._send(encode("cancelled", **fields))
        else:
            self.counts.filled += 1
            self._send(encode("filled", checksum=checksum, **fields))

    def _drop(self, gifts) -> None:
        """The donor is done with these gifts' rows (copied, cancelled or not wanted); an offered one not
        answered yet is cancelled."""
        for gift in list(gifts):
            if gift.done:
                continue
            gift.done = True
            if gift.pool is not None:
                gift.pool.giving(gift.row, False, offered=gift.slot is not None)
            if gift in self._offered:
                del self._offered[gift]
                if self._sock is not None:
                    self.counts.cancelled += 1
                    self._send(encode("cancelled", model=self.files.fingerprint, layer=gift.layer,
                                      expert=gift.expert, slot=gift.slot))

    def _copy(self, gift: Gift, slot: int) -> int | None:
        """Copy the gift's row into the slot; its checksum, or None when the row was handed out again since the
        record was read (before or during the copy) or the slot is not one of the layer's."""
        stride = self._slot_stride(gift.layer, slot)
        if stride is None:
            return None
        memory, offset, writes = gift.pool.row_state(gift.row)
        if writes != gift.writes:
            return None
        layout = self.files.layout
        # With a manifest the daemon checks the slot against it, and the donor's checksum is not needed.
        pieces = [] if self.files.checksums is not None else [(p.offset, p.nbytes) for p in layout.pieces]
        checksum = _native.copy_record(memory, offset, self._writable[gift.layer], slot * stride, layout.nbytes,
                                       pieces)
        self._mapped.add((gift.layer, slot))
        return checksum if gift.pool.writes_of(gift.row) == writes else None

    def _drain(self, selector) -> None:
        """Closing: give what is queued, and answer the offers for every give sent (a slot offered to a live
        process stays reserved until it answers; a record reported as given is read by no one else), within
        ANSWER_S each."""
        self._send_queued()
        self._answer_whole()
        if self._sock is None:
            return
        try:
            while self._sent:
                data = self._sock.recv(65536)
                if not data:
                    return
                for message in self._reader.feed(data):
                    self._on_offer(message)
            self._answer_whole()
            self._drop(list(self._offered))  # no read is running any more: none of these will be whole
        except (OSError, FillProtocolError):
            return

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(timeout=ANSWER_S + 1)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

