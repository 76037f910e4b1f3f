"""ExpertPool: a client's L0 (client/layerpool.py: C++-owned MLX arrays, rows per layer or shared by all layers)
and the L0 -> L2 -> L3 walk.

`borrow(layer, experts)` lends the misses that L2 holds, to be computed on in shared memory without a copy
(client/l2view.py), and makes only the rest resident as `fetch` does (docs/architecture.md, "Zero-copy L2
reads"). For a layer's batch of experts, `fetch`: L0 hits touch nothing; misses get rows (evicting experts
outside the batch), are copied from L2 shared memory through the native seqlock copy, records on their way into L2
(read by another process or the daemon) are waited for on their slot (client/slot_waits.py), and whatever L2 lacks
(or tore) is read from the model file with the native parallel pread (one read per expert for packed models,
converted to MLX's layout on the way for GGUF ones). Only then does the slot table point at the new rows, so a
row is never referenced before it holds its whole record.

With a checksum manifest, records read from the model file are checked before they are published (a damaged
one raises CorruptRecord instead of feeding a wrong weight to a forward pass); records copied from L2 were
checked by the daemon before it published them, and are checked again only with verify="all"
(docs/architecture.md, "Integrity"; the measured cost: docs/decisions.md, "The client checks what it reads from
the files, not L2's copies").

`prefetch(layer, guesses)` hands guesses for a layer to a background worker (client/prefetcher.py) that loads
the ones not in L0 into the pool's side rows (rows past the demand ceiling, for guesses only, that no queued
computation reads); `fetch` of that layer first waits for it, then promotes the guesses it demands by swapping
rows in the slot table (no copy) and drops the rest (docs/architecture.md, "Next-layer prefetch").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import mlx.core as mx

from moe_l2.model import ModelFiles

from moe_l2.client.donor import Donor
from moe_l2.client.l2view import L2View, Loan
from moe_l2.client.layerpool import LayerPool, SharedRows, Synchronizes
from moe_l2.client.options import DEFAULTS, VERIFY
from moe_l2.client.prefetcher import PrefetchCounts, Prefetcher, side_rows
from moe_l2.client.slot_waits import SlotWaits, WaitCounts

log = logging.getLogger("moe-l2.client")

# Threads for copies from L2 (memory bound), by default: the cores, up to 8. Reads of the model file wait on
# the disk, so they get at least 4: 4 beat 2 by 1.1-1.15x on the 2-core VM (bench/bench_io.py, section 4).
COPY_THREADS = min(8, os.cpu_count() or 1)
READ_THREADS = max(4, COPY_THREADS)


class PoolTooSmall(ValueError):
    pass


@dataclass
class TierCounts:
    l0_hits: int = 0
    l2_hits: int = 0
    l2_lent: int = 0       # of l2_hits, those computed on in place (ExpertPool.borrow), not copied
    l2_awaited: int = 0    # of l2_hits, those L2 lacked when looked up: on their way into it (another process'
                           # read, or the daemon's) or loaded for this lookup (load-through) while the pool
                           # waited, so they cost a disk read
    l3_reads: int = 0
    bytes_copied: int = 0  # from L2
    bytes_read: int = 0    # from the model files
    copy_s: float = 0.0    # spent copying from L2
    read_s: float = 0.0    # spent reading from the model files

    def add(self, other: "TierCounts") -> None:
        for name in _COUNTS:  # once a fetch: dataclasses.fields() would cost it about 10 us
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def minus(self, other: "TierCounts") -> "TierCounts":
        """The counts since `other` was taken (a run's, from the pool's totals before and after it)."""
        return TierCounts(**{name: getattr(self, name) - getattr(other, name) for name in _COUNTS})

    def by_source(self) -> dict[str, int]:
        """Each lookup once, by where its bytes came from: L0; L2, held when looked up; the disk, read by the
        daemon while the lookup waited (load-through: in l2_hits above, yet no cache hit) or by this process.
        What every hit rate shown to a user is made of (docs/architecture.md, "Client pool (L0)")."""
        return {"l0": self.l0_hits, "l2": self.l2_hits - self.l2_awaited, "daemon_disk": self.l2_awaited,
                "own_disk": self.l3_reads}


_COUNTS = tuple(f.name for f in fields(TierCounts))


class ExpertPool:
    def __init__(self, files: ModelFiles, capacity: int | Mapping[int, int], client=None, *,
                 policy: str = DEFAULTS.policy, read_threads: int | None = None, direct: bool | None = DEFAULTS.direct,
                 verify: str = DEFAULTS.verify, load_through_s: float = 0.0, layers=None,
                 lend: bool = DEFAULTS.lend, shared_l0: bool = False, grow: bool = DEFAULTS.l0_grow,
                 prefetch: bool = False, autopin: bool = DEFAULTS.l0_autopin, fill_l2: bool = False):
        """The mechanism under moe_l2.load and StreamedLM, which pass every argument from StreamOptions
        (client/options.py, the owner of the defaults); used alone, the pool waits for no load-through and
        keeps rows in every layer unless told to, so that a lookup's tier depends on the call alone.
        A context manager that closes it.

        capacity: the most demand rows of each layer (in all, with a shared L0), or a mapping of every layer in
        `layers` to its own (per-layer ceilings: src/moe_l2/cache/ceilings.py).

        direct: read the model files with direct I/O (O_DIRECT / F_NOCACHE): True, False, or None for
        the model's default (ModelFiles.direct_default: on for packed models).
        verify: which records to check against the model's checksum manifest, one of VERIFY.
        load_through_s: on an L2 miss, report it at once and wait up to this long for the daemon to load the
        record, woken on its slot_of entry (SlotIndex.wait), then use it in L2 (lent by `borrow`, copied by
        `fetch`) instead of reading the file as well (0: read the file at once; docs/architecture.md, "Client
        pool (L0)"). Where the misses are given (fill_l2), the longest wait for a record on its way into L2.
        layers: the MoE layers this process runs (a pipeline stage's: docs/distributed.md); L0 rows are
        allocated for those only. None: every layer.
        lend: `borrow` may lend L2's records in place (where MLX can compute on shared memory: L2View.supported);
        False: it never does, and every lookup copies (`fetch` always copies).
        shared_l0: `capacity` rows in all, which every layer takes from, evicting the least recently used expert
        of any layer (client/layerpool.py), instead of `capacity` rows in each layer; LRU only.
        grow: hold the model's top-k rows at first (per layer, or in all when shared) and grow them while the
        experts in use outgrow them, evicting only once `capacity` rows are held (client/layerpool.py); False:
        `capacity` rows from the start.
        prefetch: hold side rows for next-layer guesses beside the `capacity` demand rows (client/prefetcher.py's
        `side_rows`: per layer, or in all when shared), counted in `ceiling`; without them `prefetch` loads
        nothing.
        autopin: pin each layer's hottest experts, up to a share of its ceiling, chosen again as their heat
        decays (src/moe_l2/cache/heat.py); per-layer rows only.
        fill_l2: give the L2 misses this process reads to the daemon's L2 (client/donor.py) where the daemon's
        fill desk takes them (this process runs as its user), instead of waiting for load-through or having the
        daemon read them again."""
        layers = list(range(files.n_layers)) if layers is None else sorted(set(layers))
        if not layers or not all(0 <= layer < files.n_layers for layer in layers):
            raise ValueError(f"layers must be a non-empty subset of the MoE layers 0..{files.n_layers - 1}")
        if isinstance(capacity, Mapping):
            if shared_l0:
                raise ValueError("a shared L0 has one capacity for all layers; per-layer ceilings need per-layer "
                                 "rows")
            if sorted(capacity) != layers:
                raise ValueError(f"per-layer L0 ceilings must name every layer of {layers}, got {sorted(capacity)}")
        capacities = dict(capacity) if isinstance(capacity, Mapping) else dict.fromkeys(layers, capacity)
        most = files.n_experts * (len(layers) if shared_l0 else 1)
        for rows in capacities.values():
            if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= most:
                raise ValueError(f"L0 capacity must be 1..{most} experts {'in all' if shared_l0 else 'per layer'}, "
                                 f"got {rows}")
        if shared_l0 and autopin:
            raise ValueError("autopin pins each layer's hottest experts in its own rows; a shared L0 has none")
        if shared_l0 and policy != "lru":
            raise ValueError(f"a shared L0 evicts the least recently used expert of any layer; policy {policy!r} "
                             "needs per-layer rows")
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {', '.join(VERIFY)}, not {verify!r}")
        # Nothing to check against without a manifest: no checksum is computed then.
        self._check_file = verify != "off" and files.checksums is not None
        self._check_l2 = verify == "all" and files.checksums is not None
        self.files = files
        self.capacities = capacities  # MoE layer -> its demand ceiling (shared: every layer names the one)
        self.client = client
        self.read_threads = read_threads or READ_THREADS
        # Large records are copied from L2 on several threads: one core does not reach the memory bandwidth.
        self.copy_threads = COPY_THREADS
        self.load_through_s = load_through_s
        # Lent records are not checked against the manifest: verify="all" copies every one.
        self.lend = lend and L2View.supported() and not self._check_l2
        self._view: L2View | None = None
        self.shared_l0 = shared_l0
        self.side_rows = side_rows(files.top_k) if prefetch else 0
        self._syncs = Synchronizes()

        def start(rows: int) -> int:
            return min(rows, files.top_k) if grow else rows

        shared = (SharedRows(files, capacity, start(capacity), self.side_rows, self._syncs) if shared_l0
                  else None)
        self.layers = {layer: LayerPool(files, rows, policy, shared, start(rows), self.side_rows, self._syncs,
                                        autopin)
                       for layer, rows in capacities.items()}
        self._counts = TierCounts()
        self._counts_lock = threading.Lock()
        self._waits = SlotWaits()
        self._fds = files.open_fds(direct)
        self._prefetcher = Prefetcher(self)
        self.donor = Donor(client, files) if client is not None and fill_l2 else None
        if client is not None:
            client.count_prefetch(lambda: self.prefetch_counts.wire())
            client.count_tiers(lambda: self.counts.by_source())
            client.count_l0(lambda: (self.rows, self.ceiling))

    @property
    def counts(self) -> TierCounts:
        """Where the experts of every lookup so far came from (a copy)."""
        with self._counts_lock:
            return replace(self._counts)

    @property
    def waits(self) -> WaitCounts:
        """The waits for records on their way into L2 so far (a copy: client/slot_waits.py)."""
        return self._waits.counts()

    @property
    def prefetch_counts(self) -> PrefetchCounts:
        """What next-layer prefetch did so far (a copy)."""
        return self._prefetcher.counts()

    def count_l0_hits(self, n: int) -> None:
        """Count L0 hits that the caller served without a fetch (it knew the experts resident)."""
        with self._counts_lock:
            self._counts.l0_hits += n

    def rows_held(self) -> dict[int, int]:
        """MoE layer -> the demand rows its pool holds now (with a shared L0, every layer names the same rows)."""
        return {layer: lp.rows.held for layer, lp in self.layers.items()}

    @property
    def rows(self) -> int:
        """L0 rows held now, in all layers, side rows included."""
        return sum({id(lp.rows): lp.rows.total for lp in self.layers.values()}.values())

    @property
    def capacity(self) -> int:
        """The most demand rows a layer may hold (in all, with a shared L0): with per-layer ceilings, the
        largest layer's."""
        return max(self.capacities.values())

    @property
    def ceiling(self) -> int:
        """The most L0 rows it may hold, in all layers, side rows included: what the budget gave."""
        if self.shared_l0:
            return self.capacity + self.side_rows
        return sum(self.capacities.values()) + self.side_rows * len(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the L0 rows held now."""
        return self.rows * self.row_bytes

    @property
    def ceiling_bytes(self) -> int:
        return self.ceiling * self.row_bytes

    @property
    def row_bytes(self) -> int:
        """The memory a row takes: its record on a page (client/layerpool.py, Rows)."""
        return self.files.layout.stride

    def arrays(self, layer: int) -> dict[str, mx.array]:
        return self.layers[layer].arrays

    def table(self, layer: int) -> mx.array:
        """expert -> row, int32; valid for every expert of the latest fetch of this layer."""
        return self.layers[layer].table

    def pin(self, layer: int, experts: list[int]) -> None:
        self.fetch(layer, experts)
        self.layers[layer].pin(experts)

    def evict(self, layer: int, expert: int) -> None:
        """Drop an expert from L0; waits for queued computations first, as `fetch` does."""
        self.settle(layer)
        self._synchronize()
        self.layers[layer].evict(expert)

    def fetch(self, layer: int, experts) -> TierCounts:
        """Make every expert of the batch resident in L0; returns where each one came from.

        `experts` are the router's picks (repeats allowed); the daemon is told all of them, L0 hits
        included, for its routing statistics, and which ones it had or lacked in L2.
        """
        picks = [int(e) for e in experts]
        return self._fetch(layer, picks, set(picks), None)

    def borrow(self, layer: int, experts) -> tuple[TierCounts, Loan | None]:
        """`fetch`, except that the misses L2 holds whole are lent (computed on in shared memory, without a
        copy: client/l2view.py) and only the rest are made resident in L0. Returns (counts, loan); the loan is
        None, and nothing was fetched, where nothing can be lent (no daemon, an unserved layer, an MLX build
        that cannot compute in place, L2 holds none of the misses and none were waited for) or the rest does not
        fit L0; it may be empty when misses were waited for and none arrived (the rest is resident then). The
        caller computes the lent experts on `loan.arrays()` rows `loan.slot_of()`, evaluates, and computes the layer
        again from L0 if `loan.torn()` names any (docs/architecture.md, "Zero-copy L2 reads")."""
        lp = self.layers[layer]
        picks = [int(e) for e in experts]
        batch = set(picks)
        view = self._l2_view()
        if view is None or not view.attachment.serves(layer):
            return TierCounts(), None
        try:
            view.arrays(layer)
        except RuntimeError as exc:  # an MLX build that cannot compute on mapped memory: copy from now on
            log.warning("%s; copying experts from shared memory instead", exc)
            self.lend = False
            return TierCounts(), None
        self._check_experts(batch)
        self._prefetcher.before_fetch(layer, batch)
        loan, absent = self._l2_split(view, layer, batch)
        # Load-through: one read per miss, the daemon's, into L2, where the layer then computes on it; only where
        # L2 has room for the misses beside the batch's lent experts, which the daemon does not evict for them.
        room = view.attachment.slots[layer] - len(loan.experts)
        reported = bool(absent and self.load_through_s and len(absent) <= room and not self._gives())
        awaited = 0
        if reported:
            self.client.report(layer, list(loan.experts), absent, picks, now=True)
            lent = len(loan.experts)
            loan = self._await_loan(view, loan, absent)
            awaited = len(loan.experts) - lent
        rest = batch - set(loan.experts)
        if not (loan or reported) or not lp.fits(rest):
            return TierCounts(), None
        return self._fetch(layer, picks, rest, loan, reported, awaited), loan

    def _await_loan(self, view: L2View, loan: Loan, absent: list[int]) -> Loan:
        """The loan, with what of `absent` the daemon loads into L2 within load_through_s (woken on their slot_of
        entries: SlotIndex.wait)."""
        self._waits.wait(view.attachment.slot_indexes[loan.layer], absent, self.load_through_s, absent=True)
        more = view.lend(loan.layer, absent)
        return loan.plus(more) if more else loan

    def _l2_view(self) -> L2View | None:
        """The L2View of the daemon epoch attached now, or None."""
        attachment = self.client.attachment if self.client is not None and self.lend else None
        if attachment is None:
            return None
        if self._view is None or self._view.attachment is not attachment:
            self._view = L2View(attachment, self.files.layout)
        return self._view

    def _check_experts(self, batch: set[int]) -> None:
        for expert in batch:
            if not 0 <= expert < self.files.n_experts:
                raise IndexError(f"expert {expert} out of range 0..{self.files.n_experts - 1}")

    def _fetch(self, layer: int, picks: list[int], batch: set[int], loan: Loan | None,
               reported: bool = False, awaited: int = 0) -> TierCounts:
        """Make `batch` resident in L0; the loan's experts (not in batch) count as L2 hits, `awaited` of them
        loaded through. reported: the daemon was told of this lookup already (and waited for: no load-through
        again)."""
        lp = self.layers[layer]
        lent = list(loan.experts) if loan else []
        self._check_experts(batch)
        self._prefetcher.before_fetch(layer, batch)
        counts = TierCounts()
        missing = sorted(e for e in batch if not lp.holds(e))
        # Guesses the prefetch holds in side rows are L0 hits: promoted below, without a read or a copy.
        guessed = [e for e in missing if lp.has_guess(e)]
        counts.l0_hits = len(batch) - len(missing) + len(guessed)
        lp.access(batch)
        counts.l2_lent, counts.l2_awaited = len(lent), awaited
        if not missing:
            lp.drop_guesses()
            counts.l2_hits = len(lent)
            self._add_counts(counts)
            if self.client is not None and not reported:
                self.client.report(layer, lent, [], picks)
            return counts
        if not lp.fits(batch):
            raise PoolTooSmall(f"layer {layer}: a batch of {len(batch)} experts does not fit an L0 pool of "
                               f"{lp.capacity} experts ({len(lp.pins() - batch)} pinned); fetch fewer tokens "
                               "at once or raise the L0 capacity")
        if self.shared_l0 and lp.rows.would_grow(len(missing)):
            self._prefetcher.settle_all()  # growing copies every row: no guess may be landing in the old ones
        # Work queued with mx.async_eval (on Metal, kernels in flight) may still read the rows and the slot
        # table about to change: wait for it, so that any caller may refill rows between async steps.
        # The streamed forward has already synced on the router's choice, so the wait is free there.
        self._synchronize()
        taken = dict(zip(missing, lp.take_rows(missing, batch)))
        lp.promote(guessed, [taken.pop(e) for e in guessed])
        lp.drop_guesses()
        missing, rows = list(taken), list(taken.values())
        if not missing:
            counts.l2_hits = len(lent)
            self._add_counts(counts)
            if self.client is not None and not reported:
                self.client.report(layer, lent, [], picks)
            return counts
        copied, loaded, told = self._fill_rows(layer, lp, missing, rows, picks, lent, reported)
        loaded.l0_hits = counts.l0_hits
        loaded.l2_hits += len(lent)
        loaded.l2_lent = len(lent)
        loaded.l2_awaited += awaited
        self._add_counts(loaded)
        if not (reported or told):
            self.report_lookups(layer, missing, copied, picks, lent)
        return loaded

    def _fill_rows(self, layer: int, lp: LayerPool, missing: list[int], rows: list[int], picks: list[int],
                   lent: list[int], reported: bool) -> tuple[list[bool], TierCounts, bool]:
        """Fill the rows taken for the misses and publish them: copied from L2, or loaded through (reported at
        once and waited for), or read by this process, which gives them to L2 (client/donor.py: told, and the
        lookup reported, as their read starts; handed over once it ended), or, on their way into L2 already,
        waited for and copied. Returns which came from L2, the counts and whether the lookup was reported
        already."""
        told, gifts = [], []

        def load_through(copied: list[bool], coming: list[bool]) -> list[bool]:
            # Report the L2 misses now, so that the daemon starts loading them, and copy them as they land.
            told.append(self.report_lookups(layer, missing, copied, picks, lent, now=True))
            return self._await_l2(layer, lp, missing, rows, copied)

        def give(copied: list[bool], coming: list[bool]) -> list[bool]:
            # Tell the donor of the L2 misses now, so that the daemon reserves their slots while they are read, and
            # report the lookup now, so that the daemon's policy knows of it before it picks their victims. Those
            # on their way into L2 are waited for (load_rows), not given.
            unread = [(e, r) for e, r, ok, c in zip(missing, rows, copied, coming) if not (ok or c)]
            gifts.extend(self.donor.give(layer, lp, [e for e, _ in unread], [r for _, r in unread],
                                         keep=[*lent, *picks]))
            told.append(self.report_lookups(layer, missing, copied, picks, lent, now=True,
                                            given=[e for e, _ in unread]))
            return copied

        def read(whole: bool) -> None:
            # The donor may copy the gifts once their rows are whole: before this fetch waits for what is coming.
            if gifts:
                self.donor.read_done(gifts, whole)
                gifts.clear()

        gives = self._gives()
        through = self.load_through_s and self.client is not None and not reported and not gives
        try:
            copied, loaded = self.load_rows(layer, missing, rows, load_through if through else give if gives else None,
                                            coming_s=self.load_through_s if gives else 0.0, on_read=read)
        except BaseException:
            read(False)
            raise
        lp.publish(missing, rows)
        return copied, loaded, any(told)

    def _gives(self) -> bool:
        """The misses this process reads are given to L2 (the daemon's fill desk took this process)."""
        return self.donor is not None and self.donor.accepting

    def _synchronize(self) -> None:
        """Wait for every queued computation; the rows that left demand before it, in any layer, may take guesses
        now (client/layerpool.py, Synchronizes)."""
        mx.synchronize()
        self._syncs.waited()

    def _add_counts(self, counts: TierCounts) -> None:
        with self._counts_lock:
            self._counts.add(counts)

    def load_rows(self, layer: int, experts: list[int], rows: list[int], on_l2_miss=None, side: bool = False,
                  coming_s: float = 0.0, on_read=None) -> tuple[list[bool], TierCounts]:
        """Fill rows taken for the experts with their records: L2 copies, the file for the rest, checked as
        configured; nothing is published. Returns which came from L2 and the counts; on failure the rows go
        back (side: side rows, the prefetch worker's). For `fetch` and the prefetch worker.
        on_l2_miss(copied, coming) -> copied: called when L2 lacked some, before the file is read.
        coming_s: the misses whose records are on their way into L2 (read by another process, or by the daemon)
        are not read: once the rest are, they are waited for, up to coming_s after the lookup, and copied; only
        those that have not landed by then are read too (docs/architecture.md, "Fills"). on_read(True): called once
        the misses read at first are whole and checked, before that wait."""
        lp = self.layers[layer]
        counts = TierCounts()
        try:
            start = time.perf_counter()
            copied = self._copy_from_l2(layer, lp, experts, rows)
            coming = self._coming(layer, experts, copied) if coming_s else [False] * len(experts)
            if on_l2_miss is not None and not all(copied):
                present = sum(copied)
                copied = on_l2_miss(copied, coming)
                counts.l2_awaited = sum(copied) - present
            copied = self._checked_copies(layer, lp, experts, rows, copied)
            copied_at = time.perf_counter()
            unread = [(e, r) for e, r, ok, c in zip(experts, rows, copied, coming) if not (ok or c)]
            self._read_checked(layer, lp, unread)
            if on_read is not None:
                on_read(True)
            read_at = waited_at = time.perf_counter()
            if any(coming):
                counts.l2_awaited += self._await_coming(layer, lp, experts, rows, copied, coming, start + coming_s)
                waited_at = time.perf_counter()
                late = [(e, r) for e, r, ok, c in zip(experts, rows, copied, coming) if c and not ok]
                self._read_checked(layer, lp, late)
                unread += late
            counts.copy_s = (copied_at - start) + (waited_at - read_at)
            counts.read_s = (read_at - copied_at) + (time.perf_counter() - waited_at)
        except BaseException:
            (lp.release_side if side else lp.release)(rows)  # nothing was published: the rows hold no expert
            raise
        record = self.files.layout.nbytes
        counts.l2_hits = sum(copied)
        counts.l3_reads = len(unread)
        counts.bytes_copied = counts.l2_hits * record
        counts.bytes_read = counts.l3_reads * record
        return copied, counts

    def prefetch(self, layer: int, guesses) -> None:
        """Load the guessed experts of `layer` that are not in L0 into its side rows, in the background; returns
        at once (client.prefetcher.Prefetcher.prefetch has the rules). The next `fetch` of the layer waits for
        it. Without side rows (ExpertPool(prefetch=False)) nothing is loaded."""
        self._prefetcher.prefetch(layer, guesses)

    def not_in_l2(self, layer: int, experts: list[int]) -> list[int]:
        """The experts, in order, but those a daemon L2 that lends from holds now."""
        view = self._l2_view()
        if view is None or not view.attachment.serves(layer):
            return list(experts)
        held = set(view.lend(layer, experts).experts)
        return [e for e in experts if e not in held]

    def _l2_split(self, view: L2View, layer: int, experts) -> tuple[Loan, list[int]]:
        """Of the experts L0 lacks (held as a guess counts as held: the fetch promotes it): a loan of those L2
        holds now, and the rest, sorted."""
        lp = self.layers[layer]
        missing = sorted(e for e in experts if not lp.holds(e) and not lp.has_guess(e))
        loan = view.lend(layer, missing)
        return loan, sorted(set(missing) - set(loan.experts))

    def settle(self, layer: int) -> None:
        """Cancel the layer's prefetches that have not started and wait for the one running, if any."""
        self._prefetcher.settle(layer)

    def wait_prefetches(self, layer: int | None = None) -> None:
        """Wait until the prefetches issued so far for the layer (None: every layer) have landed, without
        cancelling any; for callers that know they have time to spare (a benchmark's compute, a test)."""
        self._prefetcher.wait(layer)

    def report_lookups(self, layer: int, missing: list[int], copied: list[bool], picks: list[int],
                       lent=(), now: bool = False, given=()) -> bool:
        """Tell the daemon what L2 had (copied or lent) and lacked (it loads what it lacked, but those `given`:
        this process gives them); False when there is no daemon. now: without waiting for the connection's next
        flush."""
        if self.client is None:
            return False
        self.client.report(layer, [*lent, *(e for e, ok in zip(missing, copied) if ok)],
                           [e for e, ok in zip(missing, copied) if not ok], picks, now, given)
        return True

    def _await_l2(self, layer: int, lp: LayerPool, missing: list[int], rows: list[int],
                  copied: list[bool]) -> list[bool]:
        """Copy the misses from L2 once the daemon has loaded them, waiting up to load_through_s on their slot_of
        entries (SlotIndex.wait: woken by the daemon's begin_fill, then by its publish)."""
        copied = list(copied)
        self._copy_landed(layer, lp, missing, rows, copied, [not ok for ok in copied], self.load_through_s, True)
        return copied

    def _coming(self, layer: int, experts: list[int], copied: list[bool]) -> list[bool]:
        """Which of the experts not copied have records on their way into L2 now (SlotIndex.wait without a wait)."""
        attachment = self.client.attachment if self.client is not None else None
        if attachment is None or not attachment.serves(layer) or all(copied):
            return [False] * len(experts)
        todo = [i for i, ok in enumerate(copied) if not ok]
        coming = [False] * len(experts)
        for i, on_way in zip(todo, attachment.slot_indexes[layer].wait([experts[i] for i in todo], 0.0)):
            coming[i] = on_way
        return coming

    def _await_coming(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int], copied: list[bool],
                      coming: list[bool], deadline: float) -> int:
        """Copy the records that were coming into L2 once they land, waiting until `deadline` (perf_counter) at
        most; marks them in `copied`, checked as configured, and returns how many landed."""
        todo = [c and not ok for ok, c in zip(copied, coming)]
        self._copy_landed(layer, lp, experts, rows, copied, todo, max(0.0, deadline - time.perf_counter()), False)
        landed = [i for i, t in enumerate(todo) if t and copied[i]]
        for i in landed:
            copied[i] = not self._check_l2 or self._intact_copy(layer, lp, experts[i], rows[i])
        return sum(copied[i] for i in landed)

    def _copy_landed(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int], copied: list[bool],
                     todo: list[bool], timeout_s: float, absent: bool) -> None:
        """Wait on the slot_of entries of the experts marked in `todo` (absent: also for those not yet coming) up to
        timeout_s, then copy them from L2, marking in `copied` those that came."""
        attachment = self.client.attachment if self.client is not None else None
        picked = [i for i, t in enumerate(todo) if t]
        if attachment is None or not attachment.serves(layer) or not picked:
            return
        self._waits.wait(attachment.slot_indexes[layer], [experts[i] for i in picked], timeout_s, absent)
        for i, ok in zip(picked, self._copy_from_l2(layer, lp, [experts[i] for i in picked], [rows[i] for i in picked])):
            copied[i] = ok

    def _copy_from_l2(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int]) -> list[bool]:
        attachment = self.client.attachment if self.client is not None else None
        if attachment is None or not attachment.serves(layer):  # an unserved layer: the file (moe-l2d --layers)
            return [False] * len(experts)
        return attachment.slot_indexes[layer].copy(lp.copy_pieces, experts, rows, self.copy_threads)

    def _intact_copy(self, layer: int, lp: LayerPool, expert: int, row: int) -> bool:
        """Whether a record copied from L2 matches the manifest; one that does not is read from the file."""
        checksum = lp.checksum(row)
        if checksum == self.files.checksums.expected(layer, expert):
            return True
        log.warning("%s: MoE layer %d expert %d copied from shared memory (L2) fails its checksum (crc32 %08x); "
                    "reading it from the model file", self.files.path, layer, expert, checksum)
        return False

    def _checked_copies(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int],
                        copied: list[bool]) -> list[bool]:
        """`copied`, but for records copied from L2 that fail the manifest where verify="all" checks them."""
        if not self._check_l2:
            return copied
        return [ok and self._intact_copy(layer, lp, e, r) for e, r, ok in zip(experts, rows, copied)]

    def _read_checked(self, layer: int, lp: LayerPool, todo: list[tuple[int, int]]) -> None:
        """Read (expert, row) pairs from the model file and check them against the manifest as configured."""
        sums = self._read_from_l3(layer, lp, todo)
        if self._check_file:
            for (expert, row), checksum in zip(todo, sums or [lp.checksum(row) for _, row in todo]):
                self.files.check_record(layer, expert, checksum, "the model file")

    def _read_from_l3(self, layer: int, lp: LayerPool, todo: list[tuple[int, int]]) -> list[int] | None:
        """Read into the rows: stacked models piece by piece, packed ones in one read per expert straight into
        its row, GGUF ones converted to MLX's layout on the way (see ModelFiles.read_into_rows).
        Returns the records' checksums where the format computed them as it read (packed), else None."""
        if not todo:
            return None
        targets = [(expert, lp.places(row)) for expert, row in todo]
        return self.files.read_into_rows(self._fds, layer, targets, threads=self.read_threads,
                                         checksums=self._check_file)

    def close(self) -> None:
        self._prefetcher.close()
        if self.donor is not None:
            self.donor.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> "ExpertPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
