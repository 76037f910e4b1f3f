"""moe-l2d --metrics (scraped over HTTP from a real daemon, and attacked by other local users: docs/security.md,
"The metrics endpoint"), journald priorities, and --version."""

from __future__ import annotations

import http.client
import json
import select
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from moe_l2 import __version__, protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.cli.stats import render
from moe_l2.daemon.config import ConfigError, build_parser, resolve
from moe_l2.daemon.http import MAX_CONNECTIONS, MAX_HEAD_BYTES
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir

from .conftest import AS_NOBODY, budget_for, free_port, scrape, nobody_runs_python, quarter_budget, retire, stats, wait_for

REFUSAL = "metrics endpoint at its limit"


def scrapes(port: int) -> bool:
    """Whether a scrape gets the metrics now (a connection past the cap is closed unanswered)."""
    try:
        return ("moe_l2_uptime_seconds",) in scrape(port)
    except (OSError, http.client.HTTPException):
        return False


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
        # Without load-through every miss was read by the client itself: its own disk share, in its row too.
        tiers = pool.counts.by_source()
        assert tiers == {"l0": 0, "l2": 4 * n, "daemon_disk": 0, "own_disk": 8 * n}
        wait_for(lambda: stats(daemon)["daemon"]["client_list"][0]["tiers"] == tiers, what="the client's lookups")
        samples = scrape(port)
        s = stats(daemon)
        assert s["daemon"]["clients"] == 1
        assert "L0 0.0%  L2 33.3%  disk 66.7% (read by moe-l2d while waiting 0.0%, by the client 66.7%) of " \
            in render(s).splitlines()[-1]
    finally:
        pool.close()
        client.close()
    m = s["models"][0]
    model = ("model", str(model_dir))
    assert m["hits"] == 4 * model_files.n_layers > 0
    for metric, key in (("moe_l2_hits_total", "hits"), ("moe_l2_misses_total", "misses"),
                        ("moe_l2_loads_total", "loads_done"), ("moe_l2_disk_read_bytes_total", "loaded_bytes"),
                        ("moe_l2_served_bytes_total", "served_bytes"), ("moe_l2_slots_per_layer", "slots_per_layer")):
        assert samples[(metric, model)] == m[key], metric
    for i, layer in enumerate(m["layers"]):
        labels = (("layer", str(i)), model)
        assert samples[("moe_l2_layer_hits_total", *labels)] == layer["hits"] == 4
        assert samples[("moe_l2_layer_misses_total", *labels)] == layer["misses"] == 8
        assert samples[("moe_l2_layer_resident", *labels)] == layer["resident"]
        assert samples[("moe_l2_layer_slots", *labels)] == layer["slots"] == m["slots_per_layer"]
    assert m["tiers"] == tiers
    for source, count in tiers.items():
        assert samples[("moe_l2_lookups_total", model, ("source", source))] == count
    assert samples[("moe_l2_clients",)] == 1
    assert samples[("moe_l2_shm_bytes",)] == s["daemon"]["shm_bytes"]
    assert samples[("moe_l2_memory_floor_bytes",)] == s["daemon"]["memory"]["floor_bytes"]


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


@pytest.fixture
def metrics_daemon(daemon_factory, model_dir, model_files):
    """A real daemon with --metrics on a free loopback port: (daemon, port)."""
    port = free_port()
    return daemon_factory([model_dir], quarter_budget(model_files), "--metrics", f"127.0.0.1:{port}"), port


