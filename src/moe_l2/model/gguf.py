"""GGUF (llama.cpp) MoE models as expert records in MLX's own layout.

A GGUF MoE layer holds its routed experts stacked: ``blk.N.ffn_{gate,up,down}_exps.weight`` of
numpy shape ``(experts, rows, cols)`` (GGUF's ``ne`` reversed), one contiguous slice per expert,
and optionally ``blk.N.ffn_{gate,up,down}_exps.bias`` of shape ``(experts, rows)``. The record of an
expert holds the MLX form of those slices, under the names mlx-lm's switch layers use:

- F32, F16, BF16: ``gate_proj.weight`` of the same dtype and shape ``(rows, cols)`` (the bytes are
  already MLX's row-major layout). BF16 stays bfloat16: mx.load turns BF16 GGUF tensors into
  float16, which loses range, so the records keep the exact values instead.
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: MLX affine quantization with group size 32 (one GGUF block is one
  group): ``gate_proj.weight`` uint32 ``(rows, cols * bits / 32)``, ``gate_proj.scales`` and
  ``gate_proj.biases`` float16 ``(rows, cols / 32)``, byte for byte what ``mx.load`` gives for the
  types it reads (Q4_0, Q4_1, Q8_0). ``quantization[proj]`` names the bits for ``mx.gather_qmm``.
- MXFP4: MLX's ``mxfp4`` mode, the same e2m1 codes and e8m0 exponents: ``gate_proj.weight`` uint32
  ``(rows, cols / 8)``, ``gate_proj.scales`` uint8 ``(rows, cols / 32)``, no biases.

Every other type (the K-quants, the IQ types, ...) has no exact MLX form and is refused with an error
that names it. The conversion happens once per read: the daemon converts on the way into L2 (shared
memory holds MLX layout, so clients copy it as is), the client converts on its pread fallback path,
both with the native ``transcode_gguf``. ``transcode_reference`` is the numpy version, the ground
truth of ``ModelFiles.read_record`` and ``moe-l2 verify``.

``parse`` reads the headers with the gguf package; ``GGUFReader`` reads the records (docs/formats.md, "GGUF").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from moe_l2.model.bounds import Extent, check_extents, open_regular
from moe_l2.model.records import Landed, RecordLayout, RecordReader, hash_part, pread_plain

__all__ = ["SUPPORTED_TYPES", "GROUP_SIZE", "Source", "GGUFModel", "is_gguf", "parse", "piece_specs",
           "transcode_reference", "GGUFReader"]

# GGUF type -> (bits, block elements, block bytes, MLX quantization mode)
_QUANT = {"Q4_0": (4, 32, 18, "affine"), "Q4_1": (4, 32, 20, "affine"), "Q5_0": (5, 32, 22, "affine"),
          "Q5_1": (5, 32, 24, "affine"), "Q8_0": (8, 32, 34, "affine"), "MXFP4": (4, 32, 17, "mxfp4")}
_FLOAT = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}
SUPPORTED_TYPES = tuple(_FLOAT) + tuple(_QUANT)
GROUP_SIZE = 32

_PROJ = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_[a-z_]*exps)\.(weight|bias)$")
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_RAW_ALIGN = 64


def _align(n: int, to: int = _RAW_ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Source:
    """One GGUF tensor slice of a record: expert e's bytes are [start + e * expert_bytes, +expert_bytes)."""

    key: str  # "gate_proj.weight" or "gate_proj.bias"
    file: int
    start: int
    expert_bytes: int
    type: str
    rows: int
    cols: int
    raw_offset: int  # where this slice goes in the scratch memory of one expert's raw bytes

    @property
    def proj(self) -> str:
        return self.key.split(".")[0]

    def piece_keys(self) -> tuple[str, ...]:
        if self.type == "MXFP4":
            return (self.key, f"{self.proj}.scales")
        if self.type in _QUANT:
            return (self.key, f"{self.proj}.scales", f"{self.proj}.biases")
        return (self.key,)


