"""moe-l2d --metrics (scraped over HTTP from a real daemon), journald priorities, and --version."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_l2 import __version__, protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.daemon.config import ConfigError, build_parser, resolve

from .conftest import budget_for, quarter_budget, stats, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """{(name, labels...): value} of every sample."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_carry_the_figures_of_stats(daemon_factory, model_dir, model_files):
    port = free_port()
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)), "--metrics", f"127.0.0.1:{port}")
    client = L2Client(model_files, daemon.socket, wait_s=5)
    pool = ExpertPool(model_files, capacity=4, client=client)
    try:
        for layer in range(model_files.n_layers):
            pool.fetch(layer, [0, 1, 2, 3])
        wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 4 * model_files.n_layers, what="loads")
        for layer in range(model_files.n_layers):
            pool.fetch(layer, [4, 5, 6, 7])  # evicts 0..3 from L0
            pool.fetch(layer, [0, 1, 2, 3])  # L2 hits
        n = model_files.n_layers  # reports travel on the client's own thread: wait until all are counted
        wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 8 * n and stats(daemon)["models"][0]["hits"]
                 == 4 * n, what="the reports and loads")
        samples = scrape(port)
        s = stats(daemon)
        assert s["daemon"]["clients"] == 1
    finally:
        pool.close()
        client.close()
    m = s["models"][0]
    model = ("model", str(model_dir))
    assert m["hits"] == 4 * model_files.n_layers > 0
    for metric, key in (("moe_l2_hits_total", "hits"), ("moe_l2_misses_total", "misses"),
                        ("moe_l2_loads_total", "loads_done"), ("moe_l2_disk_read_bytes_total", "bytes_loaded"),
                        ("moe_l2_served_bytes_total", "bytes_served"), ("moe_l2_slots_per_layer", "slots_per_layer")):
        assert samples[(metric, model)] == m[key], metric
    for i, layer in enumerate(m["layers"]):
        labels = (("layer", str(i)), model)
        assert samples[("moe_l2_layer_hits_total", *labels)] == layer["hits"] == 4
        assert samples[("moe_l2_layer_misses_total", *labels)] == layer["misses"] == 8
        assert samples[("moe_l2_layer_resident", *labels)] == layer["resident"]
        assert samples[("moe_l2_layer_slots", *labels)] == layer["slots"] == m["slots_per_layer"]
    assert samples[("moe_l2_clients",)] == 1
    assert samples[("moe_l2_shm_bytes",)] == s["daemon"]["shm_bytes"]
    assert samples[("moe_l2_memory_floor_bytes",)] == s["daemon"]["memory"]["floor"]


def parse(*argv: str):
    return resolve(build_parser().parse_args(["--model", "m", "--budget", "1GiB", *argv]))


def test_metrics_stay_on_loopback_unless_asked():
    assert parse("--metrics", "127.0.0.1:9464").metrics == ("127.0.0.1", 9464)
    assert parse("--metrics", "[::1]:9464").metrics == ("::1", 9464)
    assert parse("--metrics", "localhost:9464").metrics == ("localhost", 9464)
    with pytest.raises(ConfigError, match="--metrics-public"):
        parse("--metrics", "0.0.0.0:9464")
    assert parse("--metrics", "0.0.0.0:9464", "--metrics-public").metrics == ("0.0.0.0", 9464)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse("--metrics", "9464")


def test_a_busy_metrics_port_is_a_clear_start_error(daemon_factory, model_dir, model_files):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            daemon_factory([model_dir], quarter_budget(model_files), "--metrics", f"127.0.0.1:{port}")


def test_log_lines_carry_journald_priorities_under_systemd(daemon_factory, model_dir, model_files, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:4242")
    daemon = daemon_factory([model_dir], quarter_budget(model_files))
    reply = request(daemon.socket, protocol.Pin(id=1, model="nope", layer=0, experts=[1]))
    assert not reply.ok  # logged as a warning
    wait_for(lambda: "refused request" in daemon.log(), what="the warning")
    lines = [line for line in daemon.log().splitlines() if line.strip()]
    assert any(line.startswith("<6>moe-l2d INFO") and "ready on" in line for line in lines)
    assert any(line.startswith("<4>moe-l2d.server WARNING refused request") for line in lines)
    assert all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines


def test_without_journald_log_lines_have_timestamps(running_daemon):
    line = next(line for line in running_daemon.log().splitlines() if "ready on" in line)
    assert not line.startswith("<") and line[:4].isdigit()


def test_both_commands_print_their_version():
    for module, name in (("moe_l2.daemon.main", "moe-l2d"), ("moe_l2.cli", "moe-l2")):
        out = subprocess.run([sys.executable, "-P", "-m", module, "--version"], capture_output=True, text=True,
                             check=True).stdout
        assert out.strip().endswith(__version__) and name in out
