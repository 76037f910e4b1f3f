"""The bounds a model's files are held to where a model is opened, before anything is built from them
(docs/security.md, "Damaged model data"; docs/formats.md, "What a model's files may hold").

A model directory may be another user's, or damaged: every file is opened without blocking and read only when
``fstat`` on that very descriptor shows a regular file (a FIFO would block an open or a read for ever); JSON
(config.json, the safetensors index and headers) is read up to a size and parsed to a depth; tensor extents must
lie inside their file's data, apart and aligned; and config.json's layer and expert counts must be ones the
files' tensors can hold, since mlx-lm builds a module for every layer it names. The format readers
call these once, as they open a model; nothing checks them again.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["MAX_CONFIG_BYTES", "MAX_INDEX_BYTES", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH", "Extent", "open_regular",
           "read_regular", "parse_json", "check_directory", "check_extents", "check_config"]

# config.json: a few KiB, up to a few hundred with per-module quantization entries.
MAX_CONFIG_BYTES = 16 << 20
# The safetensors index: about 100 bytes a tensor (DeepSeek-V3's is 9 MB).
MAX_INDEX_BYTES = 64 << 20
# A safetensors header: the safetensors package refuses larger ones.
MAX_HEADER_BYTES = 100_000_000
# Nesting of any JSON read: real files nest 4 deep; Python's parser and everything after it recurse.
MAX_JSON_DEPTH = 32

# config.json keys that are counts mlx-lm builds modules from, in the text model's config (top level, or nested
# as text_config, ffn_config...; vision and audio towers are not built). A count no key here names is bounded by
# the build itself (architecture.py, _MODULES_PER_TENSOR); sizes cost no memory there (its arrays are never
# evaluated) and are checked against the expert tensors after it (safetensors.py).
_LAYER_KEYS = frozenset({"num_hidden_layers", "num_layers", "n_layers", "n_layer"})
_EXPERT_KEYS = frozenset({"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                          "num_experts_per_tok", "experts_per_token"})
_NOT_BUILT = ("vision", "audio", "quantization")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _not_regular(path, mode: int) -> ValueError:
    return ValueError(f"{path} is a {_kind(mode)}, not a regular file: a model's files must be regular files")


def open_regular(path) -> int:
    """A read-only descriptor of path (a symlink is followed: Hugging Face caches link to their blobs), opened
    without blocking and checked with fstat to be a regular file; ValueError for anything else, OSError when
    it cannot be opened. O_NONBLOCK is cleared once checked, so reads (and O_DIRECT) behave as usual."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = stat.S_IFREG  # let the open say what is wrong
    if not stat.S_ISREG(mode):  # not even opened: opening some devices acts on them
        raise _not_regular(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode  # what was opened, whatever was swapped in after the stat
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path, limit: int, what: str) -> bytes:
    """The bytes of the regular file path, refused (ValueError) when it holds more than limit bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: more than {limit} bytes, far more than {what} holds (damaged?)")
    return data


def parse_json(raw: bytes, path, what: str):
    """raw parsed as JSON, nested at most MAX_JSON_DEPTH deep; ValueError naming path and what it should be."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path}: not {what} (JSON nested more than {MAX_JSON_DEPTH} deep)") from None
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: not {what} (not valid JSON: {e})") from None
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise ValueError(f"{path}: not {what} (JSON nested more than {MAX_JSON_DEPTH} deep)")
    return value


def _deeper_than(value, depth: int) -> bool:
    """Whether parsed JSON nests more than depth containers deep: level by level, containers only (a fifth of
    json.loads' own time for a header of 100k tensors)."""
    level = [value] if type(value) in (dict, list) else []
    for _ in range(depth):
        if not level:
            return False
        level = [c for v in level for c in (v.values() if type(v) is dict else v) if type(c) in (dict, list)]
    return bool(level)


def check_directory(path: Path, skip: str) -> None:
    """Refuse a model directory holding a FIFO, socket or device: besides the files moe-l2 opens itself (each
    through open_regular), mlx-lm and the tokenizer open files of the directory by name. skip: a name whose
    reader deals with it (the checksum manifest: one that is not a regular file is ignored with a warning)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name == skip:
                continue
            try:
                mode = entry.stat().st_mode
            except OSError:
                continue  # a dangling link: nothing opens it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise _not_regular(entry.path, mode)


@dataclass(frozen=True)
class Extent:
    """The bytes a tensor says it has: [start, start + nbytes) of its file."""

    name: str
    start: int
    nbytes: int


def check_extents(path, extents: Iterable[Extent], data_start: int, size: int, alignment: int = 1) -> None:
    """Every tensor's bytes inside the file's data ([data_start, size)), at a multiple of alignment from
    data_start, and no two sharing a byte; ValueError naming the first that is not."""
    previous = None
    for t in sorted(extents, key=lambda t: (t.start, t.nbytes)):
        if t.start < data_start or (t.start - data_start) % alignment:
            raise ValueError(f"{path}: tensor {t.name!r} starts at byte {t.start}, which is not "
                             f"{'inside the data' if t.start < data_start else f'aligned to {alignment} bytes'}"
                             " (damaged or edited?)")
        if t.start + t.nbytes > size:
            raise ValueError(f"{path}: truncated file (tensor {t.name!r} ends at byte {t.start + t.nbytes}, "
                             f"the file has {size})")
        if t.nbytes == 0:
            continue
        if previous is not None and t.start < previous.start + previous.nbytes:
            raise ValueError(f"{path}: tensors {previous.name!r} and {t.name!r} overlap (bytes "
                             f"{t.start}-{previous.start + previous.nbytes - 1}): damaged or edited?")
        previous = t


def _counts(config: dict, keys: frozenset) -> Iterable[tuple[str, int]]:
    """(key, value) of every integer (or list of integers) under one of keys, in config and its nested dicts."""
    for key, value in config.items():
        if isinstance(value, dict):
            if not any(word in key for word in _NOT_BUILT):
                yield from _counts(value, keys)
        elif key in keys:
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    yield key, v


def check_config(path, config: dict, layers: int, experts: int) -> None:
    """Refuse config.json's layer and expert counts larger than the files hold, before mlx-lm builds a model from
    them (a module per layer: a million layers is gigabytes and minutes). layers: one more than the largest
    decoder layer number in the tensor names; experts: the most experts any tensor holds (its leading dimension,
    or the per-expert names). ValueError naming the key."""
    for keys, most, what in ((_LAYER_KEYS, layers, "decoder layers"), (_EXPERT_KEYS, experts, "experts")):
        for key, value in _counts(config, keys):
            if not 0 <= value <= most:
                raise ValueError(f"{path}: {key} is {value}, but the files' tensors hold {most} {what} at most: "
                                 "config.json does not belong to these files (damaged or edited?)")
