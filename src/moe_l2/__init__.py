"""moe-l2: a shared, machine-wide expert cache for Mixture-of-Experts inference with MLX.

`model, tokenizer = moe_l2.load(path_or_repo_id, **options)` loads an mlx-lm MoE model with its experts
streamed, for mlx_lm.generate, stream_generate and batch_generate; `moe_l2.close(model)` (or `with model:`)
closes the stream, `moe_l2.stats(model)` counts where its experts came from, `moe_l2.StreamOptions` holds the
options. They live in moe_l2.lm and moe_l2.client and are imported on first use: `import moe_l2` (and
`moe-l2 --version`) loads neither MLX nor mlx-lm.
"""

__version__ = "0.1.0"

from moe_l2.exports import lazy_exports  # noqa: E402 (standard library only)

# Name -> the module that defines it, below this package.
_EXPORTS = {"load": "lm.streamed_lm", "close": "lm.streamed_lm", "stats": "lm.streamed_lm",
            "ExpertStats": "lm.streamed_lm", "StreamOptions": "client.options", "OptionError": "client.options"}

__all__ = ["__version__", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
