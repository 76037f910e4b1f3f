"""ExpertPool: a client's L0 (client/layerpool.py: C++-owned MLX arrays, rows per layer or shared by all layers)
and the L0 -> L2 -> L3 walk.

`borrow(layer, experts)` lends the misses that L2 holds, to be computed on in shared memory without a copy
(client/l2view.py), and makes only the rest resident as `fetch` does (docs/architecture.md, "Zero-copy L2
reads"). For a layer's batch of experts, `fetch`: L0 hits touch nothing; misses get rows (evicting experts
outside the batch) that client/row_loader.py fills, from L2 shared memory, from records on their way into L2
(read by another process or the daemon) once they land, or from the model file for whatever L2 lacks (or tore).
Only then does the slot table point at the new rows, so a row is never referenced before it holds its whole
record. Each fetch keeps one `Lookup` (client/lookup.py) and reports it to the daemon once.

With a checksum manifest, records read from the model file are checked before they are published (a damaged
one raises CorruptRecord instead of feeding a wrong weight to a forward pass); records copied from L2 were
checked by the daemon before it published them, and are checked again only with verify="all"
(docs/architecture.md, "Integrity"; the measured cost: docs/decisions.md, "The client checks what it reads from
the files, not L2's copies").

The experimental options are built in only where they are on: growth and autopin are the rows' and the layers'
own kinds (client/layerpool.py), and next-layer prefetch's part in a fetch is `_ahead`, None without side rows.
`prefetch(layer, guesses)` hands guesses for a layer to a background worker (client/prefetcher.py) that loads
the ones not in L0 into the pool's side rows (rows past the demand ceiling, for guesses only, that no queued
computation reads); `fetch` of that layer first waits for it, then promotes the guesses it demands by swapping
rows in the slot table (no copy) and drops the rest (docs/architecture.md, "Next-layer prefetch").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import replace

import mlx.core as mx

from moe_l2 import _native
from moe_l2.model import ModelFiles
from moe_l2.model.records import Landed

from moe_l2.client.donor import Donor
from moe_l2.client.l2view import L2View, Loan
from moe_l2.client.layerpool import AutopinLayerPool, LayerPool, SharedRows, Synchronizes
from moe_l2.client.lookup import Lookup, TierCounts
from moe_l2.client.options import DEFAULTS, StreamOptions
from moe_l2.client.prefetcher import PrefetchCounts, Prefetcher, side_rows
from moe_l2.client.row_loader import RowLoader, to_read
from moe_l2.client.slot_waits import WaitCounts

log = logging.getLogger("moe-l2.client")

__all__ = ["ExpertPool", "PoolTooSmall"]


class PoolTooSmall(ValueError):
    pass


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
        if isinstance(capacity, Mapping) and sorted(capacity) != layers:
            raise ValueError(f"per-layer L0 ceilings must name every layer of {layers}, got {sorted(capacity)}")
        capacities = dict(capacity) if isinstance(capacity, Mapping) else dict.fromkeys(layers, capacity)
        most = files.n_experts * (len(layers) if shared_l0 else 1)
        for rows in capacities.values():
            if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= most:
                raise ValueError(f"L0 capacity must be 1..{most} experts {'in all' if shared_l0 else 'per layer'}, "
                                 f"got {rows}")
        # How L0 may be laid out and what is checked are StreamOptions' rules, the one owner of each.
        StreamOptions(shared_l0=shared_l0, l0_autopin=autopin, policy=policy, verify=verify,
                      l0_ceilings=tuple(capacities.values()) if isinstance(capacity, Mapping) else None)
        # Nothing to check against without a manifest: no checksum is computed then.
        check_l2 = verify == "all" and files.checksums is not None
        self.files = files
        self.capacities = capacities  # MoE layer -> its demand ceiling (shared: every layer names the one)
        self.client = client
        self.load_through_s = load_through_s
        # Lent records are not checked against the manifest: verify="all" copies every one.
        self.lend = lend and L2View.supported() and not check_l2
        self._view: L2View | None = None
        self.shared_l0 = shared_l0
        self.side_rows = side_rows(files.top_k) if prefetch else 0
        self._syncs = Synchronizes()

        def start(rows: int) -> int:
            return min(rows, files.top_k) if grow else rows

        shared = (SharedRows(files, capacity, start(capacity), self.side_rows, self._syncs) if shared_l0
                  else None)
        kind = AutopinLayerPool if autopin else LayerPool
        self.layers = {layer: kind(files, rows, policy, shared, start(rows), self.side_rows, self._syncs)
                       for layer, rows in capacities.items()}
        self._counts = TierCounts()
        self._counts_lock = threading.Lock()
        self.loader = RowLoader(files, client, direct, read_threads,
                                check_file=verify != "off" and files.checksums is not None, check_l2=check_l2)
        self._prefetcher = Prefetcher(self)
        # Next-layer prefetch's part in a fetch (settle, score, promote): None without side rows.
        self._ahead = self._prefetcher if self.side_rows else None
        self.donor = Donor(client, files) if client is not None and fill_l2 else None
        if client is not None:
            if self._ahead is not None:
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
        return self.loader.waits.counts()

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
        batch = set(picks)
        self._check_experts(batch)
        if self._ahead is not None:
            self._ahead.before_fetch(layer, batch)
        return self._fetch(self.layers[layer], batch, Lookup(layer, picks))

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
        # Held as a guess counts as held: the fetch promotes it.
        guesses = self._ahead.before_fetch(layer, batch) if self._ahead is not None else frozenset()
        missing = [e for e in lp.absent(batch) if e not in guesses]
        loan = view.lend(layer, missing)
        lookup = Lookup(layer, picks, list(loan.experts))
        absent = sorted(set(missing) - set(loan.experts))
        # Load-through: one read per miss, the daemon's, into L2, where the layer then computes on it; only where
        # L2 has room for the misses beside the batch's lent experts, which the daemon does not evict for them.
        room = view.attachment.slots[layer] - len(loan.experts)
        if absent and self.load_through_s and len(absent) <= room and not self._gives():
            lookup.missing, lookup.copied = absent, [False] * len(absent)
            lookup.report(self.client, now=True)
            loan = self._await_loan(view, loan, absent)
            lookup.awaited, lookup.lent = len(loan.experts) - len(lookup.lent), list(loan.experts)
        rest = batch - set(loan.experts)
        if not (loan or lookup.reported) or not lp.fits(rest):
            return TierCounts(), None
        return self._fetch(lp, rest, lookup), loan

    def _await_loan(self, view: L2View, loan: Loan, absent: list[int]) -> Loan:
        """The loan, with what of `absent` the daemon loads into L2 within load_through_s (woken on their slot_of
        entries: SlotIndex.wait)."""
        self.loader.waits.wait(view.attachment.slot_indexes[loan.layer], absent, self.load_through_s, absent=True)
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

    def _fetch(self, lp: LayerPool, batch: set[int], lookup: Lookup) -> TierCounts:
        """Make `batch` resident in L0 (its experts checked, the layer's prefetch settled), fill what it lacked,
        count the lookup with what L2 lent it, and report it unless it was reported already."""
        missing = lp.absent(batch)
        before = self.layers.get(lookup.layer - 1)
        lp.access(batch, before.latest() if before is not None else None)
        if self._ahead is None:
            promoted, taken = 0, self._take_rows(lookup.layer, lp, batch, missing) if missing else {}
        else:  # guesses held in side rows are L0 hits: promoted, without a read or a copy
            promoted, taken = self._ahead.take_rows(lookup.layer, lp, batch, missing, self._take_rows)
        lookup.missing = list(taken)
        if self._gives() and (lookup.lent or lookup.missing):
            # The daemon's policy sees the lookup before the give of its misses (docs/decisions.md, "The policy sees
            # a lookup before its give"); the report then only counts it.
            self.donor.look(lookup.layer, [*lookup.lent, *lookup.missing])
            lookup.folded = True
        filled = self._fill_rows(lp, list(taken.values()), lookup) if taken else TierCounts()
        counts = lookup.counts(len(batch) - len(missing) + promoted, filled)
        self._add_counts(counts)
        lookup.report(self.client)
        return counts

    def _take_rows(self, layer: int, lp: LayerPool, batch: set[int], missing: list[int]) -> dict[int, int]:
        """Rows for the misses (expert -> row), evicting only experts outside the batch."""
        if not lp.fits(batch):
            raise PoolTooSmall(f"layer {layer}: a batch of {len(batch)} experts does not fit an L0 pool of "
                               f"{lp.capacity} experts ({len(lp.pins() - batch)} pinned); fetch fewer tokens "
                               "at once or raise the L0 capacity")
        # Work queued with mx.async_eval (on Metal, kernels in flight) may still read the rows and the slot
        # table about to change: wait for it, so that any caller may refill rows between async steps.
        # The streamed forward has already synced on the router's choice, so the wait is free there.
        self._synchronize()
        return dict(zip(missing, lp.take_rows(missing, batch)))

    def _fill_rows(self, lp: LayerPool, rows: list[int], lookup: Lookup) -> TierCounts:
        """Fill the rows taken for the lookup's misses and publish them: copied from L2, or loaded through (reported
        at once and waited for), or read by this process, which gives them to L2 (client/donor.py: told as their
        read starts, handed over once it ended), or, on their way into L2 already, waited for and copied. Marks in
        the lookup which came from L2 and, giving, which this process read; returns the counts."""
        layer, missing, gifts = lookup.layer, lookup.missing, []
        gives = self._gives()
        # Each record says so in its row's word as its read lands: the donor copies it while the rest are read.
        landed = Landed(lp.landed, self.donor.wake_fd) if gives else None

        def load_through(copied: list[bool], coming: list[bool]) -> list[bool]:
            # Report the L2 misses now, so that the daemon starts loading them, and copy them as they land.
            lookup.copied = copied
            lookup.report(self.client, now=True)
            return self.loader.await_l2(layer, lp, missing, rows, copied, self.load_through_s)

        def give(copied: list[bool], coming: list[bool]) -> list[bool]:
            # Tell the donor of the L2 misses now, so that the daemon reserves their slots while they are read (none
            # taken from the batch's picks); those on their way into L2 are waited for (load_rows), not given. Its
            # thread is woken once the read has let go of the GIL (woken before, it delayed the read's start).
            unread = to_read(copied, coming)
            given = [missing[i] for i in unread]
            gifts.extend(self.donor.give(layer, lp, given, [rows[i] for i in unread],
                                         keep=[*lookup.lent, *lookup.picks], landed=landed.words))
            _native.wake_when_reading([self.donor.wake_fd])
            return copied

        def read(whole: bool) -> None:
            _native.flush_read_wakes()  # where nothing was read (every miss on its way into L2), or the read failed
            # The donor may copy the gifts once their rows are whole: before this fetch waits for what is coming.
            if gifts:
                self.donor.read_done(gifts, whole)
                gifts.clear()

        through = self.load_through_s and self.client is not None and not lookup.reported and not gives
        try:
            lookup.copied, filled = self.loader.load_rows(
                layer, lp, missing, rows, load_through if through else give if gives else None,
                coming_s=self.load_through_s if gives else 0.0, on_read=read, landed=landed)
        except BaseException:
            read(False)
            raise
        if gives:
            # Reported with the next flush, as a hit is, what this process read, given or read once its coming record
            # did not land, is named so that the daemon loads none of it (docs/decisions.md, "Fills").
            lookup.given = [e for e, ok in zip(missing, lookup.copied) if not ok]
        lp.publish(missing, rows)
        return filled

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

    def settle(self, layer: int) -> None:
        """Cancel the layer's prefetches that have not started and wait for the one running, if any."""
        self._prefetcher.settle(layer)

    def wait_prefetches(self, layer: int | None = None) -> None:
        """Wait until the prefetches issued so far for the layer (None: every layer) have landed, without
        cancelling any; for callers that know they have time to spare (a benchmark's compute, a test)."""
        self._prefetcher.wait(layer)

    def close(self) -> None:
        self._prefetcher.close()
        if self.donor is not None:
            self.donor.close()
        self.loader.close()

    def __enter__(self) -> "ExpertPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
