"""The README's snippets, from the checkout's root, as a newcomer runs them after the README's install: its Python
snippets run (on the suite's model, in a process started in the repository's root, where a folder named like the
package would shadow the installed one), and every `moe-l2` and `moe-l2d` line parses with the real parsers."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moe_l2.cli import build_parser
from moe_l2.daemon.config import build_parser as daemon_parser
from moe_l2.lab.random_models import make_model

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The README's model names, and the placeholders of its command lines, stand for the suite's model.
MODELS = ("mlx-community/Qwen3-30B-A3B-4bit", "~/models/Qwen3-30B-A3B-4bit")
# What the low-level snippet leaves to its reader: a layer, the router's picks and indices.
PRELUDE = "import mlx.core as mx\nlayer, experts, indices = 0, [0, 1], mx.array([0, 1])\n"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


@pytest.fixture(scope="module")
def readme_model(tmp_path_factory) -> Path:
    """Experts enough for the README's L0 of 32 rows a layer."""
    out = tmp_path_factory.mktemp("readme") / "qwen3-64-experts"
    make_model(out, arch="qwen3_moe", layers=2, experts=64, top_k=4, hidden_size=64, moe_hidden_size=32, bits=4,
               seed=3)
    return out


def test_the_readme_has_snippets_to_check():
    assert len(blocks("python")) >= 2 and len(command_lines()) >= 30


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_each_python_snippet_runs_from_the_checkouts_root(index, readme_model):
    code = blocks("python")[index]
    if "localhost:8080" in code:
        pytest.skip("talks to a moe-l2 serve of its own (test_messages.py runs the Anthropic client against one)")
    for name in MODELS:
        code = code.replace(name, str(readme_model))
    done = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"README snippet {index} failed from {ROOT}:\n{code}\n{done.stderr[-3000:]}"


def command_lines() -> list[list[str]]:
    """Every moe-l2 / moe-l2d command of the README's shell snippets, as argv (its program first): a line's words,
    cut at pipes, `&&` and `--` (mlx.launch's), optional parts ([--json]) taken."""
    out = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(re.sub(r"\[(--[^\]]*)\]", r"\1", line), posix=True, punctuation_chars="|&")
            lexer.whitespace_split = True
            command: list[str] = []
            for word in [*lexer, "|"]:
                if word in ("|", "||", "&&", "--"):
                    if command and command[0] in ("moe-l2", "moe-l2d"):
                        out.append(command)
                    command = []
                else:
                    command.append(word)
    return out


@pytest.mark.parametrize("argv", command_lines(), ids=lambda argv: " ".join(argv)[:60])
def test_each_command_line_parses_with_the_real_parser(argv, tmp_path):
    program, args = argv[0], [("DIR" if a in MODELS or a in ("A", "B") else a) for a in argv[1:]]
    if program == "moe-l2d":
        daemon_parser().parse_args(args)
    else:
        command = args[0] if args and not args[0].startswith("-") else None
        build_parser(command).parse_args(args)
