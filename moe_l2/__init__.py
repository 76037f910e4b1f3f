"""moe-l2: a shared, machine-wide expert cache for Mixture-of-Experts inference with MLX."""

__version__ = "0.1.0"
