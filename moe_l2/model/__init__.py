"""Model files as per-expert records: one module per format behind one interface (docs/architecture.md).

- ``records``: ``Piece``, ``RecordLayout`` and ``RecordReader``, the interface every format implements;
- ``safetensors``: mlx-lm checkpoints, experts stacked or one tensor per expert (read piece by piece);
- ``packed``: checkpoints written by ``moe-l2 pack``, one page-aligned extent per record (one read);
- ``gguf``: llama.cpp files, records converted to MLX's layout;
- ``checksums``: checksum manifests (the CRC-32 of every record) and ``CorruptRecord``;
- ``files``: ``ModelFiles``, the model's identity, which opens the right reader and delegates to it;
- ``packer``: ``pack``, which writes a packed copy of a checkpoint.
"""

from moe_l2.model.checksums import MANIFEST_NAME, CorruptRecord, Manifest
from moe_l2.model.files import DIRECT_IO, ModelFiles
from moe_l2.model.packed import PACK_MARKER
from moe_l2.model.records import ALIGN, FORMATS, PACK_ALIGN, Piece, RecordLayout, RecordReader
from moe_l2.model.safetensors import INDEX_NAME

__all__ = ["ALIGN", "PACK_ALIGN", "PACK_MARKER", "INDEX_NAME", "FORMATS", "DIRECT_IO", "Piece", "RecordLayout",
           "RecordReader", "ModelFiles", "MANIFEST_NAME", "CorruptRecord", "Manifest"]
