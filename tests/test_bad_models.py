"""Damaged and hostile models against the real tools (issue 37, docs/security.md "Damaged model data"): moe-l2d,
`moe-l2 verify` and `moe-l2 generate`, each run as a subprocess on a model our generator wrote and then damaged,
must end with exit 1 and one clear error: never a hang (each run has a timeout), a traceback or unbounded memory
(the runs have an address-space limit, so that a regression fails here instead of taking the machine)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys

import pytest

from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.lab.random_models import make_gguf_model

# Address space a tool may take: healthy runs here take well under it; a million decoder layers built took 12 GB
# of memory (issue 37).
MEMORY_LIMIT = 4 << 30
TOOL_TIMEOUT_S = 120


def _limited() -> None:
    # Linux only: Metal reserves far more address space than it uses, so on macOS the limit could stop a healthy
    # run; the timeout still guards there.
    if sys.platform == "linux":
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _commands(model, runtime_dir) -> dict[str, list[str]]:
    moe_l2 = shutil.which("moe-l2")
    return {
        "moe-l2d": [sys.executable, "-P", "-m", "moe_l2.daemon.main", "--runtime-dir", str(runtime_dir),
                    "--model", str(model), "--budget", "64MiB"],
        "verify": [moe_l2, "verify", "--model", str(model), "--no-daemon"],
        "generate": [moe_l2, "generate", "--model", str(model), "--no-daemon", "--max-tokens", "4"],
    }


def assert_every_tool_refuses(model, says: str) -> None:
    """Run the three tools side by side on the model; each must exit 1 within the timeout, saying `says`,
    without a traceback."""
    runtime_dir = short_tempdir()
    try:
        runs = {tool: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       preexec_fn=_limited)
                for tool, cmd in _commands(model, runtime_dir).items()}
        failures = []
        for tool, proc in runs.items():
            try:
                out, err = proc.communicate(timeout=TOOL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                failures.append(f"{tool} hung (killed after {TOOL_TIMEOUT_S} s):\n{err[-2000:]}")
                continue
            if proc.returncode != 1 or says not in err or "Traceback" in err:
                failures.append(f"{tool} exited with {proc.returncode}, expected 1 and {says!r}:\n{out[-1000:]}"
                                f"\n{err[-3000:]}")
        assert not failures, "\n\n".join(failures)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.fixture
def copy_of(tmp_path, model_dir):
    """A private copy of the session's model, free to damage."""
    shutil.copytree(model_dir, tmp_path / "model")
    return tmp_path / "model"


def _edit_config(model, **values) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **values}))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_fifo_in_the_model_directory_is_refused_without_waiting(copy_of, name):
    (copy_of / name).unlink()
    os.mkfifo(copy_of / name)  # no writer ever comes: an open or a read would wait for ever
    assert_every_tool_refuses(copy_of, f"{copy_of / name} is a FIFO, not a regular file")


@pytest.mark.parametrize("key,says", [
    ("num_hidden_layers", "num_hidden_layers is 1000000, but the files' tensors hold 3 decoder layers at most"),
    ("num_experts", "num_experts is 1000000, but the files' tensors hold 16 experts at most"),
    ("hidden_size", "layer 0 down_proj.weight has 128 rows, but mlx-lm's model for config.json has 1000000"),
    ("moe_intermediate_size", "layer 0 gate_proj.weight has 64 rows, but mlx-lm's model for config.json has 1000000"),
])
def test_config_values_the_files_cannot_hold_are_refused_before_anything_is_built(copy_of, key, says):
    _edit_config(copy_of, **{key: 10**6})  # a million decoder layers took 12 GB and minutes to build
    assert_every_tool_refuses(copy_of, says)


def test_a_deeply_nested_safetensors_header_is_refused(copy_of):
    header = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (copy_of / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert_every_tool_refuses(copy_of, "(JSON nested more than 32 deep)")


def test_a_gguf_tensor_at_a_misaligned_offset_is_refused(tmp_path):
    from gguf import GGUFReader

    path = make_gguf_model(tmp_path / "gguf" / "model.gguf")
    reader = GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    tensor.field.parts[5][0] += 1  # its offset in the data, written through the map
    reader.data.flush()
    del reader
    assert_every_tool_refuses(path, "tensor 'blk.1.ffn_up_exps.weight' starts at byte")


def test_a_model_truncated_while_generating_ends_with_one_clear_error(copy_of):
    """The shard is cut short after generate has loaded the model and printed text: the next expert it reads
    from the file names the record, the file and what to do."""
    shard = copy_of / "model.safetensors"
    (header_len,) = struct.unpack("<Q", shard.read_bytes()[:8])
    cmd = [shutil.which("moe-l2"), "generate", "--model", str(copy_of), "--no-daemon", "--max-tokens", "300",
           "--l0-slots", "4", "--prefetch", "off"]  # L0 of one token's experts: most tokens read the file
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_limited)
    try:
        assert proc.stdout.read(1), "generate printed nothing"  # text comes as it is generated
        os.truncate(shard, 8 + header_len + 64)
        err = proc.communicate(timeout=TOOL_TIMEOUT_S)[1].decode()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1 and "Traceback" not in err, err
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"moe-l2 generate: {copy_of}: MoE layer "), err
    assert f"cannot be read from {shard} (" in message and "unexpected end of file" in message, message
    assert f"`moe-l2 verify --model {copy_of} --all` lists every damaged record" in message, message



def test_a_shard_swapped_for_a_fifo_after_the_open_is_refused_by_verify(copy_of, monkeypatch, capsys):
    """The window between ModelFiles.open and the pool's own open of the files: open_regular refuses the FIFO
    there too, and verify says so instead of a traceback (or a hang)."""
    import argparse

    from moe_l2.cli import verify
    from moe_l2.model import ModelFiles

    opened = ModelFiles.open

    def open_then_swap(path):
        files = opened(path)
        (copy_of / "model.safetensors").unlink()
        os.mkfifo(copy_of / "model.safetensors")
        return files

    monkeypatch.setattr(ModelFiles, "open", open_then_swap)
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    assert verify.run(parser.parse_args(["--model", str(copy_of), "--no-daemon"])) == 1
    assert f"{copy_of / 'model.safetensors'} is a FIFO, not a regular file" in capsys.readouterr().err
