"""A package's names imported on first use (PEP 562), so that importing the package loads none of its heavy
modules: `moe_l2.client` (MLX, mlx-lm) and `moe_l2.model` (numpy, the format readers)."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """The package's `__getattr__` and `__dir__`: `exports` maps each name to the submodule that defines it;
    a name, once imported, is kept in `namespace` (the package's globals())."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
