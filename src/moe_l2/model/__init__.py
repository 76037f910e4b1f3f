"""Model files as per-expert records: one module per format behind one interface (docs/architecture.md).

- ``records``: ``Piece``, ``RecordLayout`` and ``RecordReader``, the interface every format implements;
- ``safetensors``: mlx-lm checkpoints, experts stacked or one tensor per expert (read piece by piece);
- ``packed``: checkpoints written by ``moe-l2 pack``, one page-aligned extent per record (one read);
- ``gguf``: llama.cpp files, records converted to MLX's layout;
- ``checksums``: checksum manifests (the CRC-32 of every record) and the errors of a damaged record;
- ``bounds``: what a model's files are held to as they are opened (regular files, bounded JSON, extents, config);
- ``files``: ``ModelFiles``, the model's identity, which opens the right reader and delegates to it;
- ``packer``: ``pack``, which writes a packed copy of a checkpoint.
"""

from __future__ import annotations

from moe_l2.exports import lazy_exports

# Name -> the module that defines it. Each is imported on first use, so that what needs a light module of the
# package (moe_l2.model.location: `moe-l2 stats`) loads neither numpy nor the format readers.
_EXPORTS = {
    "MANIFEST_NAME": "checksums", "CorruptRecord": "checksums", "DamagedRecord": "checksums", "Manifest": "checksums",
    "UnreadableRecord": "checksums",
    "DIRECT_IO": "files", "ModelFiles": "files",
    "PACK_MARKER": "packed",
    "ALIGN": "records", "FORMATS": "records", "PACK_ALIGN": "records", "Piece": "records", "RecordLayout": "records",
    "RecordReader": "records",
    "INDEX_NAME": "safetensors",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
