"""`moe-l2 stats --watch` against a real daemon: the frames printed to a pipe, the rich Live view on a
pseudo-terminal ended by Ctrl-C, and the interval rates computed from two real stats replies."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.cli.stats import model_rates

from .conftest import budget_for, stats, wait_for


def watch_command(daemon, *extra: str) -> list[str]:
    return [sys.executable, "-P", "-m", "moe_l2.cli", "stats", "--socket", daemon.socket, "--watch", *extra]


def traffic(daemon, files):
    """Per layer: picks 0,1,2,3,0,1 (6 picks, 4 L2 misses), then after the loads picks 4..7 and 0..3 with an
    L0 of 4 (8 picks: 4 misses, then 4 L2 hits). The client reads every miss itself (no load-through)."""
    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, capacity=4, client=client)
    n = files.n_layers
    for layer in range(n):
        pool.fetch(layer, [0, 1, 2, 3, 0, 1])
    wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 4 * n, what="loads")
    wait_for(lambda: stats(daemon)["models"][0]["tiers"] == pool.counts.by_source(), what="the lookups")
    before = stats(daemon)
    for layer in range(n):
        pool.fetch(layer, [4, 5, 6, 7])
        pool.fetch(layer, [0, 1, 2, 3])
    wait_for(lambda: stats(daemon)["models"][0]["hits"] == 4 * n and stats(daemon)["models"][0]["loads_done"]
             == 8 * n, what="reports")
    wait_for(lambda: stats(daemon)["models"][0]["tiers"] == pool.counts.by_source(), what="the lookups")
    return client, pool, before, stats(daemon)


def test_rates_between_two_replies_split_the_picks_by_tier(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)))
    client, pool, before, after = traffic(daemon, model_files)
    pool.close()
    client.close()
    n = model_files.n_layers
    first = model_rates(None, before["models"][0], 2.0)
    assert (first["picks"], first["l0"], first["l2"], first["l3"]) == (6 * n, 2 * n, 0, 4 * n)
    assert first["tiers"] == {"l0": 0, "l2": 0, "daemon_disk": 0, "own_disk": 4 * n}  # the batch's 4 experts
    assert first["disk_bytes_per_s"] == 4 * n * model_files.layout.nbytes / 2.0
    r = model_rates(before["models"][0], after["models"][0], 0.5)
    assert (r["picks"], r["l0"], r["l2"], r["l3"]) == (8 * n, 0, 4 * n, 4 * n)
    assert r["tiers"] == {"l0": 0, "l2": 4 * n, "daemon_disk": 0, "own_disk": 4 * n}
    assert r["disk_bytes_per_s"] == 4 * n * model_files.layout.nbytes / 0.5
    assert [layer["hit_rate"] for layer in r["layers"]] == [0.5] * n
    assert [layer["resident"] for layer in r["layers"]] == [8] * n


def test_watch_prints_frames_to_a_pipe(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)))
    client, pool, _, after = traffic(daemon, model_files)
    try:
        out = subprocess.run(watch_command(daemon, "--count", "2", "--interval", "0.1"), capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, COLUMNS="160"))
    finally:
        pool.close()
        client.close()
    assert out.returncode == 0, out.stderr
    frames = [f for f in out.stdout.split("─" * 20) if "moe-l2d" in f]
    assert len(frames) == 2
    n = model_files.n_layers
    # The first frame's rates are since the daemon started: of 12 lookups per layer (the 2 repeated picks are
    # looked up once), 4 copied from L2 and 8 read from disk by the client.
    assert after["models"][0]["tiers"] == {"l0": 0, "l2": 4 * n, "daemon_disk": 0, "own_disk": 8 * n}
    assert (f"since start: lookups L0 0.0%  L2 33.3%  disk 66.7% (read by moe-l2d while waiting 0.0%, by the "
            f"client 66.7%) of {12 * n}  |") in frames[0], frames[0]
    assert re.search(r"last 0\.\d s: lookups .* of 0  \|", frames[1]), frames[1]
    for i in range(n):  # per layer: slots, resident, loading, pinned, L2 hit rate 4/12
        assert re.search(rf"\n\s*{i}\s+8\s+8\s+0\s+0\s+33\.3%", frames[0]), frames[0]
    assert f":{os.getpid()}:" in frames[0] and f" {os.getpid()} " in frames[0]  # this process, by name and pid
    assert "1 client(s) attached" in frames[0]


def test_watch_live_view_on_a_terminal_ends_cleanly_on_ctrl_c(running_daemon):
    leader, follower = pty.openpty()
    proc = subprocess.Popen(watch_command(running_daemon, "--interval", "0.2"), stdin=follower, stdout=follower,
                            stderr=follower, env=dict(os.environ, TERM="xterm", COLUMNS="120", LINES="40"))
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and seen.count(b"client(s) attached") < 3:
            if select.select([leader], [], [], 0.5)[0]:
                seen += os.read(leader, 65536)
        assert seen.count(b"client(s) attached") >= 3, seen  # redrawn frame after frame
        assert b"\x1b[" in seen  # a terminal: the Live view moves the cursor to redraw in place
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            while select.select([leader], [], [], 0.2)[0]:
                seen += os.read(leader, 65536)
        except OSError:
            pass
        os.close(leader)
    assert b"Traceback" not in seen and b"L2 hit rate" in seen


def test_watch_into_a_pipe_closed_early_ends_quietly_with_0(running_daemon):
    """`moe-l2 stats --watch | head -1`: the reader leaves after one line; the watch ends with 0 and says nothing."""
    watcher = subprocess.Popen(watch_command(running_daemon, "--interval", "0.05"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert watcher.stdout.readline()
    watcher.stdout.close()  # what head does after its lines
    assert watcher.wait(timeout=60) == 0
    assert watcher.stderr.read() == ""
    watcher.stderr.close()
