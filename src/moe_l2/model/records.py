"""Expert records, and the interface every model format implements (docs/formats.md).

Every routed expert of every MoE layer is one record: its tensors (the switch-layer pieces
``gate_proj.weight``, ``gate_proj.scales``, ...) at fixed, 64-byte aligned offsets. A format module
(safetensors, packed, gguf) finds where each piece of each record lies in the model's files, from the
headers alone, and reads records the way its files want; ``ModelFiles`` delegates to it.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from moe_l2 import _native
from moe_l2.layout import record_stride
from moe_l2.model.bounds import open_regular

__all__ = ["ALIGN", "PACK_ALIGN", "FORMATS", "Landed", "Piece", "RecordLayout", "RecordReader", "hash_part",
           "pread_plain", "record_checksum"]

ALIGN = 64
# Packed records start at multiples of this many bytes (the direct-I/O block: 512 and 4096 divide it).
PACK_ALIGN = 4096
FORMATS = ("safetensors", "packed", "gguf")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Landed:
    """Where a read into rows says that a record is whole: word at[i] of `words` (4 bytes each, a _native.Memory)
    becomes 1 as targets[i] lands, and `fd` gets one byte (client/donor.py copies the record on into L2 while
    the records after it are still read)."""

    words: object
    fd: int
    at: tuple[int, ...] = ()


@dataclass(frozen=True)
class Piece:
    """One tensor of a record: `nbytes` at `offset` in the record; dtype is an mlx.core attribute name."""

    key: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class RecordLayout:
    pieces: tuple[Piece, ...]
    nbytes: int
    # Where the records come from: "safetensors" (piece by piece), "packed" (one extent per record),
    # "gguf" (transcoded). The pieces are the same for a checkpoint and its packed copy.
    format: str = "safetensors"

    @classmethod
    def build(cls, specs: Iterable[tuple[str, tuple[int, ...], str, int]],
              format: str = "safetensors") -> "RecordLayout":
        """Lay out (key, shape, dtype, nbytes) specs in key order, each piece 64-aligned."""
        pieces = []
        offset = 0
        for key, shape, dtype, nbytes in sorted(specs):
            pieces.append(Piece(key, offset, nbytes, tuple(shape), dtype))
            offset = _align(offset + nbytes)
        return cls(tuple(pieces), offset, format)

    @property
    def packed(self) -> bool:
        return self.format == "packed"

    @property
    def stride(self) -> int:
        """Bytes a record takes where records lie side by side in memory, each on a page: an L2 slot, an L0 row
        (what L0 budgets count)."""
        return record_stride(self.nbytes)

    @property
    def span(self) -> int:
        """Bytes of one packed record in its file: the record rounded up to PACK_ALIGN."""
        return -(-self.nbytes // PACK_ALIGN) * PACK_ALIGN

    def piece(self, key: str) -> Piece:
        for p in self.pieces:
            if p.key == key:
                return p
        raise KeyError(f"no piece {key!r} in the record layout (have {', '.join(self.keys())})")

    def keys(self) -> list[str]:
        return [p.key for p in self.pieces]

    def checksum(self, data, base: int = 0) -> int:
        """record_checksum of the record laid out at base of data (a slot, read_record's bytes)."""
        view = memoryview(data)
        return record_checksum(view[base + p.offset:base + p.offset + p.nbytes] for p in self.pieces)

    def describe(self) -> list:
        return [
            {"key": p.key, "offset": p.offset, "nbytes": p.nbytes, "shape": list(p.shape), "dtype": p.dtype}
            for p in self.pieces
        ]


def row_strides(first: int, shape) -> list[int]:
    """Strides, in items, of an array [rows, *shape] over records `first` items apart, each row's piece
    row-major: a piece of every slot of L2 or row of L0."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return [first, *strides]


def record_checksum(pieces: Iterable) -> int:
    """A record's checksum: CRC-32 over its pieces' bytes, given in layout order, padding left out (the
    same wherever the pieces lie: a slot, a row of L0, a file; docs/formats.md, "Checksums")."""
    checksum = 0
    for piece in pieces:
        checksum = _native.crc32(piece, checksum)  # zlib.crc32's value, at the CPU's speed where it has one
    return checksum


def hash_part(h, data: bytes) -> None:
    """Feed one length-prefixed part of a fingerprint to the hash h."""
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def pread_plain(path: Path, offset: int, nbytes: int) -> bytes:
    """nbytes at offset of path with a plain file read (the ground-truth path of read_record); OSError when the
    file holds fewer now."""
    with os.fdopen(open_regular(path), "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
        if len(data) != nbytes:
            raise OSError(f"unexpected end of file in bytes [{offset + len(data)}, {offset + nbytes}) of {path} "
                          f"(it has {os.fstat(f.fileno()).st_size} bytes): truncated model file?")
    return data


class RecordReader(ABC):
    """One model format's view of a model: its identity (what ModelFiles exposes) and its record reads.

    Made by the format module's ``open``; ModelFiles checks layer and expert numbers (MoE-layer numbers
    0..n_layers-1) before it calls any method here.
    """

    path: Path
    files: list[Path]
    config: dict
    model_type: str
    layer_ids: list[int]
    n_experts: int
    top_k: int
    layout: RecordLayout
    fingerprint: str
    # GGUF: projection -> {"group_size", "bits", "mode"} of its MLX quantization; {} otherwise
    # (safetensors checkpoints say it in config["quantization"]).
    quantization: dict
    # Whether the files are read with direct I/O unless told otherwise (docs/formats.md, "Direct I/O").
    direct_default: bool = False

    @abstractmethod
    def extents(self, layer: int, expert: int) -> list[tuple[int, int, int, int]]:
        """(file index, file offset, nbytes, record offset) of each piece of the record, in record order."""

    def record_span(self, layer: int, expert: int) -> tuple[int, int, int]:
        """(file index, file offset, span) of the record's one page-aligned extent: packed models only."""
        raise ValueError(f"{self.path}: a {self.layout.format} model's records are not single extents; "
                         "`moe-l2 pack` it first")

    @abstractmethod
    def read_record(self, layer: int, expert: int) -> bytes:
        """The record's bytes (padding zero) with plain file reads: the ground truth of `moe-l2 verify`."""

    def file_ranges(self, layer: int, expert: int) -> list[tuple[int, int, int]]:
        """(file index, file offset, nbytes) of each range of the model's files the record is read from."""
        return [(f, offset, nbytes) for f, offset, nbytes, _ in self.extents(layer, expert)]

    def record_files(self, layer: int, expert: int) -> list[Path]:
        """The files that hold the record's bytes (to name them when a record fails its checksum)."""
        return [self.files[f] for f in sorted({f for f, *_ in self.file_ranges(layer, expert)})]

    @abstractmethod
    def read_into_slots(self, fds: list[int], layer: int, targets: list[tuple], threads: int) -> None:
        """Read records into daemon slots, in MLX's layout, with the native reads (GIL released).

        targets: [(expert, memory, offset, room)], the whole record laid out at offset of memory, with
        room bytes there (the slot stride); fds from ModelFiles.open_fds."""

    @abstractmethod
    def read_into_rows(self, fds: list[int], layer: int, targets: list[tuple], threads: int,
                       checksums: bool = False, landed: Landed | None = None) -> list[int] | None:
        """Read records into client pool rows, in MLX's layout, with the native reads (GIL released).

        targets: [(expert, [(memory, offset), one per layout piece])]; fds from ModelFiles.open_fds. With
        checksums, a reader that computes them as the bytes land (packed) returns each target's
        record_checksum; None means the caller computes them. With `landed`, a reader that reads record by
        record (packed) says as each lands; the others say nothing, and the caller learns at the end."""

    @abstractmethod
    def expert_tensor_names(self) -> set[str]:
        """Every tensor name of the files that belongs to a routed expert."""

    @abstractmethod
    def tensor_names(self, layer: int) -> dict[str, dict[Optional[int], str]]:
        """Safetensors models: key -> {expert, or None for a stacked tensor: checkpoint tensor name}."""
