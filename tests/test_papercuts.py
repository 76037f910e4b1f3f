"""Issue 12.5: the distribution name, a missing daemon met at once, TOML mistakes as messages, a failed start's
log, hints without a profile, sizes in messages."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from moe_l2 import __version__, protocol
from moe_l2.client.connection import request
from moe_l2.lm.streamed_lm import l0_slots_for
from moe_l2.daemon.config import ConfigError, build_parser, resolve
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.runtime import no_daemon_message
from moe_l2.sizes import format_size

from .conftest import quarter_budget, stats

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("src", "daemon", "client", "lm", "serve", "cli", "lab", "bench")


def test_the_distribution_is_mlx_moe_l2_with_the_same_commands_and_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "mlx-moe-l2"
    assert set(project["scripts"]) == {"moe-l2", "moe-l2d"}
    assert importlib.metadata.version("mlx-moe-l2") == __version__
    assert {e.name for e in importlib.metadata.distribution("mlx-moe-l2").entry_points} >= {"moe-l2", "moe-l2d"}
    # No install line may name the other project on the package index.
    texts = [p for p in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "systemd").iterdir(),
                         *(p for room in ROOMS for p in (ROOT / room).rglob("*.py"))] if p.is_file()]
    wrong = [str(p.relative_to(ROOT)) for p in texts
             if "install moe-l2" in p.read_text() or "'moe-l2[" in p.read_text()]
    assert not wrong, f"install lines naming the moe-l2 distribution: {wrong}"


def test_a_missing_socket_file_is_refused_at_once(tmp_path):
    address = f"ipc://{tmp_path}/moe-l2d.sock"
    # A timeout far beyond the test's own: only the check of the socket file can end this request.
    with pytest.raises(ConnectionRefusedError, match=f"no moe-l2d at {address}: the socket file does not exist"):
        request(address, protocol.Stats(id=1), timeout_s=3600)
    result = subprocess.run([shutil.which("moe-l2"), "stats", "--socket", address, "--timeout", "3600"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and f"no moe-l2d at {address}" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_daemon_on_an_address_given_says_what_to_do_without_the_runtime_dir():
    message = no_daemon_message("tcp://127.0.0.1:9")
    assert "no moe-l2d answered on tcp://127.0.0.1:9" in message and "--socket tcp://127.0.0.1:9" in message
    assert "runtime dir" not in message  # it played no part in an address given


def config_of(tmp_path: Path, model_dir: Path, top: str = "", model: str = "") -> Path:
    path = tmp_path / "moe-l2d.toml"
    path.write_text(f'{top}\n[[model]]\npath = "{model_dir}"\nbudget = "1GiB"\n{model}\n')
    return path


def test_toml_mistakes_are_messages(tmp_path, model_dir):
    def resolved(**parts):
        return resolve(build_parser().parse_args(["--config", str(config_of(tmp_path, model_dir, **parts))]))

    assert resolved(top="shm_mode = 0o640").shm_mode == 0o640
    assert resolved(top='shm_mode = "640"').shm_mode == 0o640
    with pytest.raises(ConfigError, match=r'TOML reads shm_mode = 640 as a decimal number: write shm_mode = 0o640'):
        resolved(top="shm_mode = 640")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in the \[\[model\]\] of .*: bugdet, polcy"):
        resolved(model='bugdet = "2GiB"\npolcy = "lru"')
    result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--config",
                             str(config_of(tmp_path, model_dir, top="shm_mode = 640"))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "write shm_mode = 0o640" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_failed_start_does_not_say_it_stopped_serving(model_dir):
    runtime = short_tempdir()
    try:
        result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(model_dir),
                                 "--budget", "4KiB", "--runtime-dir", str(runtime), "--log-level", "info"],
                                capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert result.returncode == 1 and "cannot serve" in result.stderr and "too small" in result.stderr
    assert "stopped" not in result.stderr


def test_a_stopped_daemon_says_it_stopped(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], quarter_budget(model_files))
    daemon.stop()
    assert "moe-l2d stopped; segments unlinked" in daemon.log()


def test_a_hint_without_a_profile_is_an_answer_not_a_refused_request(running_daemon, model_files):
    reply = request(running_daemon.socket, protocol.Hint(id=7, model=model_files.fingerprint, text="integrals"))
    assert not reply.ok and reply.ename == "NoProfile"
    assert stats(running_daemon)["daemon"]["errors"] == 0
    bad = request(running_daemon.socket, protocol.Hint(id=8, model="no-such-model", text="integrals"))
    assert bad.ename == "UnknownModel" and stats(running_daemon)["daemon"]["errors"] == 1
    assert "refused request: NoProfile" not in running_daemon.log()


def test_sizes_in_messages_are_human_readable(model_files):
    with pytest.raises(ValueError) as small:
        l0_slots_for(model_files, budget="1KiB")
    need = model_files.top_k * model_files.n_layers * model_files.layout.stride
    assert "an L0 budget of 1.0 KiB" in str(small.value) and str(need) not in str(small.value)
    assert str(small.value).endswith(f"give at least {format_size(need)}")
