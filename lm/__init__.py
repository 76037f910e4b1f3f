"""moe_l2.lm: mlx-lm models with their experts streamed (docs/architecture.md, "The tree").

`load`, `close` and `stats` are the mlx-lm-shaped entry points (also at the top of the package: `moe_l2.load`);
`StreamedLM` is the facade beneath them, over the client's `ExpertPool` and `L2Client`. Each name is imported on
first use, so that `import moe_l2.lm` loads neither MLX nor mlx-lm.
"""

from __future__ import annotations

from moe_l2.exports import lazy_exports

# Name -> the module that defines it.
_EXPORTS = {
    "load": "streamed_lm", "close": "streamed_lm", "stats": "streamed_lm", "ExpertStats": "streamed_lm",
    "StreamedLM": "streamed_lm",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
