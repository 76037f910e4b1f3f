"""``ModelFiles``: a MoE model's identity (path, config, record layout, fingerprint, format) and its one
L3 read path, whatever the format (docs/formats.md).

``ModelFiles.open`` picks the format's reader (``moe_l2.model.gguf``, ``.packed``, ``.safetensors``) and
delegates every record operation to it: ``read_into_slots`` for the daemon's shared-memory slots,
``read_into_rows`` for the client's pool rows, ``read_record`` for verification; ``open_fds`` opens the
files for both (optionally with direct I/O).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

from moe_l2.model import gguf, packed, safetensors
from moe_l2.model.bounds import check_directory, open_regular
from moe_l2.model.checksums import MANIFEST_NAME, CorruptRecord, Manifest, UnreadableRecord, load_manifest
from moe_l2.model.records import Landed, RecordLayout, RecordReader, hash_part
from moe_l2.ranges import format_ranges, format_ranges_of

__all__ = ["DIRECT_IO", "ModelFiles"]

log = logging.getLogger("moe-l2.model")

# The --direct-io choices of the daemon and the clients, as open_fds(direct=...) takes them.
DIRECT_IO = {"auto": None, "on": True, "off": False}


def _open_reader(path: Path) -> RecordReader:
    """The reader of the format at path: GGUF by its files, packed by the geometry of a checkpoint. Each format
    holds its files to src/moe_l2/model/bounds.py as it reads them; the directory is checked for what others open."""
    if path.is_dir():
        check_directory(path, MANIFEST_NAME)
    if gguf.is_gguf(path):
        return gguf.GGUFReader(path)
    return packed.checkpoint_reader(safetensors.read_checkpoint(path))


def _with_real_paths(fingerprint: str, files) -> str:
    """The format's fingerprint extended by the real paths of the model's files: a copy elsewhere (another
    user's, with the same names, sizes and mtimes but other bytes) is another model (docs/security.md)."""
    h = hashlib.sha256(fingerprint.encode())
    for f in files:
        hash_part(h, os.fsencode(os.path.realpath(f)))
    return h.hexdigest()[:32]


class ModelFiles:
    """A MoE model's files, config, MoE layers and expert records (safetensors, packed or GGUF).

    Layer arguments are MoE-layer numbers 0..n_layers-1; layer_ids maps them to the model's layer index.
    `reader` is the format's RecordReader (src/moe_l2/model/records.py), which does the reads.
    """

    path: Path
    files: list[Path]
    config: dict
    model_type: str
    n_layers: int
    layer_ids: list[int]
    n_experts: int
    top_k: int
    layout: RecordLayout
    fingerprint: str
    content_fingerprint: str
    format: str
    # GGUF: projection -> {"group_size", "bits", "mode"} of its MLX quantization; {} otherwise
    # (safetensors checkpoints say it in config["quantization"]).
    quantization: dict
    reader: RecordReader
    # The model's current checksum manifest (docs/formats.md, "Checksums"), or None; when it has one that
    # cannot be used (stale, damaged), checksum_problem says why and what to do.
    checksums: Optional[Manifest]
    checksum_problem: Optional[str]

    def __init__(self, *args, **kwargs):
        raise TypeError("use ModelFiles.open(path)")

    @classmethod
    def open(cls, path) -> "ModelFiles":
        """Open a model directory (mlx-lm safetensors, packed, or holding one GGUF model) or a .gguf file."""
        path = Path(path)
        reader = _open_reader(path)
        self = object.__new__(cls)
        self.path = path
        self.files = reader.files
        self.config = reader.config
        self.model_type = reader.model_type
        self.n_layers = len(reader.layer_ids)
        self.layer_ids = reader.layer_ids
        self.n_experts = reader.n_experts
        self.top_k = reader.top_k
        self.layout = reader.layout
        # The manifest is keyed by what the files hold (names, sizes, mtimes, headers), not where they are,
        # so a model moved with its mtimes keeps its manifest; the fingerprint clients and the daemon compare
        # names the location too (docs/security.md).
        self.content_fingerprint = reader.fingerprint
        self.fingerprint = _with_real_paths(reader.fingerprint, reader.files)
        self.format = reader.layout.format
        self.quantization = reader.quantization
        self.reader = reader
        self.checksums, self.checksum_problem = load_manifest(path, self.content_fingerprint, self.layout.nbytes,
                                                              self.n_layers, self.n_experts)
        if self.checksum_problem:
            log.warning("%s: records are not checked: %s", path, self.checksum_problem)
        return self

    def _check(self, layer: int, expert: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"MoE layer {layer} out of range (model has {self.n_layers})")
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"expert {expert} out of range (model has {self.n_experts})")

    def extents(self, layer: int, expert: int) -> list[tuple[int, int, int, int]]:
        """(file index, file offset, nbytes, record offset) of each piece of the record, in record order.

        Safetensors and packed models only: GGUF records are converted, not copied."""
        self._check(layer, expert)
        return self.reader.extents(layer, expert)

    def record_span(self, layer: int, expert: int) -> tuple[int, int, int]:
        """Packed models: (file index, file offset, span) of the record's one extent. The offset is a
        multiple of PACK_ALIGN and the span is the record rounded up to it (the padding is in the file)."""
        self._check(layer, expert)
        return self.reader.record_span(layer, expert)

    def read_record(self, layer: int, expert: int) -> bytes:
        """The record's bytes (padding zero), read with plain file reads: the ground truth of `moe-l2 verify`.

        For GGUF models: the numpy conversion of the raw slices (moe_l2.model.gguf.transcode_reference).
        UnreadableRecord when the files no longer hold it."""
        self._check(layer, expert)
        try:
            return self.reader.read_record(layer, expert)
        except OSError as exc:
            raise self._unreadable(layer, [expert], exc) from None

    def _unreadable(self, layer: int, experts: list[int], exc: OSError, fds=None) -> UnreadableRecord:
        """The error of a read of these experts that failed: the ones whose bytes lie past their file's end now
        (a file truncated since it was opened), else all of them (an I/O error)."""
        try:
            sizes = [os.fstat(fd).st_size for fd in fds] if fds else [os.stat(f).st_size for f in self.files]
            short = [e for e in experts
                     if any(offset + n > sizes[f] for f, offset, n in self.reader.file_ranges(layer, e))]
        except OSError:
            short = []
        named = short or experts
        files = sorted({f for e in named for f in self.record_files(layer, e)})
        return UnreadableRecord(self.path, layer, named, files, exc)

    def record_files(self, layer: int, expert: int) -> list[Path]:
        """The files that hold the record's bytes."""
        self._check(layer, expert)
        return self.reader.record_files(layer, expert)

    def check_record(self, layer: int, expert: int, checksum: int, source: str) -> None:
        """Raise CorruptRecord when the model has a checksum manifest that disagrees with checksum
        (record_checksum of the record as read from source, which the error names)."""
        if self.checksums is None:
            return
        expected = self.checksums.expected(layer, expert)
        if checksum != expected:
            raise CorruptRecord(self.path, layer, expert, self.record_files(layer, expert), expected, checksum,
                                source)

    # -- decoder layers (moe-l2d --layers) ----------------------------------------------------------

    @property
    def decoder_layers(self) -> int:
        """The model's decoder layers, MoE or dense, as mlx-lm's pipeline numbers them (model.layers.N)."""
        count = self.config.get("num_hidden_layers") or self.config.get(f"{self.model_type}.block_count")
        return int(count) if count else self.layer_ids[-1] + 1

    def moe_layers_in(self, ranges) -> tuple[int, ...]:
        """The MoE layer numbers of the decoder layers in `ranges` ((first, last) pairs, inclusive); dense
        layers in a range are skipped. A range past the model's decoder layers, or ranges without any MoE
        layer, raise ValueError naming the model's MoE layers."""
        moe = f"its MoE layers are decoder layers {format_ranges(self.layer_ids)}"
        for first, last in ranges:
            if last >= self.decoder_layers:
                raise ValueError(f"layers {first}-{last}: {self.path} has decoder layers 0-{self.decoder_layers - 1}"
                                 f"; {moe}")
        served = tuple(i for i, lid in enumerate(self.layer_ids) if any(a <= lid <= b for a, b in ranges))
        if not served:
            raise ValueError(f"layers {format_ranges_of(ranges)} hold no MoE layer of {self.path}: {moe}")
        return served

    # -- reading records the fast way (daemon loader, client pool) ---------------------------------

    @property
    def direct_default(self) -> bool:
        """Whether open_fds(direct=None) uses direct I/O: for packed models on Linux and macOS.

        A packed record is one large aligned read, which direct I/O serves at the disk's speed without
        copying it through the page cache, and keeps a model larger than RAM from evicting everything
        else's cache (see bench/bench_io.py and docs/formats.md). Piecewise (stacked, GGUF) reads stay buffered.
        """
        return self.reader.direct_default

    def open_fds(self, direct: Optional[bool] = None) -> list[int]:
        """Open every model file for reading; direct=True asks for direct I/O (O_DIRECT / F_NOCACHE),
        None picks direct_default. A filesystem without direct I/O gets buffered fds; see direct_fds()."""
        from moe_l2 import _native

        want = self.direct_default if direct is None else direct
        fds = []
        try:
            for path in self.files:
                fds.append(open_regular(path))
                if want and not _native.set_direct(fds[-1], True):
                    log.warning("%s: the filesystem has no direct I/O; reading it through the page cache", path)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    @staticmethod
    def direct_fds(fds: list[int]) -> bool:
        """Whether every fd reads with O_DIRECT (Linux; macOS' F_NOCACHE cannot be queried)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        import fcntl

        return all(fcntl.fcntl(fd, fcntl.F_GETFL) & flag for fd in fds)

    def read_into_slots(self, fds: list[int], layer: int, targets, *, threads: int = 1) -> None:
        """Read records of one layer into daemon slots, from fds (from open_fds), with the native reads.

        targets: [(expert, memory, offset, room)]: the whole record laid out at offset of memory (a
        Segment), with room bytes there (the slot stride). A packed record is one read of its padded
        extent; a GGUF record is read raw into host scratch memory and converted into the slot, so that
        L2 holds MLX's layout and the daemon never touches MLX's allocator."""
        for expert, *_ in targets:
            self._check(layer, expert)
        try:
            self.reader.read_into_slots(fds, layer, targets, threads)
        except OSError as exc:
            raise self._unreadable(layer, [expert for expert, *_ in targets], exc, fds) from None

    def read_into_rows(self, fds: list[int], layer: int, targets, *, threads: int = 1,
                       checksums: bool = False, landed: Landed | None = None) -> list[int] | None:
        """Read records of one layer into client pool rows, from fds (from open_fds), with the native reads.

        targets: [(expert, [(memory, offset), one per layout piece])]. A stacked record is read piece by
        piece, a packed one in one read scattered into the rows, a GGUF one converted on the way. With
        checksums: each record's record_checksum where the format computes it as it reads (packed), else None.
        landed: where the format reads record by record (packed), each record says so as it lands."""
        for expert, _ in targets:
            self._check(layer, expert)
        try:
            return self.reader.read_into_rows(fds, layer, targets, threads, checksums, landed)
        except OSError as exc:
            raise self._unreadable(layer, [expert for expert, _ in targets], exc, fds) from None

    # -- names -------------------------------------------------------------------------------------

    def expert_tensor_names(self) -> set[str]:
        """Every tensor name that belongs to a routed expert (stacked or per-expert; GGUF: blk.N.ffn_*_exps.*)."""
        return self.reader.expert_tensor_names()

    def tensor_names(self, layer: int) -> dict[str, dict[Optional[int], str]]:
        """Safetensors models: key -> {expert, or None for a stacked tensor: checkpoint tensor name}."""
        return self.reader.tensor_names(layer)

    def __repr__(self) -> str:
        return (
            f"ModelFiles({str(self.path)!r}, {self.format}, {self.model_type}, {self.n_layers} MoE layers, "
            f"{self.n_experts} experts, top {self.top_k}, record {self.layout.nbytes} bytes)"
        )
