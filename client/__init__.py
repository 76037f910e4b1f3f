"""moe_l2.client: a process' side of moe-l2 (docs/architecture.md, "Modules").

`load`, `close`, `stats` and `StreamOptions` are the mlx-lm-shaped entry points (also at the top of the
package: `moe_l2.load`); `ExpertPool` (L0 and the L0 -> L2 -> L3 walk) and `L2Client` (the link to moe-l2d)
are the layers beneath. Each name is imported on first use, so that `import moe_l2.client` loads neither MLX
nor mlx-lm.
"""

from __future__ import annotations

from moe_l2.exports import lazy_exports

# Name -> the module that defines it.
_EXPORTS = {
    "load": "streamed_lm", "close": "streamed_lm", "stats": "streamed_lm", "ExpertStats": "streamed_lm",
    "StreamedLM": "streamed_lm",
    "StreamOptions": "options", "OptionError": "options",
    "ExpertPool": "pool", "TierCounts": "pool", "PoolTooSmall": "pool",
    "L2Client": "connection",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
