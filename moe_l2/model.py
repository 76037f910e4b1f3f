"""Read an mlx-lm safetensors MoE checkpoint as per-expert records.

Every routed expert of every MoE layer is one record: its tensors (the
switch-layer pieces ``gate_proj.weight``, ``gate_proj.scales``, ...) at fixed,
64-byte aligned offsets. This module finds where each piece of each record
lies in the model's files, from the safetensors headers alone (parsed by hand,
no tensor data is read), so that the daemon and the client compute the same
layout and can pread records straight into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["ALIGN", "Piece", "RecordLayout", "ModelFiles"]

ALIGN = 64
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

    @classmethod
    def build(cls, specs: Iterable[tuple[str, tuple[int, ...], str, int]]) -> "RecordLayout":
        """Lay out (key, shape, dtype, nbytes) specs in key order, each piece 64-aligned."""
        pieces = []
        offset = 0
        for key, shape, dtype, nbytes in sorted(specs):
            pieces.append(Piece(key, offset, nbytes, tuple(shape), dtype))
            offset = _align(offset + nbytes)
        return cls(tuple(pieces), offset)

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
    return _Header(raw, tensors, st.st_size, st.st_mtime_ns)


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


class ModelFiles:
    """An mlx-lm safetensors MoE model: its files, config, MoE layers and expert records.

    Layer arguments of extents()/read_record() are MoE-layer numbers 0..n_layers-1;
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

    def __init__(self, *args, **kwargs):
        raise TypeError("use ModelFiles.open(path)")

    @classmethod
    def open(cls, path) -> "ModelFiles":
        self = object.__new__(cls)
        self._load(Path(path))
        return self

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
        expert_names = set()
        for name, t in tensors.items():
            parsed = _parse_expert_name(name)
            if parsed is None:
                continue
            layer, expert, key = parsed
            slots = found.setdefault(layer, {}).setdefault(key, {})
            if expert in slots or (expert is None and slots) or (expert is not None and None in slots):
                raise ValueError(f"{path}: layer {layer} holds {key} of an expert twice (stacked and per-expert?)")
            slots[expert] = t
            expert_names.add(name)
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

        h = hashlib.sha256()
        _hash_part(h, json.dumps(layout.describe(), sort_keys=True).encode())
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
        self.fingerprint = h.hexdigest()[:32]
        self._places = places
        self._expert_names = frozenset(expert_names)

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
        """(file index, file offset, nbytes, record offset) of each piece of the record, in record order."""
        self._check(layer, expert)
        where = self._places[layer]
        return [(*where[p.key][expert], p.nbytes, p.offset) for p in self.layout.pieces]

    def read_record(self, layer: int, expert: int) -> bytes:
        """The record's bytes (padding zero), read with plain file reads."""
        buf = bytearray(self.layout.nbytes)
        for file_index, offset, nbytes, record_offset in self.extents(layer, expert):
            with open(self.files[file_index], "rb") as f:
                f.seek(offset)
                data = f.read(nbytes)
            if len(data) != nbytes:
                raise ValueError(f"{self.files[file_index]}: truncated safetensors file (short read at {offset})")
            buf[record_offset : record_offset + nbytes] = data
        return bytes(buf)

    def expert_tensor_names(self) -> set[str]:
        """Every checkpoint tensor name that belongs to a routed expert (stacked or per-expert)."""
        return set(self._expert_names)

    def __repr__(self) -> str:
        return (
            f"ModelFiles({str(self.path)!r}, {self.model_type}, {self.n_layers} MoE layers, "
            f"{self.n_experts} experts, top {self.top_k}, record {self.layout.nbytes} bytes)"
        )
