"""moe-l2 stats and verify, run as a user runs them: the installed console script against a real daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from moe_l2 import __version__ as moe_l2_version
from moe_l2 import protocol
from moe_l2.client.connection import request

from .conftest import corrupt_in_place, stats, wait_for



def moe_l2(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = shutil.which("moe-l2")
    assert exe, "pip install . installs the moe-l2 console script"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def test_stats_json_and_table_agree_with_the_daemon(running_daemon, model_files):
    fp = model_files.fingerprint
    request(running_daemon.socket, protocol.Prefetch(id=1, model=fp, layer=1, experts=[3, 4]))
    wait_for(lambda: stats(running_daemon)["models"][0]["loads_done"] == 2, what="loads")
    result = moe_l2("stats", "--socket", running_daemon.socket, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (m,) = data["models"]
    assert [layer["resident"] for layer in m["layers"]] == [0, 2, 0]
    assert m["loads_done"] == 2 and m["load_latency_p50_s"] > 0
    assert data["daemon"]["pid"] == running_daemon.proc.pid
    table = moe_l2("stats", "--socket", running_daemon.socket)
    assert table.returncode == 0
    assert f"model {model_files.path}" in table.stdout
    assert "occupancy 2/12 slots" in table.stdout
    assert "    1         2        0       0" in table.stdout  # layer 1: 2 resident
    assert "fills: offered 0  donated 0" in table.stdout and m["fills"]["donated"] == 0


def test_stats_without_a_daemon_says_what_to_do(tmp_path):
    result = moe_l2("stats", "--socket", f"ipc://{tmp_path}/none.sock", "--timeout", "0.5")
    assert result.returncode == 1
    assert "no moe-l2d at" in result.stderr and "start the daemon" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_passes_on_a_healthy_daemon(running_daemon, model_dir, model_files):
    result = moe_l2("verify", "--model", str(model_dir), "--socket", running_daemon.socket, "--samples", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 mismatches" in result.stdout
    # verify's own misses made the daemon load experts; a second run finds some of them in L2.
    wait_for(lambda: stats(running_daemon)["models"][0]["loads_in_flight"] == 0, what="loads")
    again = moe_l2("verify", "--model", str(model_dir), "--socket", running_daemon.socket, "--samples", "60")
    assert again.returncode == 0 and " 0 from L2" not in again.stdout


def test_verify_catches_l2_bytes_that_differ_from_the_file(daemon_factory, tmp_path, model_dir, model_files):
    """Bit rot on disk after the daemon loaded the model: same size, same mtime, different bytes."""
    from .conftest import budget_for

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    from moe_l2.model import ModelFiles

    files = ModelFiles.open(model)
    daemon = daemon_factory([model], str(budget_for(files, files.n_experts)))
    for layer in range(files.n_layers):
        request(daemon.socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=layer,
                                                 experts=list(range(files.n_experts))))
    wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == files.n_layers * files.n_experts, what="loads")
    corrupt_in_place(files, 0, 0)
    result = moe_l2("verify", "--model", str(model), "--socket", daemon.socket, "--samples", "400")
    assert result.returncode == 1
    assert "MISMATCH layer 0 expert 0 (from L2)" in result.stdout


def test_make_model_cli_writes_a_loadable_checkpoint(tmp_path):
    from moe_l2.model import ModelFiles

    dims = ["--experts", "4", "--top-k", "2", "--hidden-size", "64", "--moe-hidden-size", "64", "--bits", "8"]
    result = moe_l2("make-model", "--arch", "mixtral", "--num-layers", "2", *dims, "--out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    assert "deprecated" not in result.stderr
    files = ModelFiles.open(tmp_path / "m")
    assert (files.n_layers, files.n_experts, files.top_k) == (2, 4, 2)
    # --layers, the count's old name, works for one release and says so; --layers names decoder layers elsewhere.
    old = moe_l2("make-model", "--arch", "mixtral", "--layers", "3", *dims, "--out", str(tmp_path / "old"))
    assert old.returncode == 0, old.stderr
    assert "moe-l2 make-model: --layers is deprecated: use --num-layers" in old.stderr
    assert ModelFiles.open(tmp_path / "old").n_layers == 3
    for bad in (["--num-layers", "two"], []):
        wrong = moe_l2("make-model", "--arch", "mixtral", *bad, *dims, "--out", str(tmp_path / "x"))
        assert wrong.returncode == 2 and "--num-layers" in wrong.stderr
    bad = moe_l2("make-model", "--arch", "mixtral", "--top-k", "9", "--experts", "4", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "top" in bad.stderr


def test_every_option_of_every_command_has_help_text():
    import argparse

    from moe_l2.cli import COMMANDS, build_parser

    missing = []
    for command in COMMANDS:
        (sub,) = [a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)]
        missing += [f"moe-l2 {command} {'/'.join(a.option_strings) or a.dest}"
                    for a in sub.choices[command]._actions if not a.help]
    from moe_l2.daemon.config import build_parser as daemon_parser

    missing += [f"moe-l2d {'/'.join(a.option_strings)}" for a in daemon_parser()._actions if not a.help]
    assert not missing, "options without help text: " + ", ".join(missing)
    assert len(COMMANDS) >= 9


def _entries_by_heading(help_text: str) -> dict[str, list[str]]:
    """A --help text as each section's heading -> the flags of the options listed under it."""
    sections: dict[str, list[str]] = {}
    heading = None
    for line in help_text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            heading = line[:-1]
            sections[heading] = []
        elif line.startswith("  -") and heading is not None:
            entry = line.strip().split("  ")[0]  # the flags and their metavar, before the help on the same line
            sections[heading] += [part.split()[0] for part in entry.split(", ")]
    return sections