def ask(port: int, method: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def closed_unanswered(sock: socket.socket) -> bool:
    """Waits until the server closes `sock`; True if it sent nothing before closing (a close with our request
    unread is a reset)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_only_get_and_head_of_metrics_and_health_are_served(metrics_daemon):
    daemon, port = metrics_daemon
    status, body = ask(port, "GET", "/metrics")
    assert status == 200 and b"moe_l2_uptime_seconds" in body
    assert ask(port, "HEAD", "/metrics") == (200, b"")
    assert ask(port, "GET", "/health") == (200, b"ok\n")
    assert ask(port, "GET", "/metrics?x=1")[0] == 200
    for path in ("/", "/healthz", "/metrics/", "/favicon.ico", "/" + "a" * 1000):
        status, body = ask(port, "GET", path)
        assert status == 404 and b"/metrics" in body and len(body) < 200, path
    assert ask(port, "POST", "/metrics")[0] == 405
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 431 ")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"nonsense\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 400 ")
    assert daemon.proc.poll() is None


def test_a_request_head_that_never_ends_is_closed(metrics_daemon):
    """A header line every 0.2 s keeps the connection busy, yet it is closed once the head's time is up."""
    _, port = metrics_daemon
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        for i in range(300):
            sock.sendall(b"X-%d: 1\r\n" % i)
            if select.select([sock], [], [], 0.2)[0]:
                break
        else:
            pytest.fail("still open after 60 s of header lines")
        assert closed_unanswered(sock), "the connection answered a request whose head never ended"
    assert scrapes(port)


def test_past_the_connection_cap_the_oldest_is_closed_and_that_is_logged_once(metrics_daemon):
    """Idle connections held up to the cap do not keep scrapers out: each new one closes the oldest."""
    daemon, port = metrics_daemon
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        assert scrapes(port)
        assert closed_unanswered(held[0])
        wait_for(lambda: REFUSAL in daemon.log(), what="the log line of the cap")
        assert daemon.log().count(REFUSAL) == 1  # for 11 connections closed
    finally:
        for sock in held:
            sock.close()


def test_concurrent_scrapes_share_one_stats_request(metrics_daemon):
    """However many scrape at once, the daemon's server thread is asked for stats once, not once each."""
    daemon, port = metrics_daemon
    n = 16
    barrier = threading.Barrier(n)
    results = []

    def scraper():
        barrier.wait()
        results.append(ask(port, "GET", "/metrics")[0])

    before = stats(daemon)["daemon"]["requests"]
    threads = [threading.Thread(target=scraper) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    asked = stats(daemon)["daemon"]["requests"] - before - 1  # less this stats request itself
    assert results == [200] * n
    assert 1 <= asked < n / 2, asked


# The other user's script: open N connections to the port, say how many, hold them until stdin closes.
HOLD = """
import socket, sys
held = [socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) for _ in range(int(sys.argv[2]))]
print("held", len(held), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not (sys.platform == "linux" and shutil.which("prlimit") and nobody_runs_python()),
                    reason="needs root on Linux, util-linux setpriv and prlimit, and this interpreter runnable by "
                           "uid 65534, to hold connections as another user")
def test_idle_connections_of_another_user_leave_the_daemon_serving(model_dir, model_files):
    """Issue 20: 246 idle connections of uid nobody, then one `moe-l2 stats`, aborted the daemon (its descriptor
    table full). Here more connections than the daemon's descriptor limit are held."""
    nofile, n = 256, 300
    port = free_port()
    daemon = DaemonProcess.serving([model_dir], quarter_budget(model_files), "--metrics", f"127.0.0.1:{port}",
                                   runtime_dir=short_tempdir(), wrapper=("prlimit", f"--nofile={nofile}:4096"))
    holder = None
    try:
        daemon.start()
        holder = subprocess.Popen([*AS_NOBODY, sys.executable, "-P", "-c", HOLD, str(port), str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().split() == ["held", str(n)]
        out = subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", "stats", "--json", "--socket",
                              daemon.socket, "--timeout", "10"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["models"][0]["path"] == str(model_dir)
        assert scrapes(port)
        assert daemon.proc.poll() is None
        assert daemon.log().count(REFUSAL) == 1  # for n - MAX_CONNECTIONS + 1 connections closed at the cap
    finally:
        if holder is not None:
            holder.communicate(timeout=30)  # closes its stdin: it lets go of the connections
        retire([daemon])


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
