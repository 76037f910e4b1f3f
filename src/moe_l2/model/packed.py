"""Packed checkpoints, written by ``moe-l2 pack`` (src/moe_l2/model/packer.py): per-expert tensors laid out
expert-major, each record one contiguous extent at a page-aligned file offset with its pieces at their
record offsets, so that a record is one read, direct-I/O friendly (docs/formats.md, "Packed checkpoints").

A checkpoint is packed by its geometry, not by its marker; a marked checkpoint whose geometry is broken
is refused as damaged.
"""

from __future__ import annotations

import sys

from moe_l2.model.records import PACK_ALIGN, Landed, RecordLayout, RecordReader
from moe_l2.model.safetensors import Checkpoint, SafetensorsReader

__all__ = ["PACK_MARKER", "NotPacked", "record_starts", "PackedReader", "checkpoint_reader"]

# __metadata__["moe_l2"] of the safetensors files `moe-l2 pack` writes.
PACK_MARKER = "packed-v1"
# pread_scatter reads each batch into scratch memory first: at most this many bytes of it at a time.
_SCATTER_BYTES = 128 << 20
# The largest single read of a record (each piece's bytes are copied to its row, and checksummed, as its read
# lands). Smaller reads split a miss over the read threads, a deeper queue, but gained nothing on the disk
# this was measured on and lost from 256 KiB down (bench/bench_io.py, section 4; docs/formats.md, "Direct
# I/O"); a disk that rewards depth (an Apple SSD, say: not measured) would want a smaller one.
READ_UNIT_BYTES = 8 << 20


class NotPacked(ValueError):
    """A checkpoint's records are not single page-aligned extents; the message names the first that is not."""


def record_starts(checkpoint: Checkpoint) -> list[list[tuple[int, int]]]:
    """Per MoE layer, per expert (file index, start) of each record's extent; NotPacked unless every record
    is one page-aligned extent with its pieces at their record offsets, inside its file."""
    layout = checkpoint.layout
    sizes = [h.size for h in checkpoint.headers]
    starts = []
    for layer, where in enumerate(checkpoint.places):
        row = []
        for e in range(checkpoint.n_experts):
            first = layout.pieces[0]
            f, off = where[first.key][e]
            base = off - first.offset
            for p in layout.pieces:
                if where[p.key][e] != (f, base + p.offset):
                    raise NotPacked(f"MoE layer {layer} expert {e}: {p.key} is not at its record offset")
            if base % PACK_ALIGN:
                raise NotPacked(f"MoE layer {layer} expert {e}: the record starts at byte {base}, not page-aligned")
            if base + layout.span > sizes[f]:
                raise NotPacked(f"MoE layer {layer} expert {e}: the file ends inside the record's padded extent")
            row.append((f, base))
        starts.append(row)
    return starts


class PackedReader(SafetensorsReader):
    """A packed checkpoint's records: one read of one extent each."""

    def __init__(self, checkpoint: Checkpoint, starts: list[list[tuple[int, int]]]):
        layout = checkpoint.layout
        super().__init__(checkpoint, RecordLayout(layout.pieces, layout.nbytes, "packed"))
        self._starts = starts
        self.read_unit_bytes = READ_UNIT_BYTES

    @property
    def direct_default(self) -> bool:
        # One large aligned read per record: direct I/O serves it at the disk's speed without copying it
        # through the page cache, and keeps a model larger than RAM from evicting everything else's cache
        # (bench/bench_io.py, docs/formats.md "Direct I/O").
        return sys.platform in ("linux", "darwin")

    def record_span(self, layer: int, expert: int) -> tuple[int, int, int]:
        f, start = self._starts[layer][expert]
        return f, start, self.layout.span

    def read_into_slots(self, fds: list[int], layer: int, targets: list[tuple], threads: int) -> None:
        from moe_l2 import _native

        span = self.layout.span
        jobs = []
        for expert, memory, base, room in targets:
            f, start = self._starts[layer][expert]
            # The whole padded extent where the slot has room for it: an aligned read for direct I/O.
            jobs.append((fds[f], start, span if room >= span else self.layout.nbytes, memory, base))
        _native.pread_records(jobs, threads=threads, unit_bytes=self.read_unit_bytes)

    def read_into_rows(self, fds: list[int], layer: int, targets: list[tuple], threads: int,
                       checksums: bool = False, landed: Landed | None = None) -> list[int] | None:
        from moe_l2 import _native

        scatter = []
        for expert, rows in targets:
            f, start = self._starts[layer][expert]
            scatter.append((fds[f], start, self.layout.nbytes,
                            [(p.offset, p.nbytes, mem, off) for p, (mem, off) in zip(self.layout.pieces, rows)]))
        per_call = max(1, _SCATTER_BYTES // self.layout.span)
        sums = []
        words, at, fd = (landed.words, landed.at, landed.fd) if landed is not None else (None, (), -1)
        for i in range(0, len(scatter), per_call):
            sums += _native.pread_scatter(scatter[i:i + per_call], threads=threads, unit_bytes=self.read_unit_bytes,
                                          checksums=checksums, landed=words, landed_at=at[i:i + per_call], landed_fd=fd)
        return sums if checksums else None


def checkpoint_reader(checkpoint: Checkpoint) -> RecordReader:
    """A PackedReader where every record is one page-aligned extent, else a SafetensorsReader."""
    try:
        starts = record_starts(checkpoint)
    except NotPacked as e:
        marked = [f.name for f, h in zip(checkpoint.files, checkpoint.headers)
                  if h.metadata.get("moe_l2") == PACK_MARKER]
        if marked:
            raise ValueError(f"{checkpoint.path}: {marked[0]} says it was written by moe-l2 pack, but {e}: "
                             "damaged or edited; pack the model again") from e
        return SafetensorsReader(checkpoint)
    return PackedReader(checkpoint, starts)
