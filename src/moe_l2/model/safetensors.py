"""mlx-lm safetensors checkpoints: experts stacked (``switch_mlp.gate_proj.weight`` of shape ``(E, ...)``)
or one tensor per expert; a record is read piece by piece (docs/formats.md).

Which tensors are experts, how many experts there are and how many a token uses come from the model
mlx-lm builds for config.json (``moe_l2.model.architecture``), not from tensor names or config keys.

The headers are parsed by hand (no tensor data is read), so that the daemon and the client compute the
same layout and can pread records straight into place. ``read_checkpoint`` parses a model directory;
``SafetensorsReader`` reads its records, and ``moe_l2.model.packed`` reads a packed one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_l2.model.architecture import SwitchLayer, decoder_layer, switch_layers
from moe_l2.model.bounds import (MAX_CONFIG_BYTES, MAX_HEADER_BYTES, MAX_INDEX_BYTES, Extent, check_config,
                                 check_extents, open_regular, parse_json, read_regular)
from moe_l2.model.records import Landed, RecordLayout, RecordReader, hash_part, pread_plain

__all__ = ["INDEX_NAME", "DTYPES", "Tensor", "Header", "read_header", "Checkpoint", "read_checkpoint",
           "SafetensorsReader"]

INDEX_NAME = "model.safetensors.index.json"

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
# "<parent>.experts.<N>.<projection>": one expert's tensors, as mlx-lm's sanitize functions stack them.
_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.([^.]+)$")


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
    """Parse and check the header of the safetensors file path (the checkpoint's file number file_index): a
    regular file, a bounded JSON header, every tensor's bytes inside the file and apart (src/moe_l2/model/bounds.py)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated safetensors file ({st.st_size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen < 2 or hlen > MAX_HEADER_BYTES:
                raise ValueError(f"{path}: not a safetensors file (header length {hlen})")
            if 8 + hlen > st.st_size:
                raise ValueError(
                    f"{path}: truncated safetensors file (header of {hlen} bytes, file has {st.st_size})"
                )
            raw = f.read(hlen)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from e
    meta = parse_json(raw, path, "a safetensors file (its header)")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")

    data_start = 8 + hlen
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
        tensors[name] = Tensor(file_index, dtype, shape, data_start + begin, end - begin)
    # safetensors itself asks for no alignment, and packed files leave padding between tensors (packed.py).
    check_extents(path, (Extent(n, t.start, t.nbytes) for n, t in tensors.items()), data_start, st.st_size)
    return Header(raw, tensors, st.st_size, st.st_mtime_ns, metadata)


def _expert_tensors(path: Path, tensors: dict[str, Tensor],
                    switches: list[SwitchLayer]) -> dict[str, dict[str, dict[Optional[int], tuple[str, Tensor]]]]:
    """switch path -> piece key -> {expert, or None for stacked: (tensor name, Tensor)}.

    A switch layer at P (``...mlp.switch_mlp``) holds its experts stacked, as mlx-lm saves them
    (``P.gate_proj.weight``, shape (E, ...)), or one tensor per expert beside it, as its ``sanitize``
    stacks them (``<parent of P>.experts.N.gate_proj.weight``; mixtral: ``w1``/``w2``/``w3``)."""
    by_path = {s.path: s for s in switches}
    parents = {s.path.rpartition(".")[0]: s for s in switches}
    found: dict[str, dict[str, dict[Optional[int], tuple]]] = {}
    for name, t in tensors.items():
        stem, _, param = name.rpartition(".")
        owner, _, proj = stem.rpartition(".")
        expert = None
        if owner in by_path:
            switch = by_path[owner]
        else:
            match = _PER_EXPERT.match(stem)
            switch = parents.get(match.group(1)) if match else None
            if switch is None:
                continue
            expert, proj = int(match.group(2)), match.group(3)
            proj = proj if proj in switch.projections else _PROJ_ALIASES.get(proj, proj)
        if proj not in switch.projections:
            continue
        key = f"{proj}.{param}"
        slots = found.setdefault(switch.path, {}).setdefault(key, {})
        if expert in slots or (expert is None and slots) or (expert is not None and None in slots):
            raise ValueError(f"{path}: layer {switch.layer} holds {key} of an expert twice (stacked and per-expert?)")
        slots[expert] = (name, t)
    return found


def _find_files(path: Path) -> tuple[list[Path], Optional[dict]]:
    index_path = path / INDEX_NAME
    if index_path.exists():
        index = parse_json(read_regular(index_path, MAX_INDEX_BYTES, "a safetensors index"), index_path,
                           "a safetensors index")
        try:
            weight_map = index["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index_path}: not a safetensors index (needs a weight_map): {e}") from e
        for n in names:
            if not isinstance(n, str) or Path(n).name != n or n in (".", ".."):
                raise ValueError(f"{index_path}: names shard {n!r}, which is not a file name in {path}")
        files = [path / n for n in names]
        for f in files:
            if not f.exists():
                raise ValueError(f"{index_path}: names shard {f.name}, which is missing")
        if not files:
            raise ValueError(f"{index_path}: the weight_map is empty")
        return files, weight_map
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no model*.safetensors files")
    return files, None


def _check_config(config_path: Path, config: dict, tensors: dict[str, Tensor]) -> None:
    """config.json's layer and expert counts against what the tensors hold (bounds.check_config)."""
    layers = max((lid + 1 for name in tensors if (lid := decoder_layer(name)) is not None), default=0)
    experts = max([t.shape[0] for t in tensors.values() if len(t.shape) >= 3]
                  + [int(m.group(2)) + 1 for name in tensors if (m := _PER_EXPERT.match(name.rpartition(".")[0]))],
                  default=0)
    check_config(config_path, config, layers, experts)


def _check_rows(path: Path, switches: list[SwitchLayer], layout: RecordLayout) -> None:
    """Each projection's rows in the files are what mlx-lm's model for config.json has (hidden_size for
    down_proj, the experts' hidden size for the others): sizes the shape-only build took from config.json."""
    shapes = {p.key: p.shape for p in layout.pieces}
    for s in switches:
        for proj, rows in zip(s.projections, s.rows):
            shape = shapes.get(f"{proj}.weight")
            if shape and shape[0] != rows:
                raise ValueError(f"{path}: layer {s.layer} {proj}.weight has {shape[0]} rows, but mlx-lm's model for "
                                 f"config.json has {rows}: config.json does not belong to these files (damaged or "
                                 "edited?)")


def _layer_pieces(path, lid, keys, n_experts, files):
    specs = []
    where = {}
    for key, slots in keys.items():
        if None in slots:
            t = slots[None]
            if not t.shape or t.shape[0] != n_experts:
                raise ValueError(
                    f"{files[t.file]}: layer {lid} {key} has shape {list(t.shape)}, but mlx-lm's model for "
                    f"config.json has {n_experts} experts"
                )
            step = t.nbytes // n_experts
            shape, dtype = t.shape[1:], t.dtype
            where[key] = [(t.file, t.start + e * step) for e in range(n_experts)]
        else:
            if sorted(slots) != list(range(n_experts)):
                raise ValueError(
                    f"{path}: layer {lid} {key} has experts {sorted(slots)[:8]}... ({len(slots)} of them), "
                    f"but mlx-lm's model for config.json has {n_experts} experts"
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
        config_bytes = read_regular(config_path, MAX_CONFIG_BYTES, "a config.json")
    except FileNotFoundError:
        raise ValueError(f"{path}: no config.json (not an mlx-lm model directory?)") from None
    config = parse_json(config_bytes, config_path, "an mlx-lm config.json")
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

    _check_config(config_path, config, tensors)
    switches = switch_layers(config, len(tensors))
    arch = config.get("model_type")
    if not switches:
        raise ValueError(f"{path}: mlx-lm's {arch} model has no routed experts (no SwitchGLU / SwitchMLP runs in "
                         "its forward): not a MoE model")
    by_layer: dict[int, SwitchLayer] = {}
    for s in switches:
        if s.layer in by_layer:
            raise ValueError(f"{path}: mlx-lm's {arch} model has two switch layers in layer {s.layer} "
                             f"({by_layer[s.layer].path}, {s.path}); moe-l2 streams one per layer")
        by_layer[s.layer] = s
    counts = {s.n_experts for s in switches}
    if len(counts) != 1:
        raise ValueError(f"{path}: mlx-lm's {arch} model has switch layers with {sorted(counts)} experts; "
                         "moe-l2 needs one expert count for the whole model")
    n_experts = counts.pop()
    # Layers may route different numbers of experts per token (hunyuan): a token needs the most of them.
    top_k = max(s.top_k for s in switches)

    expert_tensors = _expert_tensors(path, tensors, switches)
    missing = [s for s in switches if s.path not in expert_tensors]
    if missing:
        example = f"{missing[0].path}.{missing[0].projections[0]}.weight"
        raise ValueError(
            f"{path}: no routed-expert tensors for {len(missing)} of the {len(switches)} switch layers mlx-lm "
            f"builds for {arch} (e.g. {example}, stacked, or per expert beside it); a checkpoint that mlx-lm "
            "converts at load time needs mlx_lm.convert first")
    found = {s.layer: {k: {e: t for e, (_, t) in v.items()} for k, v in expert_tensors[s.path].items()}
             for s in switches}
    names = {s.layer: {k: {e: n for e, (n, _) in v.items()} for k, v in expert_tensors[s.path].items()}
             for s in switches}

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
    _check_rows(path, switches, layout)
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

    def read_into_rows(self, fds: list[int], layer: int, targets: list[tuple], threads: int,
                       checksums: bool = False, landed: Landed | None = None) -> None:
        from moe_l2 import _native

        jobs = [(fds[f], off, n, mem, dst_off) for expert, rows in targets
                for (f, off, n, _), (mem, dst_off) in zip(self.extents(layer, expert), rows)]
        _native.pread_records(jobs, threads=threads)

    def expert_tensor_names(self) -> set[str]:
        return set(self._expert_names)

    def tensor_names(self, layer: int) -> dict[str, dict[Optional[int], str]]:
        return {k: dict(v) for k, v in self._names[layer].items()}
