"""Shared fixtures: tiny real checkpoints made by our generator, and a real moe-l2d in a subprocess."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moe_l2.daemon.process import DaemonProcess, short_tempdir
from moe_l2.generator import make_model
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles


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


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []
    dirs: list[Path] = []

    def start(models, budget: str, *extra: str, runtime_dir: Path | None = None) -> DaemonProcess:
        directory = runtime_dir or short_tempdir()
        dirs.append(directory)
        daemon = DaemonProcess.serving(models, budget, *extra, runtime_dir=directory)
        started.append(daemon)
        return daemon.start()

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
    """The budget that buys exactly `slots` slots per layer."""
    return Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, slots)


@pytest.fixture
def running_daemon(daemon_factory, model_dir, model_files) -> DaemonProcess:
    """The real daemon on a temp socket and runtime dir, serving the default model with a quarter budget."""
    return daemon_factory([model_dir], quarter_budget(model_files))