def piece_specs(key: str, type_name: str, rows: int, cols: int, *, bias: bool) -> list[tuple]:
    """Record pieces (key, shape, dtype, nbytes) that a GGUF slice of rows x cols becomes."""
    proj = key.split(".")[0]
    shape = (cols,) if bias else (rows, cols)
    if type_name in _FLOAT:
        dtype, size = _FLOAT[type_name]
        return [(key, shape, dtype, rows * cols * size)]
    bits = _QUANT[type_name][0]
    groups = cols // GROUP_SIZE
    weight = (key, (rows, cols * bits // 32), "uint32", rows * cols * bits // 8)
    if type_name == "MXFP4":
        return [weight, (f"{proj}.scales", (rows, groups), "uint8", rows * groups)]
    return [
        weight,
        (f"{proj}.scales", (rows, groups), "float16", rows * groups * 2),
        (f"{proj}.biases", (rows, groups), "float16", rows * groups * 2),
    ]


def _raw_bytes(type_name: str, rows: int, cols: int) -> int:
    if type_name in _FLOAT:
        return rows * cols * _FLOAT[type_name][1]
    _, elems, block, _ = _QUANT[type_name]
    return rows * (cols // elems) * block


def _scaled(d: np.ndarray, by: float) -> np.ndarray:
    """d * by in float32, rounded to float16, as the native conversion computes a bias: an overflow gives
    infinity (as in mx.load), a NaN (a damaged scale) loses its payload (0x7e00, sign kept) where numpy would
    keep it, so that both agree on every byte whatever the file holds."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = (d.astype(np.float32) * by).astype(np.float16)
    bits = out.view(np.uint16).copy()
    nan = np.isnan(out)
    bits[nan] = (bits[nan] & 0x8000) | 0x7E00
    return bits.view(np.float16)


def transcode_reference(type_name: str, raw: bytes, rows: int, cols: int) -> list[bytes]:
    """numpy conversion of one slice to its record pieces' bytes (the order of piece_specs)."""
    if type_name in _FLOAT:
        return [bytes(raw)]
    bits, _, block, _ = _QUANT[type_name]
    b = np.frombuffer(raw, dtype=np.uint8).reshape(rows, cols // 32, block)

    def half(at: int) -> np.ndarray:
        return b[..., at:at + 2].copy().view(np.float16)[..., 0]

    def nibbles(qs: np.ndarray) -> np.ndarray:  # GGUF: weight i in byte i % 16, low nibble first
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    if type_name == "MXFP4":
        q, scales, biases = nibbles(b[..., 1:]), b[..., 0].copy(), None
    elif type_name == "Q8_0":
        d = half(0)
        q, scales, biases = b[..., 2:] ^ np.uint8(0x80), d, _scaled(d, -128)
    elif type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        qh = b[..., at:at + 4].copy().view("<u4")[..., 0]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = nibbles(b[..., at + 4:]) | (high << 4)
        d = half(0)
        scales, biases = d, (half(2) if type_name == "Q5_1" else _scaled(d, -16))
    else:
        d = half(0)
        q = nibbles(b[..., 4:] if type_name == "Q4_1" else b[..., 2:])
        scales, biases = d, (half(2) if type_name == "Q4_1" else _scaled(d, -8))
    q = q.reshape(rows, cols).astype(np.uint8)
    # MLX: a little-endian bit stream of `bits`-bit codes, packed into uint32 words
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows, cols * bits)
    packed = np.packbits(stream, axis=-1, bitorder="little")
    pieces = [packed.tobytes(), np.ascontiguousarray(scales).tobytes()]
    return pieces if biases is None else pieces + [np.ascontiguousarray(biases).tobytes()]


@dataclass
class GGUFModel:
    """What ModelFiles needs of a GGUF model, parsed from its headers alone."""

    files: list[Path]
    metadata: dict
    arch: str
    layer_ids: list[int]
    n_experts: int
    top_k: int
    sources: list[list[Source]]  # per MoE layer, in one key order
    specs: list[tuple]  # record piece specs
    raw_nbytes: int  # scratch bytes for one expert's raw slices
    quantization: dict  # proj -> {"group_size", "bits", "mode"} for quantized projections
    fingerprint_parts: list[bytes]
    tensor_names: frozenset


def _find_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise ValueError(f"{path}: no *.gguf file")
        stems = {m["stem"] if (m := _SPLIT_NAME.match(f.name)) else f.stem for f in files}
        if len(stems) > 1:
            raise ValueError(f"{path}: holds several GGUF models ({', '.join(sorted(f.name for f in files))}); "
                             "give the path of one .gguf file")
        first = files[0]
    elif path.exists():
        first = path
    else:
        raise ValueError(f"{path}: no such file or directory")
    m = _SPLIT_NAME.match(first.name)
    if m is None:
        return [first]
    count = int(m["count"])
    files = [first.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ValueError(f"{first}: split GGUF model lacks {', '.join(missing)}")
    return files


_LONG_ARRAY = 64
# Bounds on a GGUF header, far above real ones (DeepSeek-V3: 1025 tensors, about 50 keys, 129280 tokens), so
# that a damaged one cannot make the reader build Python objects without end (src/moe_l2/model/bounds.py).
_MAX_TENSORS = 1 << 16
_MAX_KEYS = 1 << 16
_MAX_ARRAY = 1 << 22
# Metadata values larger than this are not decoded (none that moe-l2 reads is): they are in the fingerprint
# through the header bytes.
_MAX_VALUE_BYTES = 1 << 20


def _reader_class():
    """gguf's GGUFReader, made to skip over long metadata arrays (token lists, merges) instead of building a
    numpy view per element, which takes GGUFReader seconds for a real vocabulary. Nothing here needs them:
    they are in the fingerprint through the header bytes. Arrays of arrays are refused, as llama.cpp does."""
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderTensor

    class LeanReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            """Names, types, shapes and offsets, without gguf's numpy view of each tensor's data: moe-l2 reads
            the data itself, and a view past the end of a damaged file fails in numpy's words where
            bounds.check_extents says which tensor lies where. Sizes in Python integers (numpy's wrap)."""
            self.tensors = []
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                ggml_type = GGMLQuantizationType(int(raw_type[0]))
                block, size = GGML_QUANT_SIZES[ggml_type]
                n = math.prod(int(d) for d in dims)
                self.tensors.append(ReaderTensor(name=str(bytes(name), encoding="utf-8"), tensor_type=ggml_type,
                                                 shape=dims, n_elements=n, n_bytes=n * size // block,
                                                 data_offset=start_offs + int(offset[0]), data=None, field=field))

        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            if item_type == GGUFValueType.ARRAY or count > _MAX_ARRAY:
                raise ValueError(f"metadata at byte {orig_offs} is an array of {count} "
                                 f"{'arrays' if item_type == GGUFValueType.ARRAY else 'items'}, which llama.cpp "
                                 "would not read either")
            scalar = self.gguf_scalar_to_np.get(item_type)
            if count <= _LONG_ARRAY or (scalar is None and item_type != GGUFValueType.STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs + 12
            if scalar is not None:
                offs += count * np.dtype(scalar).itemsize
            else:
                order = "<" if (self.byte_order == "I") == (sys.byteorder == "little") else ">"
                length = struct.Struct(order + "Q").unpack_from
                for _ in range(count):
                    offs += 8 + length(self.data, offs)[0]
            head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            return offs - orig_offs, head, [], [GGUFValueType.ARRAY, item_type]

    return LeanReader


def _scalar(field):
    from gguf import GGUFValueType

    # parts: key length, key, value type, then for arrays the item type and the count
    if field.types and field.types[0] == GGUFValueType.ARRAY and int(field.parts[4][0]) > _LONG_ARRAY:
        return None  # token lists and the like: in the fingerprint through the header bytes
    if sum(int(part.nbytes) for part in field.parts) > _MAX_VALUE_BYTES:
        return None
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - a field the installed gguf cannot decode is not needed here
        return None


def _int(metadata: dict, key: str) -> Optional[int]:
    v = metadata.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _read_header(reader_class, path: Path):
    """gguf's reader of path's header, and the stat of the file it mapped: opened as a regular file
    (bounds.open_regular), its counts bounded first."""
    with os.fdopen(open_regular(path), "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (no GGUF header)")
        # Version 3 reads 0x03000000 in the other byte order, whose counts are then big-endian.
        order = ">" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF == 0 else "<"
        n_tensors, n_keys = struct.unpack_from(order + "QQ", head, 8)
        if n_tensors > _MAX_TENSORS or n_keys > _MAX_KEYS:
            raise ValueError(f"{path}: not a GGUF file, or damaged: its header counts {n_tensors} tensors and "
                             f"{n_keys} metadata keys (at most {_MAX_TENSORS} and {_MAX_KEYS} are read)")
        try:
            reader = reader_class(f)
        except (ValueError, OSError, IndexError, KeyError, struct.error) as e:
            raise ValueError(f"{path}: not a GGUF file, or damaged ({e})") from e
        return reader, os.fstat(f.fileno())


@dataclass(frozen=True)
class _Tensor:
    """A tensor as its file's header describes it."""

    file: int  # index into the model's files
    type_name: str
    shape: tuple[int, ...]  # numpy's (GGUF's ne reversed)
    start: int  # absolute offset in its file
    nbytes: int


def parse(path) -> GGUFModel:
    """Read a GGUF model's headers (tensor data is not touched) with the gguf package."""
    try:
        reader_class = _reader_class()
    except ImportError as e:  # pragma: no cover - the dependency is declared
        raise ValueError(f"{path}: reading GGUF models needs the gguf package (pip install gguf)") from e
    path = Path(path)
    files = _find_files(path)
    metadata, tensors, parts = _read_headers(path, files, reader_class)
    arch, n_experts, top_k = _expert_counts(path, metadata)
    found = _expert_tensors(path, tensors)
    layer_ids = sorted(found)
    sources: list[list[Source]] = []
    specs = None
    quantization: dict = {}
    for lid in layer_ids:
        layer_sources, layer_specs, raw = [], [], 0
        for key in sorted(found[lid]):
            source = _source(files, found[lid][key], key, tensors[found[lid][key]], n_experts, raw)
            layer_sources.append(source)
            raw = _align(raw + source.expert_bytes)
            bias = key.endswith(".bias")
            layer_specs += piece_specs(key, source.type, source.rows, source.cols, bias=bias)
            if source.type in _QUANT and not bias:
                quantization[source.proj] = {"group_size": GROUP_SIZE, "bits": _QUANT[source.type][0],
                                             "mode": _QUANT[source.type][3]}
        described = {name: (tensors[name].type_name, list(tensors[name].shape)) for name in found[lid].values()}
        if specs is None:
            specs, first, first_described, raw_nbytes = layer_specs, lid, described, raw
        elif sorted(layer_specs) != sorted(specs):
            raise ValueError(
                f"{path}: MoE layer {lid} has expert tensors {described} unlike layer {first} {first_described} "
                "(types or shapes differ); moe-l2 needs one record layout for every layer"
            )
        sources.append(layer_sources)
    # One layer may have its quantized projection in another type than another: the layouts then differ
    # (checked above), so quantization is per projection and the same for every layer.
    return GGUFModel(
        files=files, metadata=metadata, arch=arch, layer_ids=layer_ids, n_experts=n_experts, top_k=top_k,
        sources=sources, specs=specs, raw_nbytes=raw_nbytes,
        quantization=quantization, fingerprint_parts=parts,
        tensor_names=frozenset(n for d in found.values() for n in d.values()),
    )


def _read_headers(path: Path, files: list[Path], reader_class) -> tuple[dict, dict[str, _Tensor], list[bytes]]:
    """The files' metadata (a key's value from the first file that has it), their tensors by name, and the
    parts of the model's fingerprint: each file's name, size and mtime and the hash of its header."""
    from gguf import GGMLQuantizationType

    metadata: dict = {}
    tensors: dict[str, _Tensor] = {}
    parts = []
    for i, f in enumerate(files):
        reader, st = _read_header(reader_class, f)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in metadata:
                continue
            metadata[key] = _scalar(field)
        for t in reader.tensors:
            if t.name in tensors:
                raise ValueError(f"{path}: tensor {t.name} is named twice")
            try:
                type_name = GGMLQuantizationType(int(t.tensor_type)).name
            except ValueError:
                type_name = f"type {int(t.tensor_type)}"
            shape = tuple(int(x) for x in reversed(list(t.shape)))
            tensors[t.name] = _Tensor(i, type_name, shape, t.data_offset, t.n_bytes)
        check_extents(f, [Extent(t.name, tensors[t.name].start, tensors[t.name].nbytes) for t in reader.tensors],
                      int(reader.data_offset), st.st_size, int(reader.alignment))
        parts.append(json.dumps([f.name, st.st_size, st.st_mtime_ns]).encode())
        parts.append(hashlib.sha256(reader.data[:int(reader.data_offset)]).digest())
        del reader
    return metadata, tensors, parts


def _expert_counts(path: Path, metadata: dict) -> tuple[str, int, int]:
    """The architecture, its experts per MoE layer and per token, from the metadata."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    n_experts = _int(metadata, f"{arch}.expert_count")
    if n_experts is None:
        raise ValueError(f"{path}: GGUF metadata names no {arch}.expert_count: not a MoE model?")
    top_k = _int(metadata, f"{arch}.expert_used_count")
    if top_k is None:
        raise ValueError(f"{path}: GGUF metadata names no {arch}.expert_used_count (experts per token)")
    if top_k > n_experts:
        raise ValueError(f"{path}: {top_k} experts per token but only {n_experts} experts")
    return arch, n_experts, top_k


def _expert_tensors(path: Path, tensors: dict[str, _Tensor]) -> dict[int, dict[str, str]]:
    """MoE layer id -> record key ("gate_proj.weight", ...) -> the routed-expert tensor's name."""
    found: dict[int, dict[str, str]] = {}
    for name in tensors:
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            continue
        kind = m.group(2)
        if kind not in _PROJ:
            raise ValueError(f"{path}: {name}: expert tensors {kind} are not supported "
                             f"(moe-l2 reads {', '.join(sorted(_PROJ))})")
        found.setdefault(int(m.group(1)), {})[f"{_PROJ[kind]}.{m.group(3)}"] = name
    if not found:
        raise ValueError(f"{path}: no routed-expert tensors (blk.N.ffn_{{gate,up,down}}_exps.weight): "
                         "not a MoE model")
    return found


def _source(files: list[Path], name: str, key: str, t: _Tensor, n_experts: int, raw_offset: int) -> Source:
    """The record's slice of the stacked expert tensor `name` (record key `key`), checked against the type, the
    shape and the size that MLX's layout and the metadata's expert count need."""
    bias = key.endswith(".bias")
    if t.type_name not in SUPPORTED_TYPES or (bias and t.type_name not in _FLOAT):
        allowed = ", ".join(_FLOAT) if bias else ", ".join(SUPPORTED_TYPES)
        raise ValueError(f"{files[t.file]}: {name} is {t.type_name}, which moe-l2 cannot convert to MLX's "
                         f"layout exactly (supported: {allowed})")
    want_dims = 2 if bias else 3
    if len(t.shape) != want_dims or t.shape[0] != n_experts:
        raise ValueError(f"{files[t.file]}: {name} has shape {list(t.shape)}, but the metadata says "
                         f"{n_experts} experts")
    rows, cols = (1, t.shape[1]) if bias else (t.shape[1], t.shape[2])
    if t.type_name in _QUANT and cols % GROUP_SIZE:
        raise ValueError(f"{files[t.file]}: {name} rows of {cols} are not whole blocks of {GROUP_SIZE}")
    expert_bytes = _raw_bytes(t.type_name, rows, cols)
    if expert_bytes * n_experts != t.nbytes:
        raise ValueError(f"{files[t.file]}: {name} ({t.type_name} {list(t.shape)}) spans {t.nbytes} bytes, "
                         f"expected {expert_bytes * n_experts}")
    return Source(key, t.file, t.start, expert_bytes, t.type_name, rows, cols, raw_offset)


def is_gguf(path: Path) -> bool:
    """Whether path names a GGUF model: a .gguf file, or a directory with .gguf files and no safetensors."""
    if not path.is_dir():
        return path.suffix == ".gguf"
    return not any(path.glob("*.safetensors")) and any(path.glob("*.gguf"))


class GGUFReader(RecordReader):
    """A GGUF model's records: each projection's raw slice read into host scratch memory, then converted
    into MLX's layout in place (native ``transcode_gguf``)."""

    def __init__(self, path: Path):
        g = parse(path)
        self.layout = RecordLayout.build(g.specs, "gguf")
        h = hashlib.sha256()
        hash_part(h, json.dumps(self.layout.describe(), sort_keys=True).encode())
        hash_part(h, b"format=gguf")
        hash_part(h, json.dumps([[(s.key, s.type, s.rows, s.cols) for s in ls] for ls in g.sources]).encode())
        for part in g.fingerprint_parts:
            hash_part(h, part)
        self.fingerprint = h.hexdigest()[:32]
        self.path = path
        self.files = g.files
        self.config = {k: v for k, v in g.metadata.items() if v is not None}
        self.model_type = g.arch
        self.layer_ids = g.layer_ids
        self.n_experts = g.n_experts
        self.top_k = g.top_k
        self.quantization = g.quantization
        self.sources = g.sources
        self._raw_nbytes = g.raw_nbytes
        self._tensor_names = g.tensor_names
        self._index = {p.key: i for i, p in enumerate(self.layout.pieces)}
        self._tls = threading.local()

    def extents(self, layer: int, expert: int) -> list[tuple[int, int, int, int]]:
        raise ValueError(f"{self.path}: GGUF records are converted to MLX's layout, not copied from the file; "
                         "use read_record(), read_into_slots() or read_into_rows()")

    def read_record(self, layer: int, expert: int) -> bytes:
        """The numpy conversion of the raw slices (transcode_reference)."""
        buf = bytearray(self.layout.nbytes)
        for src in self.sources[layer]:
            data = pread_plain(self.files[src.file], src.start + expert * src.expert_bytes, src.expert_bytes)
            for key, piece in zip(src.piece_keys(), transcode_reference(src.type, data, src.rows, src.cols)):
                p = self.layout.piece(key)
                buf[p.offset:p.offset + p.nbytes] = piece
        return bytes(buf)

    def file_ranges(self, layer: int, expert: int) -> list[tuple[int, int, int]]:
        return [(src.file, src.start + expert * src.expert_bytes, src.expert_bytes) for src in self.sources[layer]]

    def read_into_slots(self, fds: list[int], layer: int, targets: list[tuple], threads: int) -> None:
        self._transcode(fds, layer, [(expert, [(memory, base + p.offset) for p in self.layout.pieces])
                                     for expert, memory, base, _ in targets], threads)

    def read_into_rows(self, fds: list[int], layer: int, targets: list[tuple], threads: int,
                       checksums: bool = False, landed: Landed | None = None) -> None:
        self._transcode(fds, layer, targets, threads)

    def _scratch(self, nbytes: int):
        """Per-thread scratch memory for raw bytes, grown as needed. Plain host memory, not MLX's allocator:
        the daemon converts too, and must never start a GPU device (docs/architecture.md)."""
        from moe_l2 import _native

        buf = getattr(self._tls, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._tls.scratch = _native.HostBuffer(max(nbytes, 2 * buf.nbytes if buf is not None else 0))
        return buf

    def _transcode(self, fds: list[int], layer: int, targets: list[tuple], threads: int) -> None:
        """targets: [(expert, [(memory, offset), one per layout piece])]."""
        from moe_l2 import _native

        scratch = self._scratch(self._raw_nbytes * len(targets))
        reads, jobs = [], []
        for i, (expert, place) in enumerate(targets):
            base = i * self._raw_nbytes
            for src in self.sources[layer]:
                raw = base + src.raw_offset
                reads.append((fds[src.file], src.start + expert * src.expert_bytes, src.expert_bytes, scratch, raw))
                out = [place[self._index[k]] for k in src.piece_keys()]
                out += [out[0]] * (3 - len(out))  # float types write the weight only
                jobs.append((src.type, src.rows, src.cols, scratch, raw, *out[0], *out[1], *out[2]))
        _native.pread_records(reads, threads=threads)
        _native.transcode_gguf(jobs, threads=threads)

    def expert_tensor_names(self) -> set[str]:
        """blk.N.ffn_*_exps.*"""
        return set(self._tensor_names)

    def tensor_names(self, layer: int) -> dict:
        raise ValueError(f"{self.path}: a GGUF model has no safetensors names")
