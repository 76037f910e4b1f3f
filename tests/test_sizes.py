"""The house's sizes (docs/architecture.md, "The tree"): no product function over MAX_FUNCTION lines and no source
file over MAX_FILE, so that a function does one job and a module is one noun. Product code is every room the wheel
ships (pyproject.toml, wheel.packages) and native/; tests/ and bench/ are not held to it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("src/moe_l2", "daemon", "client", "lm", "serve", "lab", "cli", "native")
MAX_FUNCTION = 100
MAX_FILE = 600


def sources(*suffixes: str) -> list[Path]:
    return sorted(p for room in ROOMS for p in (ROOT / room).rglob("*") if p.suffix in suffixes)


def test_no_source_file_is_over_the_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources(".py", ".cpp", ".h")
            if (n := len(p.read_text().splitlines())) > MAX_FILE]
    assert not long, f"files over {MAX_FILE} lines (split them by the nouns they hold):\n" + "\n".join(long)


def test_no_python_function_is_over_the_limit():
    long = []
    for path in sources(".py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - start + 1) > MAX_FUNCTION:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION} lines (split them by the jobs they do):\n" + "\n".join(long)


# What opens a function body: a parameter list's `)`, then qualifiers or a trailing return type, then `{`.
FUNCTION_HEAD = re.compile(r"\)\s*(?:(?:const|noexcept|override|final|mutable)\s*|->\s*[\w:<>,*& ]+?\s*)*$")
STRIPPED = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)


def cpp_functions(text: str) -> list[tuple[int, int, str]]:
    """(first line, lines, head) of each function whose body opens at namespace or class scope (depth 0 or 1):
    the text since the last `;`, `{` or `}` before its `{` ends with a parameter list."""
    code = STRIPPED.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    out, depth, head_from, body = [], 0, 0, None  # body: (depth it opened at, offset of its head)
    for i, ch in enumerate(code):
        if ch == "{":
            head = code[head_from:i]
            if body is None and depth <= 1 and FUNCTION_HEAD.search(head):
                body = (depth, head_from + len(head) - len(head.lstrip()))
            depth += 1
        elif ch == "}":
            depth -= 1
            if body is not None and depth == body[0]:
                first = code.count("\n", 0, body[1]) + 1
                out.append((first, code.count("\n", 0, i) + 2 - first, " ".join(code[body[1]:].split(")")[0].split())))
                body = None
        if ch in ";{}":
            head_from = i + 1
    return out


def test_no_native_function_is_over_the_limit():
    long = [f"{p.relative_to(ROOT)}:{first} {header[:80]}: {n} lines" for p in sources(".cpp")
            for first, n, header in cpp_functions(p.read_text()) if n > MAX_FUNCTION]
    assert not long, f"functions over {MAX_FUNCTION} lines (split them by the jobs they do):\n" + "\n".join(long)


def test_the_native_scan_sees_a_long_function():
    body = "int f(int a,\n      int b) const {\n" + "  a += b; // }\n" * 120 + "  return a;\n}\n"
    assert [(first, n) for first, n, _ in cpp_functions("namespace x {\nstruct S {};\n" + body + "}\n")] == [(3, 124)]


def test_the_design_doc_is_a_design():
    """docs/architecture.md is the design, at most 400 lines; figures and history go to benchmarks.md and
    decisions.md (issue 38.8)."""
    lines = len((ROOT / "docs" / "architecture.md").read_text().splitlines())
    assert lines <= 400, f"docs/architecture.md has {lines} lines: move figures and history to benchmarks.md or " \
                         "decisions.md"
