"""RowLoader: fills L0 rows taken for a layer's experts with their records, for ExpertPool's fetch and the
prefetch worker: copies from L2 shared memory through the native seqlock copy, waits for records on their way into
L2 (client/slot_waits.py), and reads what L2 lacks (or tore) from the model file with the native parallel pread,
checked against the checksum manifest as configured (docs/architecture.md, "Integrity", "Fills"). It publishes
nothing: the pool points the slot table at the rows once they hold their whole records."""

from __future__ import annotations

import logging
import os
import time

from moe_l2.model import ModelFiles
from moe_l2.model.records import Landed

from moe_l2.client.layerpool import LayerPool
from moe_l2.client.lookup import TierCounts
from moe_l2.client.slot_waits import SlotWaits

log = logging.getLogger("moe-l2.client")

# Threads for copies from L2 (memory bound), by default: the cores, up to 8. Reads of the model file wait on
# the disk, so they get at least 4: 4 beat 2 by 1.1-1.15x on the 2-core VM (bench/bench_io.py, section 4).
COPY_THREADS = min(8, os.cpu_count() or 1)
READ_THREADS = max(4, COPY_THREADS)


def to_read(copied: list[bool], coming: list[bool]) -> list[int]:
    """The indexes of the misses neither copied from L2 nor on their way into it: those the file is read for."""
    return [i for i, (ok, c) in enumerate(zip(copied, coming)) if not (ok or c)]


class RowLoader:
    """One pool's model file descriptors, its L2 client, its checks and its waits for records coming into L2."""

    def __init__(self, files: ModelFiles, client, direct: bool | None, read_threads: int | None,
                 check_file: bool, check_l2: bool):
        self.files = files
        self.client = client
        self.read_threads = read_threads or READ_THREADS
        # Large records are copied from L2 on several threads: one core does not reach the memory bandwidth.
        self.copy_threads = COPY_THREADS
        self.check_file = check_file
        self.check_l2 = check_l2
        self.waits = SlotWaits()
        self.fds = files.open_fds(direct)

    def load_rows(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int], on_l2_miss=None,
                  side: bool = False, coming_s: float = 0.0, on_read=None,
                  landed: Landed | None = None) -> tuple[list[bool], TierCounts]:
        """Fill rows taken for the experts with their records: L2 copies, the file for the rest, checked as
        configured; nothing is published. Returns which came from L2 and the counts; on failure the rows go
        back (side: side rows, the prefetch worker's).
        on_l2_miss(copied, coming) -> copied: called when L2 lacked some, before the file is read.
        coming_s: the misses whose records are on their way into L2 (read by another process, or by the daemon)
        are not read: once the rest are, they are waited for, up to coming_s after the lookup, and copied; only
        those that have not landed by then are read too (docs/architecture.md, "Fills"). on_read(True): called once
        the misses read at first are whole and checked, before that wait. landed: the misses read at first say so
        as each lands (ModelFiles.read_into_rows), each in its row's word (Rows.landed)."""
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
            unread = [(experts[i], rows[i]) for i in to_read(copied, coming)]
            if landed is not None:
                landed = Landed(landed.words, landed.fd, tuple(row for _, row in unread))
            self._read_checked(layer, lp, unread, landed)
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

    def await_l2(self, layer: int, lp: LayerPool, missing: list[int], rows: list[int], copied: list[bool],
                 timeout_s: float) -> list[bool]:
        """Copy the misses from L2 once the daemon has loaded them, waiting up to timeout_s on their slot_of
        entries (SlotIndex.wait: woken by the daemon's begin_fill, then by its publish)."""
        copied = list(copied)
        self._copy_landed(layer, lp, missing, rows, copied, [not ok for ok in copied], timeout_s, True)
        return copied

    def _attachment(self, layer: int):
        """The daemon epoch attached now, where it serves the layer (moe-l2d --layers), else None."""
        attachment = self.client.attachment if self.client is not None else None
        return attachment if attachment is not None and attachment.serves(layer) else None

    def _coming(self, layer: int, experts: list[int], copied: list[bool]) -> list[bool]:
        """Which of the experts not copied have records on their way into L2 now (SlotIndex.wait without a wait)."""
        attachment = self._attachment(layer)
        if attachment is None or all(copied):
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
            copied[i] = not self.check_l2 or self._intact_copy(layer, lp, experts[i], rows[i])
        return sum(copied[i] for i in landed)

    def _copy_landed(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int], copied: list[bool],
                     todo: list[bool], timeout_s: float, absent: bool) -> None:
        """Wait on the slot_of entries of the experts marked in `todo` (absent: also for those not yet coming) up to
        timeout_s, then copy them from L2, marking in `copied` those that came."""
        attachment = self._attachment(layer)
        picked = [i for i, t in enumerate(todo) if t]
        if attachment is None or not picked:
            return
        experts, rows = [experts[i] for i in picked], [rows[i] for i in picked]
        self.waits.wait(attachment.slot_indexes[layer], experts, timeout_s, absent)
        for i, ok in zip(picked, self._copy_from_l2(layer, lp, experts, rows)):
            copied[i] = ok

    def _copy_from_l2(self, layer: int, lp: LayerPool, experts: list[int], rows: list[int]) -> list[bool]:
        attachment = self._attachment(layer)
        if attachment is None:  # no daemon, or an unserved layer: the file
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
        if not self.check_l2:
            return copied
        return [ok and self._intact_copy(layer, lp, e, r) for e, r, ok in zip(experts, rows, copied)]

    def _read_checked(self, layer: int, lp: LayerPool, todo: list[tuple[int, int]],
                      landed: Landed | None = None) -> None:
        """Read (expert, row) pairs from the model file and check them against the manifest as configured."""
        sums = self.read_from_l3(layer, lp, todo, landed)
        if self.check_file:
            for (expert, row), checksum in zip(todo, sums or [lp.checksum(row) for _, row in todo]):
                self.files.check_record(layer, expert, checksum, "the model file")

    def read_from_l3(self, layer: int, lp: LayerPool, todo: list[tuple[int, int]],
                     landed: Landed | None = None) -> list[int] | None:
        """Read into the rows: stacked models piece by piece, packed ones in one read per expert straight into
        its row, GGUF ones converted to MLX's layout on the way (see ModelFiles.read_into_rows).
        Returns the records' checksums where the format computed them as it read (packed), else None."""
        if not todo:
            return None
        targets = [(expert, lp.places(row)) for expert, row in todo]
        return self.files.read_into_rows(self.fds, layer, targets, threads=self.read_threads,
                                         checksums=self.check_file, landed=landed)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
