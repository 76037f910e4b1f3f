"""mlx-lm safetensors checkpoints: experts stacked (``switch_mlp.gate_proj.weight`` of shape ``(E, ...)``)
or one tensor per expert; a record is read piece by piece (docs/formats.md).

The headers are parsed by hand (no tensor data is read), so that the daemon and the client compute the
same layout and can pread records straight into place. ``read_checkpoint`` parses a model directory;
``SafetensorsReader`` reads its records, and ``moe_l2.model.packed`` reads a packed one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_l2.model.records import RecordLayout, RecordReader, hash_part, pread_plain

__all__ = ["INDEX_NAME", "DTYPES", "Tensor", "Header", "read_header", "Checkpoint", "read_checkpoint",
           "SafetensorsReader"]

INDEX_NAME = "model.safetensors.index.json"
# safetensors' own reader refuses larger headers.
_MAX_HEADER = 100_000_000

# safetensors dtype -> (name of the mlx.core dtype, bytes per element)
DTYPES = {
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


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors header."""

    file: int  # index of its file in the checkpoint
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: the raw JSON, its tensors, and the file's size and mtime."""

    raw: bytes
    tensors: dict[str, Tensor]
    size: int
    mtime_ns: int
    metadata: dict


def read_header(path: Path, file_index: int) -> Header:
    """Parse and check the header of the safetensors file path (the checkpoint's file number file_index)."""
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
        if dtype in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype][1]:
            raise ValueError(
                f"{path}: tensor {name!r} spans {end - begin} bytes, but {dtype} {list(shape)} needs "
                f"{math.prod(shape) * DTYPES[dtype][1]}"
            )
        data_end = max(data_end, end)
        tensors[name] = Tensor(file_index, dtype, shape, data_start + begin, end - begin)
    if data_start + data_end > st.st_size:
        raise ValueError(
            f"{path}: truncated safetensors file (tensor data ends at byte {data_start + data_end}, "
            f"file has {st.st_size})"
        )
    return Header(raw, tensors, st.st_size, st.st_mtime_ns, metadata)


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
        if dtype not in DTYPES:
            raise ValueError(f"{path}: layer {lid} {key} has dtype {dtype}, which mlx cannot hold")
        specs.append((key, tuple(shape), DTYPES[dtype][0], step))
    return specs, where


@dataclass(frozen=True)
class Checkpoint:
    """What the headers, the index and config.json of an mlx-lm checkpoint say (no tensor data read)."""

    path: Path
    files: list[Path]
    headers: list[Header]
    config: dict
    config_bytes: bytes
    layer_ids: list[int]
    n_experts: int
    top_k: int
    layout: RecordLayout  # format "safetensors"
    # per MoE layer: key -> [(file index, file offset)] for experts 0..E-1
    places: list[dict[str, list[tuple[int, int]]]]
    # per MoE layer: key -> {expert or None: tensor name}
    names: list[dict[str, dict[Optional[int], str]]]


def read_checkpoint(path: Path, config_path: Optional[Path] = None) -> Checkpoint:
    """Parse and check an mlx-lm model directory: its MoE layers, expert count and one record layout.

    config_path: the config.json to use (the packer's, before the packed copy has its own)."""
    if not path.is_dir():
        raise ValueError(f"{path}: not a model directory")
    config_path = config_path or path / "config.json"
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

    files, weight_map = _find_files(path)
    headers = [read_header(f, i) for i, f in enumerate(files)]
    tensors: dict[str, Tensor] = {}
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
    found: dict[int, dict[str, dict[Optional[int], Tensor]]] = {}
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
    places = []
    layout = None
    for lid in layer_ids:
        specs, where = _layer_pieces(path, lid, found[lid], n_experts, files)
        this = RecordLayout.build(specs)
        if layout is None:
            layout, first = this, lid
        elif this != layout:
            raise ValueError(
                f"{path}: MoE layer {lid} has expert tensors {sorted(specs)} unlike layer {first} "
                f"{[(p.key, p.shape, p.dtype, p.nbytes) for p in layout.pieces]}; one record layout is needed"
            )
        places.append(where)
    return Checkpoint(path, files, headers, config, config_bytes, layer_ids, n_experts, top_k, layout, places,
                      [names[lid] for lid in layer_ids])


class SafetensorsReader(RecordReader):
    """An mlx-lm checkpoint's records, read piece by piece (one pread per piece)."""

    def __init__(self, checkpoint: Checkpoint, layout: Optional[RecordLayout] = None):
        """layout: the checkpoint's, or the same pieces under another format (a packed checkpoint)."""
        ck = checkpoint
        self.path = ck.path
        self.files = ck.files
        self.config = ck.config
        self.model_type = str(ck.config.get("model_type") or (ck.config.get("text_config") or {}).get("model_type")
                              or "")
        self.layer_ids = ck.layer_ids
        self.n_experts = ck.n_experts
        self.top_k = ck.top_k
        self.layout = layout or ck.layout
        self.quantization = {}
        self._places = ck.places
        self._names = ck.names
        self._expert_names = frozenset(n for d in ck.names for slots in d.values() for n in slots.values())

        h = hashlib.sha256()
        hash_part(h, json.dumps(self.layout.describe(), sort_keys=True).encode())
        if self.layout.format != "safetensors":
            hash_part(h, f"format={self.layout.format}".encode())
        hash_part(h, ck.config_bytes)
        for f, hd in zip(ck.files, ck.headers):
            hash_part(h, json.dumps([f.name, hd.size, hd.mtime_ns]).encode())
            hash_part(h, hd.raw)
        self.fingerprint = h.hexdigest()[:32]

    def extents(self, layer: int, expert: int) -> list[tuple[int, int, int, int]]:
        where = self._places[layer]
        return [(*where[p.key][expert], p.nbytes, p.offset) for p in self.layout.pieces]

    def read_record(self, layer: int, expert: int) -> bytes:
        buf = bytearray(self.layout.nbytes)
        for file_index, offset, nbytes, record_offset in self.extents(layer, expert):
            buf[record_offset : record_offset + nbytes] = pread_plain(self.files[file_index], offset, nbytes)
        return bytes(buf)

    def read_into_slots(self, fds: list[int], layer: int, targets: list[tuple], threads: int) -> None:
        from moe_l2 import _native

        jobs = [(fds[f], off, n, memory, base + rec_off)
                for expert, memory, base, _ in targets for f, off, n, rec_off in self.extents(layer, expert)]
        _native.pread_records(jobs, threads=threads)

    def read_into_rows(self, fds: list[int], layer: int, targets: list[tuple], threads: int) -> None:
        from moe_l2 import _native

        jobs = [(fds[f], off, n, mem, dst_off) for expert, rows in targets
                for (f, off, n, _), (mem, dst_off) in zip(self.extents(layer, expert), rows)]
        _native.pread_records(jobs, threads=threads)

    def expert_tensor_names(self) -> set[str]:
        return set(self._expert_names)

    def tensor_names(self, layer: int) -> dict[str, dict[Optional[int], str]]:
        return {k: dict(v) for k, v in self._names[layer].items()}
