"""L0's bookkeeping: Rows, the rows a pool holds now and their ceiling; LayerPool, one layer's residents, pins and
eviction policy; and SharedRows, the rows every layer of a pool takes from when L0 is one pool for all layers.

Per layer (the default), each layer owns up to `capacity` rows and evicts by its own policy. Shared
(`ExpertPool(shared_l0=True)`), the pool has up to `capacity` rows in all and a layer takes a free row, or the row
of the least recently used expert of any layer outside the batch it is making resident. That suits an L0 that
only catches L2's misses while the layers compute on L2 in place: a few rows in all instead of top-k rows in
every layer leave the memory to the shared L2 (docs/architecture.md, "Client pool (L0)").

Rows are laid out as L2's slots are: one buffer, each row a whole record (its pieces where the record layout puts
them), and per record piece one array over every row with the row's size as its first stride (mx.gather_qmm takes
one weight array, and needs only its last two dimensions contiguous). A miss is then one read into one run of
memory, as moe-l2d's loaders read into a slot, and a copy from L2 one memcpy per record.

Grown on demand (`ExpertPool(grow=True)`), rows start at the model's top-k (one token's experts) and grow by GROWTH
while the working set outgrows them (Rows.take_free), up to the ceiling; only at the ceiling is an expert evicted.
Growing reallocates: a new buffer of more rows, the old rows copied in, the new arrays published under the lock. The
old buffer is never written again, and stays alive while anything still references it (every array is a view that
keeps its allocation: native/memory.cpp), so queued MLX work and the unevaluated tail of a forward read what they
were given; a layer's rows are written by one thread at a time (a fetch settles the layer's prefetch first; with
shared rows, a fetch that grows them settles every layer's), after it took them, so no write lands in a buffer that
a growth left behind.

Side rows (`side`, for next-layer prefetch: docs/architecture.md, "Next-layer prefetch") are rows past the
demand ceiling, in the same buffer, that hold guesses only: take_rows never hands one out and no demand miss
evicts one, so a wrong guess costs no demand hit. A right guess is promoted by swapping rows: the expert's
side row becomes a demand row in the slot table, and the demand row take_rows gave it becomes a side row; no
byte moves. A row that leaves demand so is written by no guess until the pool's next synchronize (`demote`,
`Synchronizes`): the side rows are two generations, the one queued work may still read and the one guesses are
written into.

A row's `writes` count goes up whenever it is handed out to be written (take_rows, take_side), before any byte
of it is: the client's donor (client/donor.py) copies a record out of a row without the lock and gives it to L2
only if the count did not move meanwhile, so a fetch never waits for a donation and a row refilled under the copy
is never given. A row's `landed` word says that a read into it has put the whole record there (a packed model's
ModelFiles.read_into_rows sets it), so that the donor copies each record as it lands; it is cleared as the count goes
up, so that it never speaks for the record the row held before.

Autopin (`AutopinLayerPool`, per-layer rows only: src/moe_l2/cache/heat.py) pins each layer's hottest experts where
they are resident, chosen again as their heat decays; those pins yield to a batch that needs their rows, so they
never make a batch too big for the pool, where the caller's pins (`pin`) do. Growth and autopin are the kinds of
rows and layers a pool is built with: where they are off, none of their code runs (Rows.grows stays False).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections import OrderedDict

import mlx.core as mx

from moe_l2 import _native
from moe_l2.cache.heat import Heat, pin_limit
from moe_l2.cache.policy import latest, make_policy, observe
from moe_l2.model import ModelFiles
from moe_l2.model.records import row_strides

# How much a pool's rows grow at a time when every row is taken and it is below its ceiling: as the resident
# pool of the MLX streaming runtime that moe-l2 grew from.
GROWTH = 1.5
# How long a layer waits for this process' donor to copy a row out (its slot in L2 offered already) before taking
# the row and cancelling the donation, which moe-l2d then reads again: a 12.6 MiB record copies in about 1.5 ms on
# the 2-core VM (docs/benchmarks.md, "A shared L0's rows").
DONATION_WAIT_S = 0.005


class Synchronizes:
    """How many times a pool waited for every queued computation. mx.synchronize covers the work of every layer,
    so one count serves all of a pool's Rows: a row that left demand before the latest wait is read by nothing."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def waited(self) -> None:
        with self._lock:
            self.count += 1


