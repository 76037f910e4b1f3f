"""Read a MoE model as per-expert records: mlx-lm safetensors (stacked, per expert, or packed) and GGUF.

Every routed expert of every MoE layer is one record: its tensors (the
switch-layer pieces ``gate_proj.weight``, ``gate_proj.scales``, ...) at fixed,
64-byte aligned offsets. This module finds where each piece of each record
lies in the model's files, from the headers alone (safetensors parsed by hand,
GGUF by the gguf package; no tensor data is read), so that the daemon and the
client compute the same layout and can pread records straight into place.

Formats (``ModelFiles.format``, also ``layout.format`` and part of the fingerprint):
- ``safetensors``: an mlx-lm checkpoint, experts stacked or one tensor per expert; a record is
  read piece by piece.
- ``packed``: written by ``moe-l2 pack`` (moe_l2/pack.py): per-expert tensors laid out
  expert-major, each record one contiguous extent at a page-aligned file offset, with its pieces
  at their record offsets. A record is one read (``record_span``), direct I/O friendly.
- ``gguf``: llama.cpp files (moe_l2/gguf.py); records are transcoded into MLX's layout.

``open_fds`` opens the files for reading (optionally with direct I/O), ``read_records`` reads
records into memory the way the format wants; both the daemon and the client use them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["ALIGN", "PACK_ALIGN", "PACK_MARKER", "Piece", "RecordLayout", "ModelFiles", "FORMATS"]

ALIGN = 64
# Packed records start at multiples of this many bytes (the direct-I/O block: 512 and 4096 divide it).
PACK_ALIGN = 4096
# __metadata__["moe_l2"] of the safetensors files `moe-l2 pack` writes.
PACK_MARKER = "packed-v1"
FORMATS = ("safetensors", "packed", "gguf")
_SCATTER_BYTES = 128 << 20
log = logging.getLogger("moe-l2.model")
INDEX_NAME = "model.safetensors.index.json"
# safetensors' own reader refuses larger headers.
_MAX_HEADER = 100_000_000

# safetensors dtype -> (name of the mlx.core dtype, bytes per element)
_DTYPES = {
    "BOOL": ("bool_", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
}

# Per-expert projection names that mlx-lm's sanitize renames when it stacks (mixtral-style).
_PROJ_ALIASES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_SWITCH_NAMES = ("switch_mlp", "experts")

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_k", "top_k")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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

    def describe(self) -> list:
        return [
            {"key": p.key, "offset": p.offset, "nbytes": p.nbytes, "shape": list(p.shape), "dtype": p.dtype}
            for p in self.pieces
        ]


@dataclass(frozen=True)
class _Tensor:
    file: int
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


@dataclass(frozen=True)
class _Header:
    raw: bytes
    tensors: dict[str, _Tensor]
    size: int
    mtime_ns: int
    metadata: dict


def _read_header(path: Path, file_index: int) -> _Header:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated safetensors file ({st.st_size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen < 2 or hlen > _MAX_HEADER:
                raise ValueError(f"{path}: not a safetensors file (header length {hlen})")
            if 8 + hlen > st.st_size:
                raise ValueError(
                    f"{path}: truncated safetensors file (header of {hlen} bytes, file has {st.st_size})"
                )
            raw = f.read(hlen)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")

    data_start = 8 + hlen
    data_end = 0
    tensors = {}
    metadata = meta.get("__metadata__") if isinstance(meta.get("__metadata__"), dict) else {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            ok = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {info!r}")
        if dtype in _DTYPES and end - begin != math.prod(shape) * _DTYPES[dtype][1]:
            raise ValueError(
                f"{path}: tensor {name!r} spans {end - begin} bytes, but {dtype} {list(shape)} needs "
                f"{math.prod(shape) * _DTYPES[dtype][1]}"
            )
        data_end = max(data_end, end)
        tensors[name] = _Tensor(file_index, dtype, shape, data_start + begin, end - begin)
    if data_start + data_end > st.st_size:
        raise ValueError(
            f"{path}: truncated safetensors file (tensor data ends at byte {data_start + data_end}, "
            f"file has {st.st_size})"
        )
    return _Header(raw, tensors, st.st_size, st.st_mtime_ns, metadata)


def _parse_expert_name(name: str) -> Optional[tuple[int, Optional[int], str]]:
    """(layer, expert or None for stacked, piece key) for a routed-expert tensor name, else None.

    Stacked: ``...layers.L.<...>.switch_mlp.<proj>.<param>`` (gpt_oss: ``...experts.<proj>.<param>``).
    Per expert: ``...layers.L.<...>.experts.N.<proj>.<param>``, proj normalised as mlx-lm's sanitize does.
    """
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            break
    else:
        return None
    layer = int(parts[i + 1])
    for j in range(i + 2, len(parts)):
        if parts[j] not in _SWITCH_NAMES:
            continue
        rest = parts[j + 1 :]
        if len(rest) == 3 and rest[0].isdigit() and parts[j] == "experts":
            return layer, int(rest[0]), f"{_PROJ_ALIASES.get(rest[1], rest[1])}.{rest[2]}"
        if len(rest) == 2 and not rest[0].isdigit():
            return layer, None, f"{rest[0]}.{rest[1]}"
    return None


def _config_int(config: dict, keys: tuple[str, ...]) -> Optional[int]:
    # Multimodal configs keep the language model's settings under text_config.
    for scope in (config, config.get("text_config") or {}):
        for k in keys:
            v = scope.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _hash_part(h, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


# The --direct-io choices of the daemon and the clients, as open_fds(direct=...) takes them.
DIRECT_IO = {"auto": None, "on": True, "off": False}


class ModelFiles:
    """A MoE model's files, config, MoE layers and expert records (safetensors, packed or GGUF).

    Layer arguments of extents()/read_record()/read_records() are MoE-layer numbers 0..n_layers-1;
    layer_ids maps them to the model's layer index.
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
    format: str
    # GGUF: projection -> {"group_size", "bits", "mode"} of its MLX quantization; {} otherwise
    # (safetensors checkpoints say it in config["quantization"]).
    quantization: dict

    def __init__(self, *args, **kwargs):
        raise TypeError("use ModelFiles.open(path)")

    @classmethod
    def open(cls, path) -> "ModelFiles":
        """Open a model directory (mlx-lm safetensors, packed, or holding one GGUF model) or a .gguf file."""
        self = object.__new__(cls)
        path = Path(path)
        self._tls = threading.local()
        self.quantization = {}
        self._gguf = None
        if cls._is_gguf(path):
            self._load_gguf(path)
        else:
            self._load(path)
        # The fingerprint names the real paths of the model's files too: a copy elsewhere (another user's, with
        # the same names, sizes and mtimes but other bytes) is another model (docs/security.md).
        h = hashlib.sha256(self.fingerprint.encode())
        for f in self.files:
            _hash_part(h, os.fsencode(os.path.realpath(f)))
        self.fingerprint = h.hexdigest()[:32]
        return self

    @staticmethod
    def _is_gguf(path: Path) -> bool:
        if path.is_file():
            return path.suffix == ".gguf"
        return path.is_dir() and not any(path.glob("*.safetensors")) and any(path.glob("*.gguf"))

    def _load(self, path: Path) -> None:
        if not path.is_dir():
            raise ValueError(f"{path}: not a model directory")
        config_path = path / "config.json"
        try:
            config_bytes = config_path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{path}: no config.json (not an mlx-lm model directory?)") from None
        try:
            config = json.loads(config_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_path}: not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: not a JSON object")

        files, weight_map = self._find_files(path)
        headers = [_read_header(f, i) for i, f in enumerate(files)]
        tensors: dict[str, _Tensor] = {}
        for f, h in zip(files, headers):
            for name, t in h.tensors.items():
                if name in tensors:
                    other = files[tensors[name].file].name
                    raise ValueError(f"{path}: tensor {name!r} is in both {other} and {f.name}")
                tensors[name] = t
        for name, fname in (weight_map or {}).items():
            t = tensors.get(name)
            if t is None or files[t.file].name != fname:
                raise ValueError(f"{path / INDEX_NAME}: names tensor {name!r} in {fname}, which does not hold it")

        # layer id -> key -> {expert or None: tensor}
        found: dict[int, dict[str, dict[Optional[int], _Tensor]]] = {}
        names: dict[int, dict[str, dict[Optional[int], str]]] = {}
        for name, t in tensors.items():
            parsed = _parse_expert_name(name)
            if parsed is None:
                continue
            layer, expert, key = parsed
            slots = found.setdefault(layer, {}).setdefault(key, {})
            if expert in slots or (expert is None and slots) or (expert is not None and None in slots):
                raise ValueError(f"{path}: layer {layer} holds {key} of an expert twice (stacked and per-expert?)")
            slots[expert] = t
            names.setdefault(layer, {}).setdefault(key, {})[expert] = name
        if not found:
            raise ValueError(
                f"{path}: no routed-expert tensors (model.layers.N.*.switch_mlp.* or *.experts.N.*): not a MoE model"
            )

        n_experts = _config_int(config, _EXPERT_COUNT_KEYS)
        if n_experts is None:
            raise ValueError(f"{config_path}: names no expert count (looked for {', '.join(_EXPERT_COUNT_KEYS)})")
        top_k = _config_int(config, _TOP_K_KEYS)
        if top_k is None:
            raise ValueError(f"{config_path}: names no experts per token (looked for {', '.join(_TOP_K_KEYS)})")
        if top_k > n_experts:
            raise ValueError(f"{config_path}: {top_k} experts per token but only {n_experts} experts")

        layer_ids = sorted(found)
        # per MoE layer: key -> [(file index, file offset)] for experts 0..E-1
        places: list[dict[str, list[tuple[int, int]]]] = []
        layout = None
        for lid in layer_ids:
            specs, where = self._layer_pieces(path, lid, found[lid], n_experts, files)
            this = RecordLayout.build(specs)
            if layout is None:
                layout, first = this, lid
            elif this != layout:
                raise ValueError(
                    f"{path}: MoE layer {lid} has expert tensors {sorted(specs)} unlike layer {first} "
                    f"{[(p.key, p.shape, p.dtype, p.nbytes) for p in layout.pieces]}; one record layout is needed"
                )
            places.append(where)

        marked = [f.name for f, h in zip(files, headers) if h.metadata.get("moe_l2") == PACK_MARKER]
        starts = self._packed_starts(layout, places, [h.size for h in headers])
        if marked and isinstance(starts, str):
            raise ValueError(f"{path}: {marked[0]} says it was written by moe-l2 pack, but {starts}: "
                             "damaged or edited; pack the model again")
        if not isinstance(starts, str):
            layout = RecordLayout(layout.pieces, layout.nbytes, "packed")

        h = hashlib.sha256()
        _hash_part(h, json.dumps(layout.describe(), sort_keys=True).encode())
        if layout.format != "safetensors":
            _hash_part(h, f"format={layout.format}".encode())
        _hash_part(h, config_bytes)
        for f, hd in zip(files, headers):
            _hash_part(h, json.dumps([f.name, hd.size, hd.mtime_ns]).encode())
            _hash_part(h, hd.raw)

        self.path = path
        self.files = files
        self.config = config
        self.model_type = str(config.get("model_type") or (config.get("text_config") or {}).get("model_type") or "")
        self.n_layers = len(layer_ids)
        self.layer_ids = layer_ids
        self.n_experts = n_experts
        self.top_k = top_k
        self.layout = layout
        self.format = layout.format
        self.fingerprint = h.hexdigest()[:32]
        self._places = places
        self._starts = None if isinstance(starts, str) else starts
        self._names = [names[lid] for lid in layer_ids]
        self._expert_names = frozenset(n for d in names.values() for slots in d.values() for n in slots.values())

    def _load_gguf(self, path: Path) -> None:
        from moe_l2 import gguf

        g = gguf.parse(path)
        layout = RecordLayout.build(g.specs, "gguf")
        h = hashlib.sha256()
        _hash_part(h, json.dumps(layout.describe(), sort_keys=True).encode())
        _hash_part(h, b"format=gguf")
        _hash_part(h, json.dumps([[(s.key, s.type, s.rows, s.cols) for s in ls] for ls in g.sources]).encode())
        for part in g.fingerprint_parts:
            _hash_part(h, part)
        self.path = path
        self.files = g.files
        self.config = {k: v for k, v in g.metadata.items() if v is not None}
        self.model_type = g.arch
        self.n_layers = len(g.layer_ids)
        self.layer_ids = g.layer_ids
        self.n_experts = g.n_experts
        self.top_k = g.top_k
        self.layout = layout
        self.format = "gguf"
        self.fingerprint = h.hexdigest()[:32]
        self.quantization = g.quantization
        self._gguf = g
        self._places = None
        self._starts = None
        self._names = None
        self._expert_names = g.tensor_names

    @staticmethod
    def _packed_starts(layout: RecordLayout, places, sizes) -> list[list[tuple[int, int]]] | str:
        """Per layer, per expert (file, start) if every record is one page-aligned extent with its pieces at
        their record offsets (a packed model); else a description of the first record that is not."""
        starts = []
        for layer, where in enumerate(places):
            row = []
            for e in range(len(next(iter(where.values())))):
                first = layout.pieces[0]
                f, off = where[first.key][e]
                base = off - first.offset
                for p in layout.pieces:
                    if where[p.key][e] != (f, base + p.offset):
                        return f"MoE layer {layer} expert {e}: {p.key} is not at its record offset"
                if base % PACK_ALIGN:
                    return f"MoE layer {layer} expert {e}: the record starts at byte {base}, not page-aligned"
                if base + layout.span > sizes[f]:
                    return f"MoE layer {layer} expert {e}: the file ends inside the record's padded extent"
                row.append((f, base))
            starts.append(row)
        return starts

    @staticmethod
    def _find_files(path: Path) -> tuple[list[Path], Optional[dict]]:
        index_path = path / INDEX_NAME
        if index_path.exists():
            try:
                index = json.loads(index_path.read_bytes())
                weight_map = index["weight_map"]
                names = sorted(set(weight_map.values()))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{index_path}: not a safetensors index (needs a weight_map): {e}") from e
            files = [path / n for n in names]
            for f in files:
                if not f.is_file():
                    raise ValueError(f"{index_path}: names shard {f.name}, which is missing")
            if not files:
                raise ValueError(f"{index_path}: the weight_map is empty")
            return files, weight_map
        files = sorted(path.glob("model*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no model*.safetensors files")
        return files, None

    @staticmethod
    def _layer_pieces(path, lid, keys, n_experts, files):
        specs = []
        where = {}
        for key, slots in keys.items():
            if None in slots:
                t = slots[None]
                if not t.shape or t.shape[0] != n_experts:
                    raise ValueError(
                        f"{files[t.file]}: layer {lid} {key} has shape {list(t.shape)}, but config.json says "
                        f"{n_experts} experts"
                    )
                step = t.nbytes // n_experts
                shape, dtype = t.shape[1:], t.dtype
                where[key] = [(t.file, t.start + e * step) for e in range(n_experts)]
            else:
                if sorted(slots) != list(range(n_experts)):
                    raise ValueError(
                        f"{path}: layer {lid} {key} has experts {sorted(slots)[:8]}... ({len(slots)} of them), "
                        f"but config.json says {n_experts} experts"
                    )
                first = slots[0]
                for e, t in slots.items():
                    if (t.shape, t.dtype) != (first.shape, first.dtype):
                        raise ValueError(
                            f"{path}: layer {lid} {key}: expert {e} is {t.dtype} {list(t.shape)}, "
                            f"expert 0 is {first.dtype} {list(first.shape)}"
                        )
                step, shape, dtype = first.nbytes, first.shape, first.dtype
                where[key] = [(slots[e].file, slots[e].start) for e in range(n_experts)]
            if dtype not in _DTYPES:
                raise ValueError(f"{path}: layer {lid} {key} has dtype {dtype}, which mlx cannot hold")
            specs.append((key, tuple(shape), _DTYPES[dtype][0], step))
        return specs, where

    def _check(self, layer: int, expert: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"MoE layer {layer} out of range (model has {self.n_layers})")
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"expert {expert} out of range (model has {self.n_experts})")

    def extents(self, layer: int, expert: int) -> list[tuple[int, int, int, int]]:
        """(file index, file offset, nbytes, record offset) of each piece of the record, in record order.

        Safetensors and packed models only: GGUF records are transcoded, not copied (see read_records)."""
        self._check(layer, expert)
        if self._gguf is not None:
            raise ValueError(f"{self.path}: GGUF records are converted to MLX's layout, not copied from the file; "
                             "use read_records() or read_record()")
        where = self._places[layer]
        return [(*where[p.key][expert], p.nbytes, p.offset) for p in self.layout.pieces]

    def record_span(self, layer: int, expert: int) -> tuple[int, int, int]:
        """Packed models: (file index, file offset, span) of the record's one extent. The offset is a
        multiple of PACK_ALIGN and the span is the record rounded up to it (the padding is in the file)."""
        self._check(layer, expert)
        if self._starts is None:
            raise ValueError(f"{self.path}: a {self.format} model's records are not single extents; "
                             "`moe-l2 pack` it first")
        f, start = self._starts[layer][expert]
        return f, start, self.layout.span

    def read_record(self, layer: int, expert: int) -> bytes:
        """The record's bytes (padding zero), read with plain file reads: the ground truth of `moe-l2 verify`.

        For GGUF models: the numpy conversion of the raw slices (moe_l2.gguf.transcode_reference)."""
        self._check(layer, expert)
        buf = bytearray(self.layout.nbytes)
        if self._gguf is not None:
            from moe_l2.gguf import transcode_reference

            for src in self._gguf.sources[layer]:
                data = self._pread_plain(src.file, src.start + expert * src.expert_bytes, src.expert_bytes)
                for key, piece in zip(src.piece_keys(), transcode_reference(src.type, data, src.rows, src.cols)):
                    p = self.layout.piece(key)
                    buf[p.offset:p.offset + p.nbytes] = piece
            return bytes(buf)
        for file_index, offset, nbytes, record_offset in self.extents(layer, expert):
            buf[record_offset : record_offset + nbytes] = self._pread_plain(file_index, offset, nbytes)
        return bytes(buf)

    def _pread_plain(self, file_index: int, offset: int, nbytes: int) -> bytes:
        with open(self.files[file_index], "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        if len(data) != nbytes:
            raise ValueError(f"{self.files[file_index]}: truncated model file (short read at {offset})")
        return data

    # -- reading records the fast way (daemon loader, client pool) ---------------------------------

    @property
    def direct_default(self) -> bool:
        """Whether open_fds(direct=None) uses direct I/O: for packed models on Linux and macOS.

        A packed record is one large aligned read, which direct I/O serves at the disk's speed without
        copying it through the page cache, and keeps a model larger than RAM from evicting everything
        else's cache (see bench/bench_io.py and docs/formats.md). Piecewise (stacked, GGUF) reads stay buffered.
        """
        return self.format == "packed" and sys.platform in ("linux", "darwin")

    def open_fds(self, direct: Optional[bool] = None) -> list[int]:
        """Open every model file for reading; direct=True asks for direct I/O (O_DIRECT / F_NOCACHE),
        None picks direct_default. A filesystem without direct I/O gets buffered fds; see direct_fds()."""
        from moe_l2 import _native

        want = self.direct_default if direct is None else direct
        fds = []
        try:
            for path in self.files:
                fds.append(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
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

    def read_records(self, fds: list[int], layer: int, targets, *, threads: int = 1) -> None:
        """Read records of one layer into memory, from fds (from open_fds), with the native reads.

        targets: [(expert, dst)], dst either (memory, offset, room): the whole record laid out at offset,
        with room bytes there (a daemon slot; a packed record is then one read of its span), or a list of
        (memory, offset), one per layout piece (the client's pool rows; a packed record is then one read
        scattered into them). GGUF records are read raw into scratch memory and converted into place.
        """
        from moe_l2 import _native

        for expert, _ in targets:
            self._check(layer, expert)
        if self._gguf is not None:
            self._read_gguf(fds, layer, targets, threads)
            return
        jobs = []
        scatter = []
        for expert, dst in targets:
            if isinstance(dst, tuple):
                memory, base, room = dst
                if self._starts is not None:
                    f, start = self._starts[layer][expert]
                    span = self.layout.span if room >= self.layout.span else self.layout.nbytes
                    jobs.append((fds[f], start, span, memory, base))
                else:
                    jobs += [(fds[f], off, n, memory, base + rec_off) for f, off, n, rec_off in self.extents(layer, expert)]
            elif self._starts is not None:
                f, start = self._starts[layer][expert]
                scatter.append((fds[f], start, self.layout.nbytes,
                                [(p.offset, p.nbytes, mem, off) for p, (mem, off) in zip(self.layout.pieces, dst)]))
            else:
                jobs += [(fds[f], off, n, mem, dst_off)
                         for (f, off, n, _), (mem, dst_off) in zip(self.extents(layer, expert), dst)]
        if jobs:
            _native.pread_records(jobs, threads=threads)
        # pread_scatter reads each batch into scratch memory first: at most _SCATTER_BYTES of it at a time
        per_call = max(1, _SCATTER_BYTES // self.layout.span)
        for i in range(0, len(scatter), per_call):
            _native.pread_scatter(scatter[i:i + per_call], threads=threads)

    def _scratch(self, nbytes: int):
        """Per-thread scratch memory for raw GGUF bytes, grown as needed."""
        from moe_l2 import _native

        buf = getattr(self._tls, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._tls.scratch = _native.Buffer(max(nbytes, 2 * buf.nbytes if buf is not None else 0))
        return buf

    def _read_gguf(self, fds, layer: int, targets, threads: int) -> None:
        from moe_l2 import _native

        g = self._gguf
        scratch = self._scratch(g.raw_nbytes * len(targets))
        index = {p.key: i for i, p in enumerate(self.layout.pieces)}
        reads, jobs = [], []
        for i, (expert, dst) in enumerate(targets):
            base = i * g.raw_nbytes
            if isinstance(dst, tuple):
                memory, rec, _ = dst
                place = [(memory, rec + p.offset) for p in self.layout.pieces]
            else:
                place = dst
            for src in g.sources[layer]:
                raw = base + src.raw_offset
                reads.append((fds[src.file], src.start + expert * src.expert_bytes, src.expert_bytes, scratch, raw))
                out = [place[index[k]] for k in src.piece_keys()]
                out += [out[0]] * (3 - len(out))  # float types write the weight only
                jobs.append((src.type, src.rows, src.cols, scratch, raw, *out[0], *out[1], *out[2]))
        _native.pread_records(reads, threads=threads)
        _native.transcode_gguf(jobs, threads=threads)

    # -- names -------------------------------------------------------------------------------------

    def expert_tensor_names(self) -> set[str]:
        """Every tensor name that belongs to a routed expert (stacked or per-expert; GGUF: blk.N.ffn_*_exps.*)."""
        return set(self._expert_names)

    def tensor_names(self, layer: int) -> dict[str, dict[Optional[int], str]]:
        """Safetensors models: key -> {expert, or None for a stacked tensor: checkpoint tensor name}."""
        if self._names is None:
            raise ValueError(f"{self.path}: a GGUF model has no safetensors names")
        return {k: dict(v) for k, v in self._names[layer].items()}

    def __repr__(self) -> str:
        return (
            f"ModelFiles({str(self.path)!r}, {self.format}, {self.model_type}, {self.n_layers} MoE layers, "
            f"{self.n_experts} experts, top {self.top_k}, record {self.layout.nbytes} bytes)"
        )