def test_the_experimental_options_are_listed_under_their_heading_alone():
    """Every command that takes an experimental streaming option (client/options.py) lists it under the
    experimental heading of its --help and nowhere else, and nothing else there; generate and serve take them
    all. A command's option is the streaming one where its flag, destination and help are StreamOptions'."""
    import argparse
    import dataclasses

    from moe_l2.cli import COMMANDS, build_parser
    from moe_l2.client.options import EXPERIMENTAL, StreamOptions, add_arguments

    reference = argparse.ArgumentParser()
    add_arguments(reference)
    streaming = {a.option_strings[0]: a for a in reference._actions}
    experimental = {f.metadata["flag"] for f in dataclasses.fields(StreamOptions) if f.metadata.get("experimental")}
    assert experimental == {"--l0-grow", "--l0-ceilings", "--l0-autopin", "--prefetch", "--prefetch-from"}
    taken = {}
    for command in COMMANDS:
        (sub,) = [a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[command]
        takes = {a.option_strings[0] for a in parser._actions if a.option_strings
                 and a.option_strings[0] in experimental and a.dest == streaming[a.option_strings[0]].dest
                 and a.help == streaming[a.option_strings[0]].help}
        sections = _entries_by_heading(parser.format_help())
        for flag in takes:
            assert [h for h, flags in sections.items() if flag in flags] == [EXPERIMENTAL], (command, flag)
        assert {flag for flag in sections.get(EXPERIMENTAL, []) if not flag.startswith("--no-")} == takes, command
        if takes:
            taken[command] = takes
    assert taken == {"generate": experimental, "serve": experimental, "bench": {"--l0-grow"},
                     "plan": {"--l0-ceilings"}}


def test_version_and_short_prompt_flag():
    result = moe_l2("--version")
    assert result.returncode == 0 and result.stdout.split() == ["moe-l2", moe_l2_version]
    from moe_l2.cli import build_parser

    assert build_parser("generate").parse_args(["generate", "--model", "m", "-p", "hi"]).prompt == "hi"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["stats", "--help"], ["stats", "--socket", "NOWHERE"]])
def test_light_commands_import_neither_the_model_stack_nor_the_format_readers(argv, tmp_path):
    """Admins run `stats` in loops: it, --version and --help must not pay for importing the model stack, nor
    numpy and gguf (the model files' readers)."""
    argv = [f"ipc://{tmp_path / 'none.sock'}" if a == "NOWHERE" else a for a in argv]
    probe = ("import sys\nfrom moe_l2.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print('heavy:', sorted({m.split('.')[0] for m in sys.modules}\n"
             "                       & {'mlx_lm', 'transformers', 'mlx', 'numpy', 'gguf'}))")
    result = subprocess.run([sys.executable, "-P", "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == "heavy: []", result.stdout + result.stderr


def test_stats_refuses_a_crashed_daemons_socket_at_once(running_daemon):
    """A kill -9 leaves the socket file: stats says nobody listens there instead of waiting out its timeout."""
    running_daemon.kill9()
    result = moe_l2("stats", "--socket", running_daemon.socket, "--timeout", "600")
    assert result.returncode == 1 and "no moe-l2d listens at" in result.stderr, result.stderr


def test_a_renamed_flag_keeps_its_old_name_for_one_release(capsys):
    """commands/flags.py add_renamed: the new name, the old one saying on stderr it is deprecated, never both."""
    import argparse

    from moe_l2.cli.flags import add_renamed

    parser = argparse.ArgumentParser(prog="moe-l2 x")
    add_renamed(parser, "--num-layers", "--layers", type=int, required=True, help="decoder layers")
    add_renamed(parser, "--json", "--as-json", action="store_true", help="JSON")
    assert vars(parser.parse_args(["--num-layers", "3"])) == {"num_layers": 3, "json": False}
    assert capsys.readouterr().err == ""
    assert vars(parser.parse_args(["--layers", "4", "--as-json"])) == {"num_layers": 4, "json": True}
    err = capsys.readouterr().err.splitlines()
    assert err == ["moe-l2 x: --layers is deprecated: use --num-layers (the old name goes after the next release)",
                   "moe-l2 x: --as-json is deprecated: use --json (the old name goes after the next release)"]
    for argv, says in ((["--num-layers", "3", "--layers", "3"], "not allowed with"), ([], "--num-layers is required"),
                       (["--layers", "x"], "invalid int value")):
        with pytest.raises(SystemExit) as exit:
            parser.parse_args(argv)
        assert exit.value.code == 2 and says in capsys.readouterr().err
    assert "--layers" not in parser.format_usage() and "(was --layers)" in parser.format_help()
