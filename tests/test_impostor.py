"""Issue 37.5: a fake daemon, refused or not yet trusted, gets nothing into a client: nothing reaches its pool,
what it can make the client log is a few lines without terminal escapes, and a generate against it gives the
model's own tokens at the cost of a few frames a heartbeat (client/connection.py, docs/security.md); and what a
client told the daemon reaches another user's `moe-l2 stats` without its escapes.

The fake is a real ZeroMQ socket in its own process: a DEALER bound where the daemon would listen, which pushes
at every client that connects (no identity needed) frames shaped as the Loaded notices of older releases, of 16,384
ids and of this model's own experts, and refusals whose names and values change every time and carry escape
sequences; a hello gets such a refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2 import protocol
from moe_l2.cli import main as moe_l2_main
from moe_l2.client.connection import UNTRUSTED_FRAMES, L2Client, request
from moe_l2.lm.generation import encode_prompt
from moe_l2.client.pool import ExpertPool
from moe_l2.client.slot_waits import WaitCounts
from moe_l2.lab.daemon_process import short_tempdir

from .conftest import AS_NOBODY, NOBODY, assert_resident_exact, free_port, nobody_runs_python, wait_for

PROMPT = "Which experts does the router pick for this sentence?"

FAKE = r"""
import sys, msgpack, zmq
address, fingerprint, n_experts = sys.argv[1], sys.argv[2], int(sys.argv[3])
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(address)
print("listening", flush=True)
huge, own = list(range(16384)), list(range(n_experts))
i = 0
while True:
    i += 1
    while sock.poll(0):
        request = msgpack.unpackb(sock.recv())
        sock.send(msgpack.packb({"v": 1, "id": request["id"], "status": "error", "ename": f"\x1b[2JNo{i}",
                                 "evalue": f"\x1b]0;owned {i}\x07\x1b[31m" + "x" * 3000}))
    for frame in ({"v": 1, "type": "loaded", "model": fingerprint, "layer": i % 3, "experts": huge},
                  {"v": 1, "type": "loaded", "model": fingerprint, "layer": i % 3, "experts": own},
                  {"v": 1, "id": i, "status": "error", "ename": f"\x1b[31mBusy{i}", "evalue": f"\x1b]0;{i}\x07"}):
        try:
            sock.send(msgpack.packb(frame), zmq.NOBLOCK)
        except zmq.Again:  # no client connected, or its queue is full
            sock.poll(10)
"""


@pytest.fixture
def fake_daemon(model_files):
    """Factory: start FAKE on "ipc" (a socket in a directory of uid 65534, which runs it: the default runtime dir
    planted before the daemon made it) or "tcp" (a loopback port, run by this user: plain TCP proves nothing);
    returns its address."""
    started = []

    def start(transport: str) -> str:
        directory = short_tempdir()
        if transport == "ipc":
            os.chown(directory, NOBODY, NOBODY)
            directory.chmod(0o755)
            address, wrapper = f"ipc://{directory}/moe-l2d.sock", AS_NOBODY
        else:
            address, wrapper = f"tcp://127.0.0.1:{free_port()}", ()
        proc = subprocess.Popen([*wrapper, sys.executable, "-P", "-c", FAKE, address, model_files.fingerprint,
                                 str(model_files.n_experts)], stdout=subprocess.PIPE, text=True)
        started.append((proc, directory))
        assert proc.stdout.readline() == "listening\n"
        return address

    yield start
    for proc, directory in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        subprocess.run(["rm", "-rf", str(directory)], check=False)


def assert_took_nothing(client: L2Client, pool: ExpertPool) -> None:
    """Nothing of the fake reached the pool, and what the client read of it is bounded by its hellos and hang-ups."""
    assert not client.attached and client.attaches == 0
    assert pool.waits == WaitCounts()  # no wait on anything of the fake's
    link = client.counts
    assert link.frames <= link.hellos + (link.hang_ups + 1) * (UNTRUSTED_FRAMES + 1), link
    assert "\x1b" not in client.last_error and len(client.last_error) < 2200, client.last_error


@pytest.mark.parametrize("transport", [
    pytest.param("ipc", marks=pytest.mark.skipif(not nobody_runs_python(), reason="the fake runs as uid 65534: "
                                                 "needs root, setpriv and packages other users can read")),
    "tcp"])
def test_a_fake_daemon_gets_nothing_into_the_pool_and_a_few_clean_log_lines(fake_daemon, model_files, transport,
                                                                            caplog):
    address = fake_daemon(transport)
    with caplog.at_level("WARNING", logger="moe-l2.client"):
        client = L2Client(model_files, address, heartbeat_s=0.05, wait_s=0)
        pool = ExpertPool(model_files, capacity=4, client=client, load_through_s=5.0, lend=False)
        try:
            if transport == "ipc":  # refused at every heartbeat, before any connection is made
                wait_for(lambda: client.counts.refused >= 3, what="three refusals")
                assert client.counts.frames == 0 and client.counts.hellos == 0
            else:  # said hello, and hung up on the flood that came instead of a reply
                wait_for(lambda: client.counts.hang_ups >= 3, what="three connections closed for their flood")
            counts = pool.fetch(1, [3, 7])
            assert counts.l3_reads == 2 and counts.l2_awaited == 0
            assert_resident_exact(pool, model_files, 1, [3, 7])
            assert_took_nothing(client, pool)
        finally:
            pool.close()
            client.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\x1b" not in lines[0], lines  # once per kind a minute (client/log_limit.py)
    assert ("refusing moe-l2d" if transport == "ipc" else "before passing its hello's checks") in lines[0]


@pytest.mark.slow
def test_a_generate_against_a_flooding_fake_daemon_gives_the_models_tokens(fake_daemon, model_dir):
    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, PROMPT)
    expected = [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=12)]
    address = fake_daemon("tcp")
    run = subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", "generate", "--model", str(model_dir), "--prompt",
                          PROMPT, "--socket", address, "--max-tokens", "12", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    s = json.loads(run.stdout)
    assert s["tokens"] == expected
    daemon = s["daemon"]
    assert not daemon["attached"] and daemon["waits"] == {"waits": 0, "woken": 0, "expired": 0, "waited_s": 0.0}
    link = daemon["link"]
    assert link["frames"] <= link["hellos"] + (link["hang_ups"] + 1) * (UNTRUSTED_FRAMES + 1), link
    # The flood's line, the client's "no moe-l2d answered" and the generate's "not attached"; no escape in them.
    assert len(run.stderr.splitlines()) <= 3 and "\x1b" not in run.stderr, run.stderr[-4000:]


def test_a_client_name_with_escapes_reaches_stats_written_as_escapes(running_daemon, model_dir, model_files,
                                                                    capsys):
    hostile = "evil\x1b]0;owned\x07\x1b[2J\u202e"  # a title, a cleared screen, text turned right to left
    hello = protocol.Hello(id=1, model=os.path.realpath(model_dir), fingerprint=model_files.fingerprint,
                           client=hostile)
    assert request(running_daemon.socket, hello).ok  # any local user with the socket's group may say it
    assert moe_l2_main(["stats", "--socket", running_daemon.socket]) == 0
    out = capsys.readouterr().out
    assert "evil\\x1b]0;owned\\x07\\x1b[2J\\u202e" in out
    assert not any(c in out for c in "\x1b\x07\u202e")
