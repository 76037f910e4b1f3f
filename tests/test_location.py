"""Models named by Hugging Face repo id, resolved through a real hub cache layout in a temp dir, and `~` / `$VAR`
in every path (moe_l2.model.location; docs/architecture.md, "Models and paths")."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2.cli import main as moe_l2_main
from moe_l2.lm.generation import encode_prompt
from moe_l2.daemon.config import ConfigError, build_parser, resolve
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir
from moe_l2.model import ModelFiles
from moe_l2.model.location import ModelNotFound, PathError, expand_path, expand_socket, resolve_model

from .conftest import quarter_budget, stats

REPO = "acme/qwen3-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "Which experts does the router pick for this sentence?"


def hub_layout(cache: Path, repo: str, source: Path, commit: str = COMMIT) -> Path:
    """`source`'s files laid out as huggingface_hub downloads them: blobs named by their hash, the snapshot's
    files relative symlinks to them, refs/main naming the commit. Returns the snapshot directory."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory, model_dir) -> tuple[Path, Path]:
    """(HF_HOME, the snapshot directory of REPO in HF_HOME/hub)."""
    home = tmp_path_factory.mktemp("hf-home")
    return home, hub_layout(home / "hub", REPO, model_dir)


@pytest.fixture
def offline(monkeypatch, hub) -> Path:
    """HF_HOME pointing at the temp cache, offline; returns the snapshot directory."""
    home, snapshot = hub
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


