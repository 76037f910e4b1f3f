"""moe_l2.client: L0 and the link to L2, a process' side of moe-l2 (docs/architecture.md, "The tree").

`ExpertPool` (L0 and the L0 -> L2 -> L3 walk), `L2Client` (the link to moe-l2d) and `StreamOptions` (every
streaming option, once); moe_l2.lm builds mlx-lm models on them. Each name is imported on first use, so that
`import moe_l2.client` loads neither MLX nor mlx-lm.
"""

from __future__ import annotations

from moe_l2.exports import lazy_exports

# Name -> the module that defines it.
_EXPORTS = {
    "StreamOptions": "options", "OptionError": "options",
    "ExpertPool": "pool", "TierCounts": "pool", "PoolTooSmall": "pool",
    "L2Client": "connection",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
