"""A model the daemon serves: its files, its shared-memory segments, one slot store per layer.

Every change of a slot follows the seqlock (docs/architecture.md, "Shared memory"), so that a client copying
concurrently either gets the whole record or gives up, and every writer call is here: `reserve` (SlotIndex.begin_fill:
seq odd, the evicted expert unmapped, slot_of saying the record is coming, which clients wait on), then either `fill`
(the daemon reads the record into the slot, checksummed as it lands) or `take_donation` (a client of the daemon's uid
copied it in: daemon/fills.py), each checking the bytes and ending in `finish_fill` (the slot's expert, seq even,
then slot_of published) or `abort_fill` (the record absent again); both wake the clients waiting for it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial

from moe_l2 import _native
from moe_l2.cache.policy import DEFAULT_POLICY, make_policy
from moe_l2.cache.prediction import PredictorError
from moe_l2.cache.profile import MIN_CONFIDENCE, Profile
from moe_l2.cache.store import LayerStore, Reservation
from moe_l2.layout import Geometry, IndexHeader
from moe_l2.model import CorruptRecord, ModelFiles
from moe_l2.ranges import format_ranges
from moe_l2.protocol import ProtocolError

from moe_l2.daemon.loader import Preload
from moe_l2.daemon.stats import ModelCounters

log = logging.getLogger("moe-l2d.loader")

# Threads one record's read is split over: a lone miss read at the speed of a client's own read
# (client/pool.py, READ_THREADS).
READ_THREADS = 4

# Makes a segment of nbytes for the index (layer None) or a MoE layer's data, at a name of the daemon's choosing
# (Daemon._new_segment: a random one, listed for reclaim).
NewSegment = Callable[[int | None, int], _native.Segment]


class ServedModel:
    def __init__(self, files: ModelFiles, geometry: Geometry, new_segment: NewSegment, *, epoch: int,
                 policy: str = DEFAULT_POLICY, profile: Profile | None = None, direct_io: bool | None = None,
                 layers: tuple[int, ...] | None = None):
        """layers: the MoE layers served (moe-l2d --layers, as ModelFiles.moe_layers_in gives them); None:
        all. The others have no data segment and no store: clients read them from the model files."""
        self.files = files
        self.geometry = geometry
        self.policy = policy
        self.lock = threading.Lock()
        self.counters = ModelCounters()
        self.layers = tuple(range(files.n_layers)) if layers is None else tuple(layers)
        self.index_name = ""
        self.data_names: dict[int, str] = {}  # served layer -> its data segment's name, once made
        self.slots = geometry.layer_slots(self.layers)
        self.stores = {layer: LayerStore(files.n_experts, n, make_policy(policy, n, files.n_experts))
                       for layer, n in self.slots.items()}
        if profile is not None:
            profile.check_model(files.n_layers, files.n_experts, str(files.path))
        self.profile = profile
        self.active_domain: str | None = None
        self.active_confidence: float | None = None
        self.hints = 0
        # Online statistics: the experts clients report looking up, per layer, per active domain ("" when
        # no hint named one); `moe-l2 profile --from-daemon` turns them into a profile.
        self.routing: dict[str, list[list[int]]] = {}
        self.layer_hits = [0] * files.n_layers  # clients' L2 lookups per layer, for moe-l2 stats --watch
        self.layer_misses = [0] * files.n_layers
        # (layer, slot) the governor took: when, while their pages wait out the grace (release_due), those given
        # back to the system, and those it could not reserve again (restore's error): out of use until it can.
        self.releasing: dict[tuple[int, int], float] = {}
        self.released: set[tuple[int, int]] = set()
        self.unbacked: dict[tuple[int, int], str] = {}
        self.index = None
        self.data: dict = {}  # served layer -> its data segment
        self.slot_indexes: dict = {}  # served layer -> its _native.SlotIndex, through which every fill goes
        # The warm start's preload of this model and when the heat it restores was saved (daemon/warm_start.py).
        self.preload: Preload | None = None
        self.heat_saved_at: float | None = None
        self.fds = files.open_fds(direct_io)
        # Linux can tell whether the filesystem took O_DIRECT; macOS' F_NOCACHE cannot be queried.
        self.direct_io = ModelFiles.direct_fds(self.fds) if hasattr(os, "O_DIRECT") else \
            (files.direct_default if direct_io is None else direct_io)
        try:
            self._create_segments(epoch, new_segment)
        except BaseException:
            self.close()
            raise

    def _create_segments(self, epoch: int, new_segment: NewSegment) -> None:
        g = self.geometry
        self.index = new_segment(None, g.index_bytes)
        self.index_name = self.index.name
        for layer in self.layers:
            self.data[layer] = new_segment(layer, self.slots[layer] * g.slot_stride)
            self.data_names[layer] = self.data[layer].name
        # An unserved layer's name is empty: clients read it from the model files (src/moe_l2/layout.py).
        names = tuple(self.data_names.get(layer, "") for layer in range(g.n_layers))
        header = IndexHeader(g, epoch, self.files.fingerprint, self.index_name, names).pack()
        view = self.index.view()
        view[:len(header)] = header
        # Every layer's whole part of the index starts empty: g.n_slots entries, a short layer's last one unused.
        for layer in range(g.n_layers):
            g.slot_index(self.index, layer, g.n_slots).clear()
        self.slot_indexes = {layer: g.slot_index(self.index, layer, self.slots[layer], self.data[layer])
                             for layer in self.layers}

    @property
    def segment_names(self) -> list[str]:
        """The names of the segments made so far (all of them once the constructor returned)."""
        return [name for name in (self.index_name, *self.data_names.values()) if name]

    @property
    def shm_bytes(self) -> int:
        return self.geometry.shm_bytes

    @property
    def layer_ids(self) -> list[int]:
        """The decoder layer numbers (model.layers.N) of the served MoE layers."""
        return [self.files.layer_ids[layer] for layer in self.layers]

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.geometry.n_layers:
            raise ProtocolError("OutOfRange", f"layer {layer} out of range: {self.files.path} has MoE layers "
                                              f"0..{self.geometry.n_layers - 1}")
        if layer not in self.stores:
            raise ProtocolError("OutOfRange", f"MoE layer {layer} (decoder layer {self.files.layer_ids[layer]}) of "
                                              f"{self.files.path} is not served by this daemon, which serves decoder "
                                              f"layers {format_ranges(self.layer_ids)} (moe-l2d --layers): its "
                                              "clients read it from the model files")

    def served_part(self, layers: dict) -> dict:
        """The entries of {layer: ...} for served layers. A report names the layers its client read from the
        model files too (a client of an earlier daemon, or one that reports everything): those are ignored,
        not refused (docs/architecture.md, "Served layers"); a layer outside the model is still an error."""
        for layer in layers:
            if not 0 <= layer < self.geometry.n_layers:
                self.check_layer(layer)
        return {layer: value for layer, value in layers.items() if layer in self.stores}

    def check_ids(self, layers: dict[int, list[int]]) -> None:
        """The one check of a request's layer and expert ids, where it enters (the server's handlers, the fill
        desk's give): ProtocolError OutOfRange for the first layer not served or expert out of range. A request
        is checked whole before it touches a store, so that a refused one changes nothing: no slot left reserved,
        no pin half taken (docs/security.md). demand, reserve, report, pin and unpin trust the ids they get."""
        n_experts = self.geometry.n_experts
        for layer, experts in layers.items():
            self.check_layer(layer)
            for expert in experts:
                if not 0 <= expert < n_experts:
                    raise ProtocolError("OutOfRange", f"expert {expert} out of range: this layer has experts "
                                                      f"0..{n_experts - 1}")

    def demand(self, layer: int, experts, loader, keep: frozenset[int] = frozenset()) -> int:
        """Load the experts that are neither resident nor on their way, evicting none in `keep`; returns how
        many loads started. Its ids are checked (check_ids) where the request entered."""
        reservations = self.reserve(layer, experts, keep)
        for r in reservations:
            loader.submit(partial(self.fill, layer, r), partial(self.abort_fill, layer, r))
        return len(reservations)

    def reserve(self, layer: int, experts, keep: frozenset[int] = frozenset(),
                optional: bool = False) -> list[Reservation]:
        """Slots for the experts that are neither resident nor on their way, evicting none in `keep`, each begun
        (seq odd, the evicted expert unmapped): to be ended by `fill`, `take_donation` or `abort_fill`. Its ids
        are checked (check_ids) where the request entered. optional: a give's records, which their reader computes
        on either way, so the policy may refuse them (LayerStore.reserve); a reported miss a client may be waiting
        for (load-through) always gets a slot where one may be taken."""
        store = self.stores[layer]
        reservations = []
        with self.lock:
            for expert in experts:
                if store.has(expert):
                    continue
                reservation = store.reserve(expert, keep, optional=optional)
                if reservation is None:
                    continue  # every slot pinned or loading, or (optional) the policy keeps its victim
                self.slot_indexes[layer].begin_fill(reservation.slot, reservation.evicted, reservation.expert)
                reservations.append(reservation)
        return reservations

    def fill(self, layer: int, r: Reservation) -> bool:
        """Read a reserved record from the model file straight into its slot (a packed record in one parallel
        read, direct I/O where the fds have it, checksummed as the bytes land; a GGUF one converted to MLX's
        layout on the way), check it against the manifest and publish it, or leave the slot free. True when it
        is in L2."""
        start = time.perf_counter()
        files = self.files
        try:
            data, base = self.data[layer], r.slot * self.geometry.slot_stride
            places = [(data, base + p.offset) for p in files.layout.pieces]
            checked = files.checksums is not None
            sums = files.read_into_rows(self.fds, layer, [(r.expert, places)], threads=READ_THREADS,
                                        checksums=checked)
            # Without a manifest nothing is compared, so nothing is computed; the slot's metadata holds 0.
            checksum = (sums[0] if sums else files.layout.checksum(data.view(), base)) if checked else 0
            files.check_record(layer, r.expert, checksum, "the model file")
            self.finish_fill(layer, r, checksum)
            self.counters.add_load(time.perf_counter() - start, files.layout.nbytes)
            return True
        except CorruptRecord as exc:
            if self.counters.add_corrupt(layer, r.expert):
                log.error("%s", exc)  # once per record: every miss on it tries (and refuses) it again
            self.abort_fill(layer, r)
        except Exception as exc:  # a bad read must cost one load, never the daemon
            log.error("loading layer %d expert %d of %s failed: %s", layer, r.expert, files.path, exc)
            self.abort_fill(layer, r)
            self.counters.add_load_error()
        return False

    def take_donation(self, layer: int, r: Reservation, checksum: int) -> bool:
        """A client says it copied the reserved record into its slot, with this checksum: publish it if the
        slot's bytes match the manifest, or the client's checksum where there is none; else leave the slot free.
        Returns whether it was published. The check is the daemon's own, over the bytes in the slot: a client
        that copied nothing, or half, publishes nothing (docs/security.md, "Who may write L2")."""
        files = self.files
        try:
            got = files.layout.checksum(self.data[layer].view(), r.slot * self.geometry.slot_stride)
        except ValueError:  # the segment is closed: the daemon is stopping
            return False
        expected = files.checksums.expected(layer, r.expert) if files.checksums is not None else checksum
        if got != expected:
            self.counters.add_fills("rejected")
            log.warning("a client's copy of MoE layer %d expert %d of %s into L2 has crc32 %08x, not %08x: "
                        "not published", layer, r.expert, files.path, got, expected)
            self.abort_fill(layer, r)
            return False
        self.finish_fill(layer, r, got if files.checksums is not None else 0)
        self.counters.add_fills("donated")
        return True

    def reserve_free(self, layer: int, expert: int) -> Reservation | None:
        """A free slot for a preload of the expert, its fill begun; None when it is held already or no slot is
        free (a preload never evicts)."""
        with self.lock:
            reservation = self.stores[layer].reserve(expert, evict=False)
            if reservation is not None:
                self.slot_indexes[layer].begin_fill(reservation.slot, reservation.evicted, reservation.expert)
        return reservation

    def resize(self, target: int) -> int:
        """Shrink or grow every layer toward `target` slots for the memory governor; returns the slots changed.

        A taken slot is cleared under its seqlock, so a client copying it sees the sequence move and counts a
        miss, and one that looks later finds no expert; its pages go back to the system later (release_due). A
        slot comes back into use only once its pages are reserved again (Segment.restore), outside the lock
        (reserving or re-locking a GiB takes a second or more, and reports must not wait): one that cannot be
        backed (a full /dev/shm) stays out of use, in `unbacked`, and is tried again at the next call. Only the
        governor's one thread calls this and release_due (docs/architecture.md, "Memory governor")."""
        g = self.geometry
        taken, offered = [], []
        with self.lock:
            for layer, store in self.stores.items():
                for r in store.shrink(target):
                    # Emptied under the seqlock: the expert unmapped, then the seq closed on an empty slot.
                    self.slot_indexes[layer].begin_fill(r.slot, r.evicted)
                    self.slot_indexes[layer].abort_fill(r.slot)
                    taken.append((layer, r.slot))
                offered += [(layer, slot) for slot in store.off_slots(target)]
        now = time.monotonic()
        self.releasing.update((key, now) for key in taken)
        backed: dict[int, list[int]] = {}
        for layer, slot in offered:
            try:
                self.data[layer].restore(slot * g.slot_stride, g.slot_stride)
            except OSError as exc:
                self.unbacked[layer, slot] = str(exc)
                continue
            for kept in (self.unbacked, self.releasing):
                kept.pop((layer, slot), None)
            self.released.discard((layer, slot))
            backed.setdefault(layer, []).append(slot)
        with self.lock:
            for layer, slots in backed.items():
                self.stores[layer].grow(slots)
        return len(taken) + sum(map(len, backed.values()))

    def release_due(self, taken_before: float) -> None:
        """Give back to the system the pages of the slots taken before `taken_before` (time.monotonic()).

        The wait is for clients: one that looked a slot up just before it was taken may still be reading it in
        place, and reading a released page allocates it again, which is a SIGBUS where /dev/shm has filled."""
        g = self.geometry
        for (layer, slot), taken_at in list(self.releasing.items()):
            if taken_at < taken_before:
                del self.releasing[layer, slot]
                if self.data[layer].release(slot * g.slot_stride, g.slot_stride):
                    self.released.add((layer, slot))

    @property
    def releasing_bytes(self) -> int:
        """Shared memory of taken slots whose pages have not gone back yet."""
        return len(self.releasing) * self.geometry.slot_stride

    @property
    def released_bytes(self) -> int:
        """Shared memory whose pages the governor gave back to the system (none on macOS, where taken slots
        only go out of use: docs/architecture.md, "Memory governor")."""
        return len(self.released) * self.geometry.slot_stride

    def finish_fill(self, layer: int, r: Reservation, checksum: int) -> None:
        with self.lock:
            self.slot_indexes[layer].finish_fill(r.slot, r.expert, checksum)
            self.stores[layer].commit(r)

    def abort_fill(self, layer: int, r: Reservation) -> None:
        with self.lock:
            self.slot_indexes[layer].abort_fill(r.slot, r.expert)
            self.stores[layer].abort(r)

    def report(self, layers: dict[int, list[list[int]]], routed: dict[int, list[int]], loader,
               keep: dict[int, frozenset[int]] | None = None, given: dict[int, list[int]] | None = None,
               source=None, folded: bool = False) -> None:
        """Fold a client's lookups into the policy (`observe`; not where they were `folded` in already, through the
        fill socket) and counters, load its misses but those it `given` (it read them and gives them through the
        fill socket: daemon/fills.py), and count its routing (every pick, L0 hits included; a client that sends no
        `routed` is counted by its L2 lookups). Its ids are checked (check_ids, served layers only) where the
        report entered.
        keep: per layer, experts the loads must not evict beside the report's own (a piece of a larger
        report keeps the whole report's: daemon.server.report_pieces). source: the client that sent it (the
        learned policy follows each client's latest lookups)."""
        lookups = {layer: [*hits, *misses] for layer, (hits, misses) in layers.items()}
        picks = routed or lookups
        with self.lock:
            routing = self._routing_counts(self.active_domain or "")
            for layer, experts in picks.items():
                row = routing[layer]
                for expert in experts:
                    row[expert] += 1
        hits_total = misses_total = 0
        for layer, (hits, misses) in layers.items():
            if not folded:
                self.observe(layer, lookups[layer], source)
            with self.lock:
                self.layer_hits[layer] += len(hits)
                self.layer_misses[layer] += len(misses)
            hits_total += len(hits)
            misses_total += len(misses)
            # The batch's own experts are never evicted for its misses: a client may be computing on them in
            # place right now (docs/architecture.md, "Load-through").
            batch = frozenset(lookups[layer]).union(routed.get(layer, ()), (keep or {}).get(layer, ()))
            read = set((given or {}).get(layer, ()))
            self.demand(layer, [e for e in misses if e not in read], loader, keep=batch)
        # A report that names its routed picks counts those (a piece of a split report may name an empty
        # list: its lookups are not picks); one that does not is counted by its L2 lookups.
        n_picks = sum(len(experts) for experts in routed.values()) if routed else hits_total + misses_total
        self.counters.add_lookups(hits_total, misses_total, self.files.layout.nbytes, n_picks)

    def observe(self, layer: int, lookups: list[int], source=None) -> None:
        """Fold one lookup of the layer (every expert looked up in L2) by `source` into its policy, with that
        client's latest lookup at the layer before as its context. Its ids are checked where they entered."""
        store = self.stores[layer]
        # A policy that may observe beside its victim() (the learned one, whose native model lets the GIL go) is
        # told outside the lock, which the fill desk's reservations and the loaders' publishing wait for
        # (docs/architecture.md, "Policies, profiles and hints").
        apart = getattr(store.policy, "concurrent_observe", False)
        with self.lock:
            before = self.stores.get(layer - 1)
            context = before.latest(source) if before else None
            if not apart:
                store.observe(lookups, source, context)
        if apart:
            store.observe(lookups, source, context)

    def pin(self, layer: int, experts: list[int], kind: str, loader) -> tuple[list[int], list[int]]:
        """Pin and load the experts, within the pin limit: (pinned, refused). Its ids are checked (check_ids)
        where the request entered."""
        store = self.stores[layer]
        with self.lock:
            pinned, refused = store.pin(experts, kind)
        self.demand(layer, pinned, loader)
        return pinned, refused

    def unpin(self, layer: int, experts: list[int], kind: str) -> None:
        """Its ids are checked (check_ids) where the request entered."""
        store = self.stores[layer]
        with self.lock:
            store.unpin(experts, kind)

    def _routing_counts(self, domain: str) -> list[list[int]]:
        counts = self.routing.get(domain)
        if counts is None:
            counts = self.routing[domain] = [[0] * self.geometry.n_experts for _ in range(self.geometry.n_layers)]
        return counts

    def hint(self, text: str | None, domain: str | None, loader) -> dict:
        """Predict (or take) the domain, pin its top experts per layer within the pin budget and load them.
        No text and no domain: the domain is no longer active, its pins are released."""
        if self.profile is None:
            raise ProtocolError("NoProfile", f"moe-l2d has no domain profile for {self.files.path}, so it "
                                             "cannot predict from a hint (start it with --profile); clients "
                                             "keep working without hints")
        confidence = 1.0
        scores = {}
        if domain:
            if domain not in self.profile.domains:
                raise ProtocolError("UnknownDomain", f"the profile of {self.files.path} has no domain {domain!r}; "
                                                     f"it knows {', '.join(self.profile.domain_names) or 'none'}")
        elif text:
            try:
                prediction = self.profile.predict(text)
            except PredictorError as exc:
                raise ProtocolError("NoPredictor", str(exc)) from None
            domain, confidence, scores = prediction.domain, prediction.confidence, prediction.scores
        self.hints += 1
        if domain and confidence < MIN_CONFIDENCE:
            # Too unsure to move pins: keep whatever the last confident hint set up.
            return {"domain": domain, "confidence": confidence, "scores": scores, "applied": False,
                    "active_domain": self.active_domain, "pinned": {}, "loads": 0}
        pinned: dict[int, list[int]] = {}
        loads = 0
        for layer, store in self.stores.items():
            with self.lock:
                pinned[layer] = store.apply_hint(self.profile, domain, layer)
            loads += self.demand(layer, pinned[layer], loader)
        self.active_domain, self.active_confidence = domain or None, confidence if domain else None
        return {"domain": domain or None, "confidence": confidence if domain else None, "scores": scores,
                "applied": True, "active_domain": self.active_domain, "pinned": pinned, "loads": loads}

    def describe(self, routing: bool = False) -> dict:
        """The stats of this model: hit rate, per-layer occupancy, pins, loads, bytes; with `routing`, the
        online routing counts too."""
        with self.lock:
            unbacked = list(self.unbacked.items())
            layers = [{"layer": layer, "layer_id": self.files.layer_ids[layer], "resident": s.resident,
                       "loading": s.loading, "pinned": s.pin_count, "slots": s.capacity,
                       "unbacked": sum(1 for (at, _), _ in unbacked if at == layer),
                       "hits": self.layer_hits[layer], "misses": self.layer_misses[layer],
                       "permanent_pins": s.pins("permanent"), "domain_pins": s.pins("domain"),
                       "experts": s.residents()}
                      for layer, s in self.stores.items()]
            counts = {d: [list(row) for row in rows] for d, rows in self.routing.items()} if routing else None
        snap = self.counters.snapshot()
        snap.update({
            "path": str(self.files.path),
            "fingerprint": self.files.fingerprint,
            "policy": self.policy,
            "n_layers": self.geometry.n_layers,
            "served_layers": list(self.layers),  # MoE layer numbers; layer_ids: their decoder layers
            "served_layer_ids": self.layer_ids,
            "layer_ids": list(self.files.layer_ids),
            "n_experts": self.geometry.n_experts,
            "slots_per_layer": self.geometry.n_slots,  # the most; the last short_layers hold one fewer
            "short_layers": self.geometry.n_short,
            "record_bytes": self.geometry.record_bytes,
            "format": self.files.format,
            "direct_io": self.direct_io,
            "shm_bytes": self.shm_bytes,
            "released_bytes": self.released_bytes,
            # Slots out of use because their pages could not be reserved again, and why (the last error).
            "unbacked_slots": len(unbacked),
            "unbacked_error": unbacked[-1][1] if unbacked else None,
            "loads_in_flight": sum(layer["loading"] for layer in layers),
            "layers": layers,
            "profile": self.profile.path if self.profile is not None else None,
            "domains": self.profile.domain_names if self.profile is not None else [],
            "active_domain": self.active_domain,
            "active_confidence": self.active_confidence,
            "hints": self.hints,
            "warm_start": self._warm_start_figures(),
        })
        if counts is not None:
            # Online statistics: per active domain ("" without one), per layer, how often clients' routers
            # picked each expert. moe-l2 profile --from-daemon reads these.
            snap["routing"] = counts
        return snap

    def _warm_start_figures(self) -> dict | None:
        """What the warm start preloads, and when the heat it restores was saved; None without one."""
        p = self.preload
        if p is None:
            return None
        return {"saved_at": self.heat_saved_at, "records": len(p.records), "preloaded": p.loaded,
                "preloaded_bytes": p.loaded * self.files.layout.nbytes, "pending": p.unfinished()}

    def close(self) -> None:
        """Unmap and unlink the segments and close the files; the loader must be stopped first."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for segment in (self.index, *self.data.values()):
            if segment is not None:
                segment.close()
        for name in self.segment_names:
            _native.Segment.unlink(name)
        self.index, self.data, self.slot_indexes = None, {}, {}
