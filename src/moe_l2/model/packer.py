"""The packer behind `moe-l2 pack`: rewrite an mlx-lm MoE checkpoint expert-major, so that a miss is one
read per expert (docs/formats.md, "Packed checkpoints"; src/moe_l2/model/packed.py reads the result).

The packed checkpoint is an ordinary mlx-lm checkpoint directory:

- ``config.json``, the tokenizer and every other file, copied unchanged;
- the non-expert tensors, unchanged, in ``model-0000i-of-0000n.safetensors`` shards;
- the routed experts as **one tensor per expert and piece**, named the way the architecture's
  mlx-lm ``sanitize`` stacks them back (``...mlp.experts.7.gate_proj.scales``; mixtral:
  ``...block_sparse_moe.experts.7.w1.scales``), in shards of whole MoE layers where each expert's
  record is one contiguous extent: it starts at a multiple of 4096 bytes in the file (the header is
  padded with spaces so that the data starts on a page), and its pieces lie at their record offsets
  (ModelFiles' layout: key order, 64-byte aligned). The gaps (record padding, up to 4095 bytes
  after each record) are zero bytes that belong to no tensor. ``mx.load`` (what mlx-lm uses) reads
  such files; the strict ``safetensors`` package refuses gaps between tensors, which only exist
  where piece or record sizes are not multiples of 64 / 4096 bytes (real models' sizes mostly are).
- ``model.safetensors.index.json`` with every tensor, and ``__metadata__["moe_l2"] = "packed-v1"``
  in every shard.

So mlx_lm.load gives the same model (its sanitize stacks the per-expert tensors back into the
switch layers, byte for byte), and ModelFiles sees format "packed": ``record_span`` is one read.
Before writing, pack runs the architecture's sanitize on shape-only stand-ins to check that mlx-lm
will stack the per-expert names back; some architectures' sanitize stacks only some pieces
(qwen3_moe: the unquantized ``weight`` only), and pack then refuses unless ``--moe-l2-only``.

Atomicity: every file is written under a private name (``.NAME.<random>.partial``, created
O_EXCL|O_NOFOLLOW in the output directory's descriptor, held from start to end: --out may lie in a
directory other users can write, and the packer run as root; src/moe_l2/atomic_file.py), fsynced
(``F_FULLFSYNC`` on macOS, where plain fsync leaves the data in the drive's cache), its pages dropped from
the page cache (a pack is written once and read later, by direct I/O by default), then renamed;
``config.json`` is written last, so an interrupted pack leaves no directory that mlx-lm or moe-l2 would
take for a model; the next run removes the partial files an interrupted one left. Just before it, the
checksum manifest (``moe-l2.checksums.json``: the CRC-32 of every record, as read from the source) is
written, so that every packed model has one (src/moe_l2/model/checksums.py). Running the same
pack again resumes: shards already in place whose size and header match the plan (which names the
source's fingerprint) are kept.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from moe_l2.atomic_file import AtomicFile, final_name, open_dir
from moe_l2.model.bounds import open_regular
from moe_l2.model.checksums import MANIFEST_NAME, Manifest, manifest_path, write_manifest
from moe_l2.model.files import ModelFiles
from moe_l2.model.packed import PACK_MARKER, checkpoint_reader
from moe_l2.model.records import PACK_ALIGN
from moe_l2.model.safetensors import DTYPES, INDEX_NAME, read_checkpoint, read_header

__all__ = ["PackError", "pack"]

_CHUNK = 64 << 20  # bytes read and written at a time
_HF_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_SAFETENSORS_CODE = {mlx: code for code, (mlx, _) in DTYPES.items()}


class PackError(ValueError):
    pass


@dataclass
class _Shard:
    name: str
    header: bytes  # the 8-byte length and the padded JSON
    size: int  # of the whole file
    # dense shard: (source file index, source offset, nbytes, data offset) per tensor
    copies: list = field(default_factory=list)
    # expert shard: (MoE layer, data offset of its first record)
    layers: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)  # name -> header entry


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _header(tensors: dict, metadata: dict, align: int) -> bytes:
    body = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":")).encode()
    body += b" " * (_round(8 + len(body), align) - 8 - len(body))
    return len(body).to_bytes(8, "little") + body


def _switch_split(name: str) -> tuple[list[str], str, str]:
    """A stacked expert tensor name, ``<switch layer path>.<proj>.<param>``, as (the switch layer's parent
    path, proj, param): per-expert tensors go beside the switch layer (docs/formats.md)."""
    parts = name.split(".")
    return parts[:-3], parts[-2], parts[-1]


def _naming(files: ModelFiles, aliases: Optional[dict]):
    """name(layer, expert, key) for the packed per-expert tensors."""
    per_expert = [all(None not in v for v in files.tensor_names(layer).values()) for layer in range(files.n_layers)]
    names = [files.tensor_names(layer) for layer in range(files.n_layers)]

    def name(layer: int, expert: int, key: str) -> str:
        slots = names[layer][key]
        if per_expert[layer]:
            return slots[expert]  # the checkpoint's own per-expert names: mlx-lm loaded them before
        prefix, proj, param = _switch_split(slots[None])
        return ".".join([*prefix, "experts", str(expert), (aliases or {}).get(proj, proj), param])

    return name, all(per_expert)


def _sanitized(model, shapes: dict) -> dict:
    import mlx.core as mx

    weights = {n: mx.zeros(shape, dtype=getattr(mx, dtype)) for n, (shape, dtype) in shapes.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in weights.items()}


class _NoMlxLmModel(Exception):
    """mlx-lm cannot build the model: there is no mlx-lm loading to keep compatible with."""


class _NotLoadable(Exception):
    """No candidate naming would load with mlx_lm.load; the message says why the first one fails."""


def _mlx_lm_naming(src: Path, original: dict, candidates: dict) -> str:
    """The label of the first candidate naming that mlx-lm's sanitize turns into what it makes of the
    original checkpoint; _NoMlxLmModel or _NotLoadable when there is none.

    original / candidates[label]: {tensor name: (shape, mlx dtype)}, shape-only stand-ins (lazy zeros,
    never evaluated)."""
    try:
        from mlx_lm.utils import _get_classes, load_config

        config = load_config(src)
        model_class, args_class = _get_classes(config=config)
        model = model_class(args_class.from_dict(config))
        want = _sanitized(model, original)
    except Exception as e:  # noqa: BLE001 - mlx-lm cannot build this model: nothing to keep compatible with
        raise _NoMlxLmModel(f"mlx-lm cannot build this model ({type(e).__name__}: {e})") from e
    why = ""
    for label, shapes in candidates.items():
        got = _sanitized(model, shapes)
        if got == want:
            return label
        if why:
            continue  # report why the first (canonical) naming fails
        arch = config.get("model_type")
        extra = sorted(set(got) - set(want))
        if extra:
            why = f"mlx-lm's {arch} sanitize leaves {len(extra)} per-expert tensors unstacked (e.g. {', '.join(extra[:3])})"
        else:
            changed = sorted(k for k in want if got.get(k) != want[k])
            why = f"mlx-lm's {arch} sanitize does not rebuild {', '.join(changed[:3])}"
    raise _NotLoadable(why)


def _plan(files: ModelFiles, name, max_shard: int, source_meta: dict) -> tuple[list[_Shard], dict]:
    headers = [read_header(f, i) for i, f in enumerate(files.files)]
    expert_names = files.expert_tensor_names()
    dense = sorted((n, t) for h in headers for n, t in h.tensors.items() if n not in expert_names)
    layout = files.layout
    stride = layout.span
    meta = {**source_meta, "moe_l2": PACK_MARKER, "moe_l2_source": files.fingerprint,
            "moe_l2_record_bytes": str(layout.nbytes), "moe_l2_align": str(PACK_ALIGN)}

    groups: list[list] = []
    size = 0
    for n, t in dense:
        if not groups or (size + t.nbytes > max_shard and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append((n, t))
        size += t.nbytes
    layer_groups: list[list[int]] = []
    per_layer = files.n_experts * stride
    for layer in range(files.n_layers):
        if not layer_groups or (len(layer_groups[-1]) + 1) * per_layer > max_shard:
            layer_groups.append([])
        layer_groups[-1].append(layer)

    total = len(groups) + len(layer_groups)
    fmt = "model-{:05d}-of-{:05d}.safetensors"
    shards = []
    weight_map = {}
    for group in groups:
        shard = _Shard(fmt.format(len(shards) + 1, total), b"", 0)
        offset = 0
        for n, t in group:
            shard.tensors[n] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            shard.copies.append((t.file, t.start, t.nbytes, offset))
            offset += t.nbytes
        shard.header = _header(shard.tensors, meta, 8)
        shard.size = len(shard.header) + offset
        shards.append(shard)
    for group in layer_groups:
        shard = _Shard(fmt.format(len(shards) + 1, total), b"", 0)
        offset = 0
        for layer in group:
            shard.layers.append((layer, offset))
            for e in range(files.n_experts):
                for p in layout.pieces:
                    start = offset + e * stride + p.offset
                    shard.tensors[name(layer, e, p.key)] = {
                        "dtype": _SAFETENSORS_CODE[p.dtype], "shape": list(p.shape),
                        "data_offsets": [start, start + p.nbytes]}
            offset += per_layer
        shard.header = _header(shard.tensors, meta, PACK_ALIGN)
        shard.size = len(shard.header) + offset  # a multiple of PACK_ALIGN: the last record's padding too
        shards.append(shard)
    for shard in shards:
        weight_map.update((n, shard.name) for n in shard.tensors)
    index = {
        "metadata": {
            "total_size": sum(t.nbytes for _, t in dense) + files.n_layers * files.n_experts * layout.nbytes,
            "moe_l2": {"format": PACK_MARKER, "source_fingerprint": files.fingerprint,
                       "record_bytes": layout.nbytes, "record_span": stride},
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    return shards, index


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _pread(fd: int, offset: int, nbytes: int) -> bytes:
    data = os.pread(fd, nbytes, offset)
    while len(data) < nbytes:
        more = os.pread(fd, nbytes - len(data), offset + len(data))
        if not more:
            raise PackError(f"short read at byte {offset + len(data)}: was the source model truncated?")
        data += more
    return data


def _complete(out_fd: int, shard: _Shard) -> bool:
    """Whether an earlier run wrote the shard: a regular file (a link or FIFO planted in --out is neither
    followed nor waited on) of the planned size and header."""
    try:
        fd = os.open(shard.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=out_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return (stat.S_ISREG(st.st_mode) and st.st_size == shard.size
                and os.pread(fd, len(shard.header), 0) == shard.header)
    except OSError:
        return False
    finally:
        os.close(fd)


def _full_fsync(fd: int) -> None:
    """Data on stable storage: macOS' fsync stops at the drive's cache, F_FULLFSYNC flushes it too.
    Filesystems that refuse F_FULLFSYNC (network, FUSE) get a plain fsync."""
    if hasattr(fcntl, "F_FULLFSYNC"):
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


class _PackFile(AtomicFile):
    """A file of the pack, leaving none of its pages in the page cache: the pack is read later (by direct I/O
    by default) and would only push out other data."""

    def __init__(self, final: Path, dir_fd: int | None = None):
        super().__init__(final, dir_fd=dir_fd)
        if not hasattr(os, "posix_fadvise") and hasattr(fcntl, "F_NOCACHE"):
            try:  # macOS: no fadvise; writes through this fd are not kept in the unified buffer cache
                fcntl.fcntl(self.fd, fcntl.F_NOCACHE, 1)
            except OSError:
                pass  # a hint: the file is written all the same

    def sync(self) -> None:
        _full_fsync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written back above, so dropped


def _layer_chunks(files: ModelFiles, src_fds: list[int], layer: int):
    """One MoE layer's records laid out expert-major (a record every layout.span bytes), read from the source
    a chunk of experts at a time: (first expert, buffer) per chunk."""
    layout = files.layout
    stride = layout.span
    chunk = max(1, _CHUNK // stride)
    for e0 in range(0, files.n_experts, chunk):
        e1 = min(files.n_experts, e0 + chunk)
        buf = bytearray((e1 - e0) * stride)
        extents = [files.extents(layer, e) for e in range(e0, e1)]
        for i, p in enumerate(layout.pieces):
            where = [x[i][:2] for x in extents]
            contiguous = all(w == (where[0][0], where[0][1] + i * p.nbytes) for i, w in enumerate(where))
            if contiguous:  # a stacked tensor: the chunk's slices in one read
                data = _pread(src_fds[where[0][0]], where[0][1], (e1 - e0) * p.nbytes)
                for i in range(e1 - e0):
                    buf[i * stride + p.offset:i * stride + p.offset + p.nbytes] = data[i * p.nbytes:(i + 1) * p.nbytes]
            else:
                for i, (fi, off) in enumerate(where):
                    buf[i * stride + p.offset:i * stride + p.offset + p.nbytes] = _pread(src_fds[fi], off, p.nbytes)
        yield e0, buf


def _chunk_checksums(files: ModelFiles, buf: bytearray) -> list[int]:
    stride = files.layout.span
    return [files.layout.checksum(buf, i * stride) for i in range(len(buf) // stride)]


def _write_shard(files: ModelFiles, src_fds: list[int], out: Path, out_fd: int, shard: _Shard, bar,
                 checksums: dict) -> None:
    """Write the shard; checksums[layer] gets the checksums of its layers' records, as read from the source."""
    with _PackFile(out / shard.name, out_fd) as f:
        _write_all(f.fd, shard.header)
        bar.update(len(shard.header))
        for fi, start, nbytes, _ in shard.copies:
            for at in range(0, nbytes, _CHUNK):
                n = min(_CHUNK, nbytes - at)
                _write_all(f.fd, _pread(src_fds[fi], start + at, n))
                bar.update(n)
        for layer, _ in shard.layers:
            checksums[layer] = []
            for _, buf in _layer_chunks(files, src_fds, layer):
                checksums[layer] += _chunk_checksums(files, buf)
                _write_all(f.fd, buf)
                bar.update(len(buf))