@pytest.fixture
def silent_hub(monkeypatch):
    """HF_ENDPOINT at a local listener that counts connections, online: any download attempt reaches it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")

    def connections() -> int:
        n = 0
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    yield connections
    listener.close()


# ---- the resolver ---------------------------------------------------------------------------------------------


def test_a_repo_id_resolves_to_its_snapshot_through_hf_home_and_hf_hub_cache(offline, monkeypatch, hub, model_dir):
    assert resolve_model(REPO) == offline
    assert resolve_model(f"{REPO}@{COMMIT}") == offline
    assert ModelFiles.open(resolve_model(REPO)).read_record(1, 5) == ModelFiles.open(model_dir).read_record(1, 5)
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0] / "hub"))  # HF_HUB_CACHE wins over HF_HOME
    assert resolve_model(REPO) == offline


def test_a_directory_wins_and_tilde_and_variables_expand(model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(model_dir.parent))
    monkeypatch.setenv("MODELS", str(model_dir.parent))
    assert resolve_model(f"~/{model_dir.name}") == model_dir
    assert resolve_model(f"$MODELS/{model_dir.name}") == model_dir
    assert resolve_model(f"${{MODELS}}/{model_dir.name}") == model_dir
    assert expand_socket("ipc://~/moe-l2d.sock") == f"ipc://{model_dir.parent}/moe-l2d.sock"
    assert expand_socket("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(PathError, match=r"\$NOT_SET_ANYWHERE, which is not set"):
        expand_path("$NOT_SET_ANYWHERE/model")


def test_a_missing_model_says_what_to_do(offline, tmp_path):
    with pytest.raises(ModelNotFound, match="no model directory at .*: give an mlx-lm model directory"):
        resolve_model(tmp_path / "absent")
    with pytest.raises(ModelNotFound) as missing:
        resolve_model("acme/absent")
    message = str(missing.value)
    assert "not in the Hugging Face cache at" in message and str(offline.parents[2]) in message
    assert "moe-l2 generate --model acme/absent" in message and "hf download acme/absent" in message
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE is set: unset it to download"):
        resolve_model("acme/absent", download=True)
    with pytest.raises(ModelNotFound, match=f"hf download {REPO} --revision v9"):
        resolve_model(f"{REPO}@v9")


# ---- every --model --------------------------------------------------------------------------------------------


def test_generate_by_repo_id_gives_the_whole_models_tokens(capsys, offline, model_dir):
    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, PROMPT)
    expected = [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=10)]
    assert moe_l2_main(["generate", "--model", REPO, "--prompt", PROMPT, "--no-daemon", "--max-tokens", "10",
                        "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["tokens"] == expected and s["model"] == str(offline)


def test_generate_of_a_missing_repo_id_offline_says_so(capsys, offline):
    assert moe_l2_main(["generate", "--model", "acme/absent", "--prompt", "hi", "--no-daemon"]) == 1
    assert "acme/absent is not in the Hugging Face cache" in capsys.readouterr().err


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", *args], capture_output=True, text=True,
                          timeout=240, env=env)


def test_verify_and_pack_take_a_repo_id_and_expand_out(offline, tmp_path, model_dir):
    env = dict(os.environ, OUT_ROOT=str(tmp_path))
    verify = cli("verify", "--model", REPO, "--no-daemon", "--samples", "12", env=env)
    assert verify.returncode == 0, verify.stderr
    assert f"checked 12 experts of {offline}" in verify.stdout and "0 mismatches" in verify.stdout
    pack = cli("pack", "--model", REPO, "--out", "$OUT_ROOT/packed", "--quiet", "--verify", "full",
               "--moe-l2-only", env=env)
    assert pack.returncode == 0, pack.stderr
    packed = ModelFiles.open(tmp_path / "packed")
    source = ModelFiles.open(model_dir)
    assert packed.format == "packed"
    assert all(packed.read_record(layer, e) == source.read_record(layer, e)
               for layer in range(source.n_layers) for e in range(source.n_experts))


def test_the_daemon_serves_a_repo_id_given_as_a_flag(offline, daemon_factory, model_files, capsys, tmp_path):
    daemon = daemon_factory([REPO], quarter_budget(model_files))
    assert [m["path"] for m in stats(daemon)["models"]] == [str(offline)]
    # profile --from-daemon --model finds the served model by the same repo id.
    assert moe_l2_main(["profile", "--from-daemon", "--socket", daemon.socket, "--model", REPO,
                        "--out", str(tmp_path / "p.json")]) == 0, capsys.readouterr().err
    assert f"wrote {tmp_path / 'p.json'}" in capsys.readouterr().out
    assert moe_l2_main(["profile", "--from-daemon", "--socket", daemon.socket, "--model", "acme/absent",
                        "--out", str(tmp_path / "q.json")]) == 1
    assert "the daemon does not serve acme/absent" in capsys.readouterr().err


def test_the_daemon_serves_a_repo_id_given_in_the_toml(offline, model_files, tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL_ID", REPO)
    config = tmp_path / "moe-l2d.toml"
    config.write_text(f'[[model]]\npath = "$MODEL_ID"\nbudget = "{quarter_budget(model_files)}"\n')
    runtime = short_tempdir()
    process = DaemonProcess(["--config", str(config)], runtime_dir=runtime)
    try:
        process.start()
        assert [m["path"] for m in stats(process)["models"]] == [str(offline)]
    finally:
        process.stop()
        process.unlink_leftovers()
        shutil.rmtree(runtime, ignore_errors=True)


def test_the_daemon_never_downloads_and_names_the_command_that_does(hub, silent_hub, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub[0]))
    runtime = short_tempdir()
    try:
        result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", "acme/absent",
                                 "--budget", "64MiB", "--runtime-dir", str(runtime)],
                                capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert result.returncode == 1
    assert "cannot serve acme/absent: acme/absent is not a model directory and not in the Hugging Face cache" \
        in result.stderr
    assert "moe-l2 generate --model acme/absent" in result.stderr and "Traceback" not in result.stderr
    assert silent_hub() == 0


# ---- `~` and `$VAR` in flags and the TOML -----------------------------------------------------------------------


def test_toml_paths_expand_tilde_and_variables(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MODELS", str(model_dir.parent))
    config = tmp_path / "moe-l2d.toml"
    config.write_text(f'runtime_dir = "~/run"\nsocket = "ipc://$HOME/d.sock"\n'
                      f'[[model]]\npath = "$MODELS/{model_dir.name}"\nbudget = "1GiB"\nprofile = "~/p.json"\n')
    resolved = resolve(build_parser().parse_args(["--config", "~/moe-l2d.toml"]))
    assert resolved.runtime_dir == tmp_path / "run" and resolved.socket == f"ipc://{tmp_path}/d.sock"
    assert resolved.models[0].path == model_dir and resolved.models[0].profile == tmp_path / "p.json"
    flags = resolve(build_parser().parse_args(["--model", "~/m", "--budget", "1GiB",
                                               "--runtime-dir", "$HOME/rt", "--profile", "$HOME/p.json"]))
    assert flags.models[0].path == tmp_path / "m" and flags.models[0].profile == tmp_path / "p.json"
    assert flags.runtime_dir == tmp_path / "rt"
    assert flags.socket == f"ipc://{tmp_path}/rt/moe-l2d.sock"
    config.write_text('[[model]]\npath = "$UNSET_MODEL_ROOT/m"\nbudget = "1GiB"\n')
    monkeypatch.delenv("UNSET_MODEL_ROOT", raising=False)
    with pytest.raises(ConfigError, match=r"path of a \[\[model\]\] .*\$UNSET_MODEL_ROOT, which is not set"):
        resolve(build_parser().parse_args(["--config", str(config)]))


def test_command_flags_expand_tilde_and_variables(capsys, model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(model_dir.parent))
    monkeypatch.setenv("TRACES", str(tmp_path))
    assert moe_l2_main(["generate", "--model", f"~/{model_dir.name}", "--prompt", "hi", "--no-daemon",
                        "--max-tokens", "2", "--json", "--trace-out", "$TRACES/t.jsonl.gz"]) == 0
    assert json.loads(capsys.readouterr().out)["trace_out"] == str(tmp_path / "t.jsonl.gz")
    assert (tmp_path / "t.jsonl.gz").stat().st_size > 0
    assert moe_l2_main(["stats", "--socket", "ipc://$TRACES/none.sock"]) == 1
    assert f"no moe-l2d at ipc://{tmp_path}/none.sock" in capsys.readouterr().err