class Rows:
    """Records, `start` demand rows at first and at most `ceiling`, and `side` rows beside them for guesses: a
    C++-owned buffer, an MLX array per record piece over it, the free rows and the lock of everything that uses
    them."""

    def __init__(self, files: ModelFiles, ceiling: int, start: int, side: int = 0,
                 syncs: Synchronizes | None = None):
        self.ceiling = ceiling
        self.side = side
        self.layout = files.layout
        # As L2's slot stride: each row starts on a page, as direct reads want.
        self.stride = files.layout.stride
        self.held = 0
        self.grows = False  # below its ceiling: take_free grows the rows before it runs out
        self.buffer = None
        self.landed = None  # a 4-byte word per row (read_into_rows' `landed`)
        self.arrays: dict = {}
        self.free: list[int] = []
        self.side_free: list[int] = []  # side rows no guess holds and nothing queued reads
        self._cooling: list[tuple[int, int]] = []  # (side row, the pool's synchronizes when it left demand)
        self.writes: list[int] = []  # per row, how often it was handed out to be written
        self.giving: collections.Counter = collections.Counter()  # rows whose records the donor has yet to copy
        self.offered: collections.Counter = collections.Counter()  # of those, rows whose slot in L2 is offered
        self._syncs = syncs or Synchronizes()
        self.lock = threading.RLock()
        self.copied = threading.Condition(self.lock)  # notified as the donor is done with a row
        self._resize(min(start, ceiling))

    def take_free(self, n: int) -> list[int]:
        """Up to n free rows, the last freed first; rows that may grow grow first where too few are free (the
        caller holds the lock)."""
        if self.grows and len(self.free) < n:
            # At least the rows missing, GROWTH times as many if that is more, never past the ceiling.
            self._resize(min(self.ceiling, max(self.held + n - len(self.free), math.ceil(self.held * GROWTH))))
        n = min(n, len(self.free))
        taken = self.free[len(self.free) - n:]
        del self.free[len(self.free) - n:]
        return taken[::-1]

    def _resize(self, rows: int) -> None:
        old = self.held
        # Every row is copied, side rows too (a guess held in one stays valid); the new rows are demand rows.
        old_total, total = (old + self.side if old else 0), rows + self.side
        buffer = _native.Buffer(total * self.stride)
        if old:
            buffer.view()[:old_total * self.stride] = self.buffer.view()[:old_total * self.stride]
        self.arrays = {}
        for p in self.layout.pieces:
            dtype = getattr(mx, p.dtype)
            self.arrays[p.key] = buffer.array(p.offset, [total, *p.shape], dtype,
                                              row_strides(self.stride // dtype.size, p.shape))
        self.buffer = buffer
        # A read that runs into the old words goes on setting them: its gifts keep them alive (client/donor.py).
        self.landed = _native.Buffer(4 * total)
        self.writes += [0] * (total - len(self.writes))  # rows keep their numbers: the new ones come last
        if old:
            self.free[:0] = range(total - 1, old_total - 1, -1)  # taken from the end: the free rows before the new
        else:
            self.free[:] = range(rows - 1, -1, -1)
            self.side_free[:] = range(total - 1, rows - 1, -1)
        self.held = rows
        self.grows = rows < self.ceiling
        if old:
            # MLX keeps freed buffers in its cache (the old rows), which would hold memory past the ceiling
            # (docs/benchmarks.md, "L0 grown on demand"); those still referenced are freed later.
            mx.clear_cache()

    @property
    def growable(self) -> int:
        """Rows it may still grow by."""
        return self.ceiling - self.held

    @property
    def total(self) -> int:
        """Rows held now, demand and side."""
        return self.held + self.side

    def would_grow(self, need: int) -> bool:
        """Taking `need` rows now grows the rows (the caller holds the lock)."""
        return self.grows and len(self.free) < need

    def demote(self, row: int) -> None:
        """A demand row becomes a side row; no guess is written into it before the next synchronize."""
        self._cooling.append((row, self._syncs.count))

    def take_side(self, n: int) -> list[int]:
        """Up to n side rows that no guess holds and no queued computation reads (the caller holds the lock)."""
        now = self._syncs.count
        cooled = [row for row, syncs in self._cooling if syncs < now]
        if cooled:
            self._cooling = [(row, syncs) for row, syncs in self._cooling if syncs >= now]
            self.side_free.extend(cooled)
        n = min(n, len(self.side_free))
        taken = self.side_free[len(self.side_free) - n:]
        del self.side_free[len(self.side_free) - n:]
        self.hand_out(taken)
        return taken

    def hand_out(self, rows: list[int]) -> None:
        """The rows are about to be written: their writes counts go up, their landed words are cleared (the caller
        holds the lock)."""
        for row in rows:
            self.writes[row] += 1
            self.landed.store_u32(4 * row, 0)


class SharedRows(Rows):
    """Rows for every layer of a pool, and the experts holding them from the least to the most recently used."""

    def __init__(self, files: ModelFiles, ceiling: int, start: int, side: int = 0,
                 syncs: Synchronizes | None = None):
        super().__init__(files, ceiling, start, side, syncs)
        self.order: OrderedDict[tuple[LayerPool, int], None] = OrderedDict()
        self.layers: list[LayerPool] = []

    def touch(self, lp: "LayerPool", expert: int) -> None:
        self.order[(lp, expert)] = None
        self.order.move_to_end((lp, expert))

    def victim(self, taker: "LayerPool", batch: set[int]) -> tuple["LayerPool", int]:
        """The least recently used expert of any layer, outside the taker's batch and unpinned; one whose row
        the donor has yet to copy only when there is no other (its donation is then cancelled, unless `take`
        waits for the copy)."""
        fallback = None
        for lp, expert in self.order:
            if not (lp is taker and expert in batch) and not lp.is_pinned(expert):
                if not self.giving[lp.row_of(expert)]:
                    return lp, expert
                fallback = fallback or (lp, expert)
        if fallback is not None:
            return fallback
        raise RuntimeError("no L0 row to take: every row holds the batch or a pinned expert")

    def take(self, taker: "LayerPool", batch: set[int], deadline: float) -> int:
        """The victim's row, evicted. A victim whose donation has its slot offered is copied by the donor alone,
        without moe-l2d: that copy is waited for until `deadline` (time.monotonic()), the victim chosen anew
        after each wake-up (the caller holds the lock, which the wait lets go)."""
        owner, expert = self.victim(taker, batch)
        while self.offered[owner.row_of(expert)] and (left := deadline - time.monotonic()) > 0:
            self.copied.wait(left)
            owner, expert = self.victim(taker, batch)
        return owner._drop(expert)

    def pinned(self) -> int:
        return sum(lp.n_pinned for lp in self.layers)


class LayerPool:
    """One layer of L0: up to `capacity` rows per record piece (its own Rows, `start` of them at first and `side`
    side rows, or SharedRows' for every layer), which expert holds which row, the guesses held in side rows, the
    pins and the eviction policy. Callers go through the methods; only the pool changes its bookkeeping. The
    bookkeeping is behind a lock: the prefetch worker changes one layer while the forward reads another."""

    def __init__(self, files: ModelFiles, capacity: int, policy: str, shared: SharedRows | None = None,
                 start: int | None = None, side: int = 0, syncs: Synchronizes | None = None):
        self._rows = (Rows(files, capacity, capacity if start is None else start, side, syncs) if shared is None
                      else shared)
        self.capacity = self._rows.ceiling
        self.n_experts = files.n_experts
        self.layout = files.layout
        self._shared = shared
        self._free, self._lock = self._rows.free, self._rows.lock
        if shared is not None:
            shared.layers.append(self)
        self._table_buffer = _native.Buffer(4 * files.n_experts)
        self._table_buffer.view()[:] = b"\xff" * (4 * files.n_experts)  # -1: not in L0
        self._table = self._table_buffer.view().cast("i")
        self.table = self._table_buffer.array(0, [files.n_experts], mx.int32)
        self._row_of: dict[int, int] = {}
        self._pinned: set[int] = set()  # the caller's pins (`pin`)
        self._policy = make_policy(policy, self.capacity, files.n_experts)
        self._guess_row: dict[int, int] = {}  # guessed expert -> the side row holding it, whole
        self.prefetch_useful = self.prefetch_wasted = 0

    @property
    def rows(self) -> Rows:
        """The rows this layer takes from (shared by every layer with a shared L0)."""
        return self._rows

    def places(self, row: int) -> list[tuple]:
        """(memory, offset) of each piece of a row now, in layout order, as the reads into rows take them."""
        rows = self._rows
        return [(rows.buffer, row * rows.stride + p.offset) for p in self.layout.pieces]

    @property
    def landed(self) -> _native.Buffer:
        """The rows' landed words now, row r's at byte 4 * r (Rows.landed; replaced when the rows grow)."""
        return self._rows.landed

    @property
    def arrays(self) -> dict[str, mx.array]:
        """key -> MLX array [rows now, *piece shape] (replaced when the rows grow)."""
        return self._rows.arrays

    @property
    def copy_pieces(self) -> list:
        """The rows as the native copy from L2 takes them: the whole record, once (a row holds it as a slot does)."""
        rows = self._rows
        return [(0, self.layout.nbytes, rows.buffer, rows.stride)]

    def holds(self, expert: int) -> bool:
        with self._lock:
            return expert in self._row_of

    def absent(self, experts) -> list[int]:
        """The experts not in L0, sorted."""
        with self._lock:
            row_of = self._row_of
            return sorted(e for e in experts if e not in row_of)

    def holds_all(self) -> bool:
        """Every expert of the layer is resident: L0 never refills a row of this layer again (never true of
        shared rows, which other layers may take)."""
        with self._lock:
            return self._shared is None and len(self._row_of) == self.n_experts

    def fits(self, experts) -> bool:
        """The batch can be resident at once, beside the caller's pinned experts outside it (autopinned ones give
        way: `take_rows`)."""
        with self._lock:
            # Resident already, they fit: pins are resident too. Asked of every layer lent from, where summing
            # every layer's pins (shared rows) would cost O(layers).
            if all(e in self._row_of for e in experts):
                return True
            return len(self._held_pins() | set(experts)) <= self.unpinned_rows + len(self._pinned)

    def _held_pins(self) -> set[int]:
        """The pins that never give way to a batch: every one (AutopinLayerPool's yield)."""
        return self._pinned

    def has_room_for(self, experts) -> bool:
        """Making the batch resident evicts nothing."""
        with self._lock:
            return len(set(experts) - self._row_of.keys()) <= len(self._free) + self._rows.growable

    def rows_for(self, experts) -> list[int]:
        """The rows of resident experts (repeats allowed), to remap router picks to pool rows."""
        with self._lock:
            row_of = self._row_of
            return [row_of[e] for e in experts]

    def pins(self) -> frozenset[int]:
        """The pinned experts."""
        with self._lock:
            return frozenset(self._pinned)

    def is_pinned(self, expert: int) -> bool:
        with self._lock:
            return expert in self._pinned

    @property
    def n_pinned(self) -> int:
        """How many experts of this layer are pinned."""
        with self._lock:
            return len(self._pinned)

    @property
    def unpinned_rows(self) -> int:
        """Rows left to experts that are not pinned (in any layer, for shared rows)."""
        with self._lock:
            return self.capacity - (len(self._pinned) if self._shared is None else self._shared.pinned())

    @property
    def autopinned(self) -> frozenset[int]:
        """The experts autopin holds pinned now: none without it (AutopinLayerPool)."""
        return frozenset()

    def pin(self, experts) -> None:
        """Keep resident experts in L0 until they are evicted by name (`evict`)."""
        with self._lock:
            self._pinned.update(experts)

    def access(self, experts, context: list[int] | None = None) -> None:
        """The forward demands these experts: tell the policy, with `context`, the token's picks at the layer
        before (None: unknown)."""
        with self._lock:
            observe(self._policy, experts, None, context)
            if self._shared is not None:
                for expert in experts:
                    if expert in self._row_of:
                        self._shared.touch(self, expert)

    def latest(self) -> list[int] | None:
        """The batch the policy was last told of, where it keeps it: the layer after's context."""
        with self._lock:
            return latest(self._policy)

    def take_rows(self, experts: list[int], batch: set[int]) -> list[int]:
        """Rows for experts not in L0: free ones, new ones while below the ceiling (the rows grow), then the rows
        of residents outside the batch (the forward in flight), evicted."""
        with self._lock:
            rows = self._rows.take_free(len(experts))
            deadline = time.monotonic() + DONATION_WAIT_S
            for _ in range(len(experts) - len(rows)):
                if self._shared is not None:
                    rows.append(self._shared.take(self, batch, deadline))
                    continue
                candidates = self._evictable(batch)
                # A row the donor has yet to copy goes last: taking it cancels that donation.
                candidates = [e for e in candidates if not self._rows.giving[self._row_of[e]]] or candidates
                rows.append(self._drop(self._policy.victim(candidates)))
            self._rows.hand_out(rows)
            return rows

    def _evictable(self, batch: set[int]) -> list[int]:
        """The residents outside the batch that are not pinned."""
        return [e for e in self._row_of if e not in batch and e not in self._pinned]

    def release(self, rows: list[int]) -> None:
        """Give back rows from `take_rows` that were never published (they hold no expert)."""
        with self._lock:
            self._free.extend(rows)

    def _drop(self, expert: int) -> int:
        """Take the expert out of L0; returns the row it held."""
        row = self._row_of.pop(expert)
        self._table[expert] = -1
        if self._shared is not None:
            self._shared.order.pop((self, expert), None)
        self._policy.evict(expert)
        self._pinned.discard(expert)
        return row

    def evict(self, expert: int) -> None:
        with self._lock:
            self._free.append(self._drop(expert))

    def publish(self, experts: list[int], rows: list[int]) -> None:
        with self._lock:
            for expert, row in zip(experts, rows):
                self._row_of[expert] = row
                self._table[expert] = row
                self._policy.insert(expert)
                if self._shared is not None:
                    self._shared.touch(self, expert)

    def has_guess(self, expert: int) -> bool:
        """A side row holds the expert, loaded ahead and not demanded since."""
        with self._lock:
            return expert in self._guess_row

    def take_side_rows(self, guesses: list[int]) -> tuple[list[int], list[int]]:
        """Side rows for as many of the guesses (best first) as are neither resident nor held already and as
        side rows are writable; returns (experts given rows, rows). Evicts nothing."""
        with self._lock:
            wanted = [e for e in guesses if e not in self._row_of and e not in self._guess_row]
            rows = self._rows.take_side(len(wanted))
            return wanted[:len(rows)], rows

    def release_side(self, rows: list[int]) -> None:
        """Give back side rows from `take_side_rows` that hold no guess (a load that failed)."""
        with self._lock:
            self._rows.side_free.extend(rows)

    def hold_guesses(self, experts: list[int], rows: list[int]) -> None:
        """The guesses are whole in their side rows: a fetch of the layer may promote them."""
        with self._lock:
            self._guess_row.update(zip(experts, rows))

    def promote(self, experts: list[int], rows: list[int]) -> None:
        """Guessed experts that a fetch demands join demand without a copy: each one's side row takes the place
        of the demand row `take_rows` gave it, which becomes a side row (written by no guess before the next
        synchronize). The caller synchronized: nothing queued reads the slot table."""
        with self._lock:
            for expert, row in zip(experts, rows):
                self._rows.demote(row)
                self.publish([expert], [self._guess_row.pop(expert)])
                self.prefetch_useful += 1

    def drop_guesses(self) -> None:
        """The layer's fetch came: the guesses it did not demand were wrong; their side rows are free again (no
        slot table ever named them)."""
        with self._lock:
            self._rows.side_free.extend(self._guess_row.values())
            self.prefetch_wasted += len(self._guess_row)
            self._guess_row.clear()

    def prefetched(self) -> frozenset[int]:
        """Experts loaded ahead into side rows and not demanded since."""
        with self._lock:
            return frozenset(self._guess_row)

    def row_state(self, row: int) -> tuple:
        """(memory, offset of the row in it, the row's writes count) now: what a copy out of the row without
        the lock needs, and what it compares the count with afterwards (`writes_of`)."""
        with self._lock:
            rows = self._rows
            return rows.buffer, row * rows.stride, rows.writes[row]

    def writes_of(self, row: int) -> int:
        with self._lock:
            return self._rows.writes[row]

    def giving(self, row: int, pending: bool, offered: bool = False) -> int:
        """The donor has a copy of the row's record to make (pending), or is done with it (offered: its slot had
        been offered); returns the row's writes count: eviction takes such a row last, so that the copy is
        seldom cancelled."""
        with self._lock:
            rows = self._rows
            rows.giving[row] += 1 if pending else -1
            if rows.giving[row] <= 0:
                del rows.giving[row]
            if offered:
                rows.offered[row] -= 1
                if rows.offered[row] <= 0:
                    del rows.offered[row]
            if not pending:
                rows.copied.notify_all()
            return rows.writes[row]

    def offer(self, row: int) -> None:
        """The donor has the slot for the row's record: its copy no longer waits on moe-l2d."""
        with self._lock:
            self._rows.offered[row] += 1

    def checksum(self, row: int) -> int:
        """record_checksum of the record in a row (docs/formats.md, "Checksums")."""
        rows = self._rows
        return self.layout.checksum(rows.buffer.view(), row * rows.stride)

    def row_of(self, expert: int) -> int:
        """The row holding the expert: its demand row, else the side row of its guess."""
        with self._lock:
            return self._row_of[expert] if expert in self._row_of else self._guess_row[expert]

    def record(self, expert: int) -> bytes:
        """The expert's record as L0 holds it, in demand or in a side row, laid out like ModelFiles.read_record
        (for verification)."""
        row = self.row_of(expert)
        rows = self._rows
        view, base = rows.buffer.view(), row * rows.stride
        out = bytearray(self.layout.nbytes)
        for p in self.layout.pieces:  # the pieces only: padding between them is not the record's
            out[p.offset:p.offset + p.nbytes] = view[base + p.offset:base + p.offset + p.nbytes]
        return bytes(out)


class AutopinLayerPool(LayerPool):
    """A layer of per-layer rows that also pins its hottest experts (src/moe_l2/cache/heat.py), where resident, at
    each choice and as they load: those pins yield to a batch that needs their rows, the caller's never do."""

    def __init__(self, files: ModelFiles, capacity: int, policy: str, shared: SharedRows | None = None,
                 start: int | None = None, side: int = 0, syncs: Synchronizes | None = None):
        super().__init__(files, capacity, policy, shared, start, side, syncs)
        self._held: set[int] = set()  # the caller's pins; _pinned holds autopin's too
        self._heat = Heat(files.n_experts, pin_limit(self.capacity, files.top_k))

    def _held_pins(self) -> set[int]:
        return self._held

    @property
    def autopinned(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._pinned - self._held)

    def pin(self, experts) -> None:
        with self._lock:
            super().pin(experts)
            self._held.update(experts)

    def access(self, experts, context: list[int] | None = None) -> None:
        with self._lock:
            super().access(experts, context)
            if self._heat.add(experts):
                self._pinned = self._held | {e for e in self._heat.hot if e in self._row_of}

    def _evictable(self, batch: set[int]) -> list[int]:
        """As a layer's, else the residents that only autopin pins."""
        return super()._evictable(batch) or [e for e in self._row_of if e not in batch and e not in self._held]

    def _drop(self, expert: int) -> int:
        self._held.discard(expert)
        return super()._drop(expert)

    def publish(self, experts: list[int], rows: list[int]) -> None:
        with self._lock:
            super().publish(experts, rows)
            self._pinned.update(e for e in experts if e in self._heat.hot)
