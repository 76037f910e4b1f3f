"""The import rules of docs/architecture.md ("Which part may import which"), checked on the source tree.

Every import counts, module-level or inside a function: a lazy import crosses a boundary all the same.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject.toml, wheel.packages): src/moe_l2 is the package itself
# (the shared core), every other folder X of Python code is moe_l2.X.
FOLDERS = {"src/moe_l2": "moe_l2", "daemon": "moe_l2.daemon", "client": "moe_l2.client", "lm": "moe_l2.lm",
           "serve": "moe_l2.serve", "lab": "moe_l2.lab", "cli": "moe_l2.cli"}
ROOMS = ("daemon", "client", "lm", "serve", "lab", "cli")
# Part -> the parts it may import (its own included). "package" is src/moe_l2/__init__.py: __version__, which every
# part reads, and moe_l2.load & co., which it imports from lm and the client on first use. The runtime (core, daemon,
# client) never imports the lab, and the core nothing above it.
ALLOWED = {
    "package": {"core", "client", "lm"},
    "core": {"core", "package"},
    "daemon": {"core", "daemon", "package"},
    "client": {"core", "client", "package"},
    "lm": {"core", "client", "lm", "package"},
    "serve": {"core", "client", "lm", "serve", "package"},
    "lab": {"core", "daemon", "client", "lm", "lab", "package"},
    "cli": {"core", "daemon", "client", "lm", "serve", "lab", "cli", "package"},
}


def part_of(module: str) -> str:
    if module == "moe_l2":
        return "package"
    for name in ROOMS:
        if module == f"moe_l2.{name}" or module.startswith(f"moe_l2.{name}."):
            return name
    if module.startswith("moe_l2."):
        return "core"
    raise AssertionError(f"{module} is not a moe_l2 module")


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports_of(module: str, path: Path) -> set[str]:
    """The moe_l2 modules this file imports, resolved to absolute names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "moe_l2"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "moe_l2":
                continue
            # `from moe_l2 import protocol` imports the module moe_l2.protocol.
            names = {f"{target}.{a.name}" for a in node.names}
            out |= {n for n in names if n in modules() or n == "moe_l2._native"} or {target}
    return out


def test_every_source_module_belongs_to_a_part():
    for module in modules():
        part_of(module)


def test_no_module_imports_across_a_forbidden_boundary():
    wrong = []
    for module, path in modules().items():
        for target in imports_of(module, path):
            if part_of(target) not in ALLOWED[part_of(module)]:
                wrong.append(f"{path.relative_to(ROOT)}: {part_of(module)} module {module} imports "
                             f"{part_of(target)} module {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_among_modules():
    graph = {m: {t for t in imports_of(m, p) if t != m} for m, p in modules().items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is not a cycle worth flagging.
            if nxt.startswith(node + "."):
                continue
            if seen.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])


def test_test_modules_do_not_import_each_other():
    wrong = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1].startswith("test_"):
                wrong.append(f"{path.name} imports {node.module}: shared helpers belong in conftest.py")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The rules above would catch a daemon module importing the client (guards the checker itself)."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from moe_l2.client.pool import ExpertPool\n")
    assert imports_of("moe_l2.daemon.fake", fake) == {"moe_l2.client.pool"}
    assert part_of("moe_l2.client.pool") not in ALLOWED[part_of("moe_l2.daemon.fake")]