def _open_source(path) -> int:
    """A file of the source model, checked as ModelFiles.open checked it: nothing swapped in since (a FIFO would
    hang the pack) is read."""
    try:
        return open_regular(path)
    except ValueError as e:
        raise PackError(str(e)) from None


def _copy_atomic(src: Path, dst: Path, data: Optional[bytes] = None, *, dir_fd: int | None = None) -> None:
    """dst: src's bytes (or `data`) with src's mode and times; dir_fd: dst's directory, when held."""
    st = os.stat(src)
    with _PackFile(dst, dir_fd) as f:
        if data is None:
            with os.fdopen(_open_source(src), "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    _write_all(f.fd, chunk)
        else:
            _write_all(f.fd, data)
        f.mode = stat.S_IMODE(st.st_mode)
        os.utime(f.fd, ns=(st.st_atime_ns, st.st_mtime_ns))  # through the descriptor, as the mode


def _copy_tree(src: Path, dst: Path, dst_dir_fd: int) -> None:
    """A folder of the source (a tokenizer's, say) at dst, dst_dir_fd its parent: each folder opened without
    following a link and each file written through _copy_atomic, so nothing planted in --out is followed."""
    try:
        os.mkdir(dst.name, 0o755, dir_fd=dst_dir_fd)
    except FileExistsError:
        pass
    try:
        fd = open_dir(dst.name, dst_dir_fd, follow=False)
    except OSError as e:
        raise PackError(f"{dst} is not a folder this pack can write into ({e.strerror}); remove it") from None
    try:
        for entry in sorted(os.scandir(src), key=lambda e: e.name):
            if entry.is_dir():
                _copy_tree(Path(entry.path), dst / entry.name, fd)
            else:
                _copy_atomic(Path(entry.path), dst / entry.name, dir_fd=fd)
    finally:
        os.close(fd)


def _leftover(name: str, planned: set[str]) -> bool:
    """A partial file an interrupted pack left: under its private name, or as NAME.partial (an earlier release's
    name, and one another user can plant a link at: it is removed, never opened)."""
    return final_name(name) in planned or (name.endswith(".partial") and name.removesuffix(".partial") in planned)


def _check_out(src: Path, out: Path, planned: set[str]) -> None:
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise PackError(f"--out {out} must not be the source model or lie inside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise PackError(f"--out {out} exists and is not a directory")
    if (out / "config.json").exists():
        raise PackError(f"--out {out} already holds a model (config.json); remove it or choose another directory")
    strangers = sorted(p.name for p in out.iterdir() if p.name not in planned and not _leftover(p.name, planned))
    if strangers:
        raise PackError(f"--out {out} holds files this pack would not write ({', '.join(strangers[:5])}), "
                        "perhaps left by a pack with other settings: remove them, or give an empty or new directory")


def _verify(files: ModelFiles, out: Path, shards: list[_Shard], how: str) -> None:
    if how == "none":
        return
    stride = files.layout.span
    picks = []
    for layer in range(files.n_layers):
        if how == "full":
            picks += [(layer, e) for e in range(files.n_experts)]
        else:
            picks += [(layer, 0), (layer, files.n_experts - 1)]
    if how != "full":
        rng = random.Random(0)
        picks += [(rng.randrange(files.n_layers), rng.randrange(files.n_experts)) for _ in range(16)]
    where = {layer: (shard, base) for shard in shards for layer, base in shard.layers}
    for layer, e in picks:
        shard, base = where[layer]
        with open(out / shard.name, "rb") as fh:
            fh.seek(len(shard.header) + base + e * stride)
            got = fh.read(files.layout.nbytes)
        if got != files.read_record(layer, e):
            raise PackError(f"verification failed: MoE layer {layer} expert {e} differs from the source")


def pack(model, out, *, max_shard_bytes: int = 5 << 30, moe_l2_only: bool = False, verify: str = "sample",
         progress: bool = True) -> ModelFiles:
    """Pack the checkpoint at `model` into the directory `out`; returns the packed model's ModelFiles."""
    src = Path(model)
    out = Path(out)
    try:
        files = ModelFiles.open(src)
    except (OSError, ValueError) as e:
        raise PackError(str(e)) from None
    if files.format == "gguf":
        raise PackError(f"{src}: GGUF models are served as they are (moe-l2 reads them directly); "
                        "pack rewrites mlx-lm safetensors checkpoints")
    if files.format == "packed":
        raise PackError(f"{src}: already packed")
    if verify not in ("none", "sample", "full"):
        raise PackError(f"verify must be none, sample or full, not {verify!r}")

    headers = [read_header(f, i) for i, f in enumerate(files.files)]
    original = {n: (t.shape, DTYPES[t.dtype][0]) for h in headers for n, t in h.tensors.items()
                if t.dtype in DTYPES}
    dense = {n: v for n, v in original.items() if n not in files.expert_tensor_names()}
    namings = {"mlx": _naming(files, None)}
    if not namings["mlx"][1]:
        namings["hf"] = _naming(files, _HF_PROJ)
    candidates = {}
    for label, (name, _) in namings.items():
        shapes = dict(dense)
        for layer in range(files.n_layers):
            for e in range(files.n_experts):
                for p in files.layout.pieces:
                    shapes[name(layer, e, p.key)] = (p.shape, p.dtype)
        candidates[label] = shapes
    try:
        label = _mlx_lm_naming(src, original, candidates)
    except _NoMlxLmModel as e:
        print(f"moe-l2 pack: note: {e}; the packed copy is named like the checkpoint", file=sys.stderr)
        label = "mlx"
    except _NotLoadable as e:
        if not moe_l2_only:
            raise PackError(f"{src}: a packed copy would not load with mlx_lm.load: {e}. Pass --moe-l2-only to "
                            "pack it for moe-l2 alone (moe-l2d, the client pool and moe-l2 verify read it)") from None
        label = "mlx"
    name = namings[label][0]
    source_meta = {k: v for k, v in headers[0].metadata.items() if isinstance(v, str) and not k.startswith("moe_l2")}
    shards, index = _plan(files, name, max_shard_bytes, source_meta)

    others = [p for p in sorted(src.iterdir())
              if p.name not in (INDEX_NAME, "config.json", MANIFEST_NAME) and not p.name.endswith(".safetensors")
              and not p.name.startswith(".")]
    planned = {s.name for s in shards} | {p.name for p in others} | {INDEX_NAME, "config.json", MANIFEST_NAME}
    _check_out(src, out, planned)
    out.mkdir(parents=True, exist_ok=True)
    out_fd = open_dir(out)
    try:
        for name in os.listdir(out_fd):
            if _leftover(name, planned):
                os.unlink(name, dir_fd=out_fd)  # unlink removes a link, never its target
        return _pack_into(files, src, out, out_fd, shards, index, others, verify, progress)
    finally:
        os.close(out_fd)


def _pack_into(files: ModelFiles, src: Path, out: Path, out_fd: int, shards: list[_Shard], index: dict,
               others: list[Path], verify: str, progress: bool) -> ModelFiles:
    """Write the planned pack into out, whose directory out_fd is (held from start to end)."""

    from tqdm import tqdm

    total = sum(s.size for s in shards)
    src_fds = [_open_source(p) for p in files.files]
    checksums: dict[int, list[int]] = {}
    try:
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pack {out.name}",
                  disable=not progress, file=sys.stderr) as bar:
            for shard in shards:
                if _complete(out_fd, shard):
                    bar.update(shard.size)  # resumed: written and renamed by an earlier run
                    for layer, _ in shard.layers:  # its checksums come from the source all the same
                        checksums[layer] = [c for _, buf in _layer_chunks(files, src_fds, layer)
                                            for c in _chunk_checksums(files, buf)]
                    continue
                _write_shard(files, src_fds, out, out_fd, shard, bar, checksums)
    finally:
        for fd in src_fds:
            os.close(fd)
    _verify(files, out, shards, verify)
    for p in others:
        if p.is_dir():
            _copy_tree(p, out / p.name, out_fd)
        else:
            _copy_atomic(p, out / p.name, dir_fd=out_fd)
    _copy_atomic(src / INDEX_NAME if (src / INDEX_NAME).exists() else src / "config.json", out / INDEX_NAME,
                 json.dumps(index, indent=4).encode(), dir_fd=out_fd)
    # The checksums taken from the source, for the packed copy's fingerprint, before config.json (which is
    # the same bytes as the source's): a packed model always has its manifest (docs/formats.md, "Checksums").
    fingerprint = checkpoint_reader(read_checkpoint(out, src / "config.json")).fingerprint
    write_manifest(Manifest(manifest_path(out), fingerprint, files.layout.nbytes,
                            tuple(tuple(checksums[layer]) for layer in range(files.n_layers))), out_fd)
    _copy_atomic(src / "config.json", out / "config.json", dir_fd=out_fd)  # last: now the directory is a model
    try:
        os.fsync(out_fd)  # the renames
    except OSError:
        pass  # some file systems cannot sync a directory: the files themselves are synced
    try:
        packed = ModelFiles.open(out)
        if packed.format != "packed" or packed.layout.pieces != files.layout.pieces:
            raise ValueError(f"reads as {packed.format}, layout {packed.layout.pieces == files.layout.pieces}")
        if packed.checksums is None:
            raise ValueError(packed.checksum_problem or "no checksum manifest")
    except (OSError, ValueError) as e:
        (out / "config.json").unlink(missing_ok=True)
        raise PackError(f"{out}: the packed model does not read back as packed ({e}); removed its config.json")
    return packed
