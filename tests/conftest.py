"""Shared fixtures: tiny real checkpoints made by our generator, and a real moe-l2d in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moe_l2 import _native
from moe_l2.generator import make_model
from moe_l2.model import ModelFiles


def short_tempdir() -> Path:
    # ipc:// paths must fit sun_path (~104 bytes); pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="ml2-", dir="/tmp"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """qwen3_moe, 3 MoE layers x 16 experts, 4-bit: the default subject of daemon and client tests."""
    out = tmp_path_factory.mktemp("models") / "qwen3-4bit"
    make_model(out, arch="qwen3_moe", layers=3, experts=16, top_k=4, hidden_size=128, moe_hidden_size=64,
               bits=4, seed=1)
    return out


@pytest.fixture(scope="session")
def model_files(model_dir) -> ModelFiles:
    return ModelFiles.open(model_dir)


class DaemonProcess:
    """moe-l2d as systemd would run it: a subprocess that says READY=1 on $NOTIFY_SOCKET when serving."""

    def __init__(self, args: list[str], runtime_dir: Path, prefix: tuple[str, ...] = (), socket: str | None = None):
        self.args = args
        self.runtime_dir = runtime_dir
        self.prefix = prefix  # e.g. setpriv ... to run it as another user
        self.socket = socket or f"ipc://{runtime_dir / 'moe-l2d.sock'}"
        self.proc: subprocess.Popen | None = None
        self.stderr_path = runtime_dir / "daemon.log"

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        notify_path = self.runtime_dir / "notify"
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        os.chmod(notify_path, 0o666)  # a daemon run as another user must reach it too
        notify.settimeout(0.2)
        env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), MOE_L2_RUNTIME_DIR=str(self.runtime_dir))
        with open(self.stderr_path, "ab") as log:
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-P", "-m", "moe_l2.daemon.main", *self.args],
                                         stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    if b"READY=1" in notify.recv(4096):
                        return self
                except TimeoutError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moe-l2d exited with {self.proc.returncode}:\n{self.log()}")
            raise RuntimeError(f"moe-l2d not ready after {timeout} s:\n{self.log()}")
        finally:
            notify.close()

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def unlink_leftovers(self) -> None:
        """Segments a killed daemon left (its successor would reclaim them; a test may start none)."""
        for state in self.runtime_dir.glob("moe-l2d-*.segments"):
            for name in json.loads(state.read_text()):
                _native.Segment.unlink(name)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []
    dirs: list[Path] = []

    def start(models, budget: str, *extra: str, runtime_dir: Path | None = None) -> DaemonProcess:
        directory = runtime_dir or short_tempdir()
        dirs.append(directory)
        args = [a for m in models for a in ("--model", str(m))] + ["--budget", budget, "--runtime-dir",
                                                                      str(directory), *extra]
        daemon = DaemonProcess(args, directory).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        daemon.unlink_leftovers()
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)


def quarter_budget(files: ModelFiles) -> str:
    """A budget whose slots hold a quarter of each layer's experts."""
    return str(budget_for(files, max(1, files.n_experts // 4)))


def budget_for(files: ModelFiles, slots: int) -> int:
    """The budget that buys exactly `slots` slots per layer (see daemon.served.plan_geometry)."""
    from moe_l2.layout import Geometry

    g = Geometry(files.n_layers, files.n_experts, files.n_experts, files.layout.nbytes)
    return g.index_bytes + slots * files.n_layers * g.slot_stride


@pytest.fixture
def running_daemon(daemon_factory, model_dir, model_files) -> DaemonProcess:
    """The real daemon on a temp socket and runtime dir, serving the default model with a quarter budget."""
    return daemon_factory([model_dir], quarter_budget(model_files))
