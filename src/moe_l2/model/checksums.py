"""Checksum manifests: the CRC-32 of every record of a model, kept beside its files, so that a record
damaged on disk is caught where it is read (docs/formats.md, "Checksums"); and the errors of a damaged record
(DamagedRecord: CorruptRecord, UnreadableRecord).

`moe-l2 pack` writes one for every packed model (and `moe-l2 bench` for its models of random bytes); `moe-l2 verify
--manifest` writes one for any model (`manifest_of`).
`ModelFiles.open` loads it when its fingerprint is the model's; the daemon's loader, the client's pool and
`moe-l2 verify` compare records with it (record_checksum in records.py is the one definition).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_l2.atomic_file import AtomicFile
from moe_l2.model.bounds import parse_json, read_regular

__all__ = ["MANIFEST_NAME", "MANIFEST_FORMAT", "DamagedRecord", "CorruptRecord", "UnreadableRecord", "Manifest",
           "manifest_path", "load_manifest", "manifest_of", "write_manifest"]

MANIFEST_NAME = "moe-l2.checksums.json"
MANIFEST_FORMAT = "moe-l2-checksums-v1"
# Bytes of JSON per checksum, generously: a manifest larger than this for its model is refused unread.
_BYTES_PER_ENTRY = 16
_FIXED_BYTES = 1 << 16


class DamagedRecord(ValueError):
    """A record cannot be used as its model file holds it now; the message names the record, its files and what
    to do."""


def _restore(model: Path) -> str:
    return (f"restore the model files (download or pack them again); `moe-l2 verify --model {model} --all` lists "
            "every damaged record")


class CorruptRecord(DamagedRecord):
    """A record's bytes do not match the checksum the manifest holds for it: the model file is damaged."""

    def __init__(self, model: Path, layer: int, expert: int, files: list[Path], expected: int, actual: int,
                 source: str):
        self.layer, self.expert, self.files = layer, expert, files
        self.expected, self.actual, self.source = expected, actual, source
        super().__init__(
            f"{model}: MoE layer {layer} expert {expert} read from {source} fails its checksum (crc32 {actual:08x}, "
            f"the manifest says {expected:08x}): {', '.join(str(f) for f in files)} is damaged; {_restore(model)}")


class UnreadableRecord(DamagedRecord):
    """A record cannot be read whole from its model file (truncated or replaced since the model was opened, or
    an I/O error)."""

    def __init__(self, model: Path, layer: int, experts: list[int], files: list[Path], cause: OSError):
        self.layer, self.experts, self.files = layer, experts, files
        which = f"expert {experts[0]}" if len(experts) == 1 else f"experts {', '.join(map(str, experts[:8]))}"
        super().__init__(
            f"{model}: MoE layer {layer} {which} cannot be read from {', '.join(str(f) for f in files)} ({cause}): "
            f"the file changed or was damaged since the model was opened; {_restore(model)}")


@dataclass(frozen=True)
class Manifest:
    """The checksums of a model's records: per MoE layer, per expert."""

    path: Path
    fingerprint: str
    record_bytes: int
    checksums: tuple[tuple[int, ...], ...]

    def expected(self, layer: int, expert: int) -> int:
        return self.checksums[layer][expert]

    def to_json(self) -> bytes:
        return json.dumps({"format": MANIFEST_FORMAT, "algorithm": "crc32", "fingerprint": self.fingerprint,
                           "record_bytes": self.record_bytes, "layers": [list(c) for c in self.checksums]},
                          separators=(",", ":")).encode()


def manifest_path(model: Path) -> Path:
    """Where a model's manifest lives: in its directory; beside a single .gguf file, named after it."""
    model = Path(model)
    return model / MANIFEST_NAME if model.is_dir() else model.with_name(f"{model.name}.{MANIFEST_NAME}")


def load_manifest(model: Path, fingerprint: str, record_bytes: int, n_layers: int,
                  n_experts: int) -> tuple[Optional[Manifest], Optional[str]]:
    """(manifest, None) when the model has a current one; (None, None) when it has none; (None, why) when
    the one it has cannot be used (stale or damaged), why saying what to do."""
    path = manifest_path(model)
    fix = f"run `moe-l2 verify --model {model} --manifest` to write a new one"
    try:
        # A regular file, opened without blocking, of bounded size (src/moe_l2/model/bounds.py): a FIFO planted in a
        # model directory must not hang a daemon that reads it (docs/formats.md, "Checksums").
        raw = read_regular(path, _FIXED_BYTES + _BYTES_PER_ENTRY * n_layers * n_experts, "this model's checksums")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"cannot read the checksum manifest: {e}; {fix}"
    try:
        d = parse_json(raw, path, "a checksum manifest")
        if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT or d.get("algorithm") != "crc32":
            raise ValueError(f"{path}: not a {MANIFEST_FORMAT} crc32 manifest")
    except ValueError as e:
        return None, f"the checksum manifest is damaged: {e}; {fix}"
    if d.get("fingerprint") != fingerprint or d.get("record_bytes") != record_bytes:
        return None, (f"the checksum manifest {path} is stale: it was written for other model files (fingerprint "
                      f"{d.get('fingerprint')}, the model's is {fingerprint}), so the files changed since (a copy "
                      f"that did not keep modification times does this too); {fix}")
    layers = d.get("layers")
    if (not isinstance(layers, list) or len(layers) != n_layers
            or any(not isinstance(row, list) or len(row) != n_experts for row in layers)
            or any(type(c) is not int or not 0 <= c < 1 << 32 for row in layers for c in row)):
        return None, (f"the checksum manifest {path} is damaged (its checksums are not {n_layers} layers x "
                      f"{n_experts} experts of 32-bit values); {fix}")
    return Manifest(path, fingerprint, record_bytes, tuple(tuple(row) for row in layers)), None


def manifest_of(files, progress=lambda: None) -> Manifest:
    """The manifest of a model's records as its files hold them now, read one by one (files: a ModelFiles);
    DamagedRecord where one cannot be read. progress() is called after each record."""
    checksums = []
    for layer in range(files.n_layers):
        row = []
        for expert in range(files.n_experts):
            row.append(files.layout.checksum(files.read_record(layer, expert)))
            progress()
        checksums.append(tuple(row))
    return Manifest(manifest_path(files.path), files.content_fingerprint, files.layout.nbytes, tuple(checksums))


def write_manifest(manifest: Manifest, dir_fd: int | None = None) -> None:
    """Write the manifest atomically: under a private name, fsynced, renamed over the old one. The model's
    directory may be a shared cache other users can write, and the writer root (src/moe_l2/atomic_file.py).
    dir_fd: a descriptor of that directory, when the caller holds one."""
    with AtomicFile(manifest.path, dir_fd=dir_fd) as f:
        f.write(manifest.to_json())
