"""moe-l2: a shared, machine-wide expert cache for Mixture-of-Experts inference with MLX.

`model, tokenizer = moe_l2.load(path_or_repo_id, **options)` loads an mlx-lm MoE model with its experts
streamed, for mlx_lm.generate, stream_generate and batch_generate; `moe_l2.close(model)` (or `with model:`)
closes the stream, `moe_l2.stats(model)` counts where its experts came from, `moe_l2.StreamOptions` holds the
options. They live in moe_l2.client and are imported on first use: `import moe_l2` (and `moe-l2 --version`)
loads neither MLX nor mlx-lm.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load", "close", "stats", "StreamOptions", "OptionError", "ExpertStats"]
_CLIENT = frozenset(__all__) - {"__version__"}


def __getattr__(name: str):
    if name not in _CLIENT:
        raise AttributeError(f"module 'moe_l2' has no attribute {name!r}")
    from moe_l2 import client

    return getattr(client, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CLIENT))
