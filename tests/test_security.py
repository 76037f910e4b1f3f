"""Issue 10: the attacks of a hostile local user, each reproduced against a real moe-l2d (docs/security.md).

The hostile side runs as uid 65534 (nobody) through setpriv, so these tests need root; they skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.auth

from moe_l2 import _native, protocol
from moe_l2.client.connection import L2Client, UntrustedDaemon, check_segment, request, trusted_uids
from moe_l2.client.pool import ExpertPool
from moe_l2.daemon.server import MAX_CLIENTS
from moe_l2.lab.random_models import make_model
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir
from moe_l2.model import ModelFiles

from .conftest import ANSWER_MS, AS_NOBODY, NOBODY, budget_for, nobody_runs_python, retire, run_daemon, stats, wait_for

needs_root = pytest.mark.skipif(not nobody_runs_python(),
                                reason="the hostile side runs as uid 65534: needs root, setpriv, and this "
                                       "interpreter's packages readable by other users (a private venv is not)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_nobody(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*AS_NOBODY, sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=timeout)


class Raw:
    """A DEALER that sends hostile bytes and reads replies."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frame: bytes, timeout_ms: int = 5000) -> protocol.Reply:
        self.sock.send(frame)
        assert self.sock.poll(timeout_ms), "daemon did not answer"
        return protocol.decode_reply(self.sock.recv())

    def close(self):
        self.sock.close(0)


@pytest.fixture
def raw(running_daemon):
    r = Raw(running_daemon.socket)
    yield r
    r.close()


@pytest.fixture(scope="module")
def public_model() -> Path:
    """A model every user can read (the victim's, served by a hostile daemon in the tests of 10.2)."""
    directory = short_tempdir()
    directory.chmod(0o755)
    out = directory / "model"
    make_model(out, arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden_size=64, moe_hidden_size=32, bits=4,
               seed=3)
    for path in (out, *out.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield out
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def hostile_daemon(public_model):
    """Factory: moe-l2d run by uid 65534 on its own runtime dir, serving the victim's model."""
    started = []

    def start(transport: str) -> DaemonProcess:
        directory = short_tempdir()
        os.chown(directory, NOBODY, NOBODY)
        address = f"tcp://127.0.0.1:{free_port()}" if transport == "tcp" else f"ipc://{directory}/moe-l2d.sock"
        files = ModelFiles.open(public_model)
        args = ["--model", str(public_model), "--budget", str(budget_for(files, files.n_experts)),
                "--runtime-dir", str(directory), "--socket", address, "--shm-mode", "644", "--socket-mode", "660",
                "--socket-group", str(NOBODY)]
        daemon = DaemonProcess(args, directory, wrapper=AS_NOBODY)
        started.append(daemon)
        return daemon.start()

    yield start
    retire(started)


# 10.2: a daemon run by another user is refused; the client reads from the file.

@needs_root
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_daemon_run_by_another_user_is_refused_and_the_client_reads_the_file(hostile_daemon, public_model,
                                                                               transport, caplog, monkeypatch):
    daemon = hostile_daemon(transport)
    files = ModelFiles.open(public_model)
    if transport == "ipc":
        os.chmod(daemon.runtime_dir, 0o755)  # let the victim reach the socket: only ownership refuses it
    with monkeypatch.context() as trusting:  # the hostile daemon fills its L2, asked on purpose
        trusting.setenv("MOE_L2_TRUSTED_UIDS", str(NOBODY))
        for layer in range(files.n_layers):
            request(daemon.socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=layer,
                                                     experts=list(range(files.n_experts))))
        wait_for(lambda: stats(daemon.socket)["models"][0]["loads_done"] == files.n_layers * files.n_experts,
                 what="the hostile daemon's loads")
    client = L2Client(files, daemon.socket, wait_s=1.5, heartbeat_s=0.1)
    pool = ExpertPool(files, capacity=2, client=client)
    try:
        assert not client.attached
        assert "does not trust" in client.last_error and f"uid {NOBODY}" in client.last_error
        counts = pool.fetch(0, [1, 2])
        assert (counts.l2_hits, counts.l3_reads) == (0, 2)
        assert pool.layers[0].record(1) == files.read_record(0, 1)
    finally:
        pool.close()
        client.close()
    assert [r for r in caplog.records if "refusing moe-l2d" in r.getMessage()]
    # With that user trusted, the same daemon is used (the check is what refused it).
    trusting = L2Client(files, daemon.socket, wait_s=5, trusted=trusted_uids([NOBODY]))
    try:
        assert trusting.attached
    finally:
        trusting.close()
    if transport == "tcp":
        verify = subprocess.run([shutil.which("moe-l2"), "verify", "--model", str(public_model), "--socket", daemon.socket,
                                 "--samples", "8"], capture_output=True, text=True, timeout=120)
        assert verify.returncode == 0, verify.stderr
        assert "does not trust" in verify.stderr and "0 from L2" in verify.stdout


def test_segments_others_can_write_are_refused():
    name = f"/ml2sec{os.getpid() % 100000}"
    segment = _native.Segment.create(name, 4096, 0o666)
    try:
        assert (segment.owner_uid, segment.mode) == (os.getuid(), 0o666)
        opened = _native.Segment.open(name)
        assert (opened.owner_uid, opened.mode) == (os.getuid(), 0o666)
        with pytest.raises(UntrustedDaemon, match="could change the weights"):
            check_segment(opened, trusted_uids())
        with pytest.raises(UntrustedDaemon, match="does not trust"):
            check_segment(_native.Segment.open(name), frozenset([12345]))
    finally:
        _native.Segment.unlink(name)


# 10.4: who may talk to the daemon.

@needs_root
def test_the_ipc_socket_mode_ignores_the_umask_and_keeps_other_users_out(model_dir, model_files):
    directory = short_tempdir()
    directory.chmod(0o755)  # only the socket's own mode keeps the hostile user out
    args = ["--model", str(model_dir), "--budget", str(budget_for(model_files, 2)), "--runtime-dir", str(directory)]
    daemon = DaemonProcess(args, directory, wrapper=("sh", "-c", 'umask 000; exec "$@"', "sh")).start()
    try:
        path = directory / "moe-l2d.sock"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        attack = as_nobody(
            "import zmq, msgpack\n"
            "s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)\n"
            f"s.connect('{daemon.socket}')\n"
            f"s.send(msgpack.packb({{'v': 1, 'type': 'pin', 'id': 1, 'model': '{model_files.fingerprint}', "
            "'layer': 0, 'experts': [0, 1], 'kind': 'permanent'}))\n"
            "print('answered' if s.poll(1500) else 'no answer')\n")
        assert attack.stdout.strip() == "no answer", attack.stderr
        assert stats(daemon.socket)["models"][0]["layers"][0]["pinned"] == 0
        told = as_nobody("from moe_l2.client.connection import request\nfrom moe_l2 import protocol\n"
                         f"request('{daemon.socket}', protocol.Stats(id=1))")
        assert "no permission to connect" in told.stderr and "is it running" not in told.stderr
    finally:
        daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)


@needs_root
def test_socket_mode_660_lets_the_configured_group_in(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 2)), "--socket-mode", "660",
                            "--socket-group", str(NOBODY))
    path = Path(daemon.socket[len("ipc://"):])
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
    os.chmod(path.parent, 0o755)
    friend = as_nobody("from moe_l2.client.connection import request\nfrom moe_l2 import protocol\n"
                       f"print(request('{daemon.socket}', protocol.Stats(id=1)).ok)")
    assert friend.stdout.strip() == "True", friend.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "192.0.2.1", "[::]", "eth0"])
def test_tcp_beyond_loopback_is_refused_at_start(host, model_dir):
    result = run_daemon("--model", str(model_dir), "--budget", "1MiB", "--socket", f"tcp://{host}:5557")
    assert result.returncode == 2
    assert "tcp://127.0.0.1:PORT" in result.stderr and "no authentication" in result.stderr


@pytest.mark.parametrize("mode, words", [("666", "must be 600"), ("644", "must be 600"), ("abc", "must be 600")])
def test_bad_socket_modes_are_refused(mode, words, model_dir):
    result = run_daemon("--model", str(model_dir), "--budget", "1MiB", "--socket-mode", mode)
    assert result.returncode == 2 and words in result.stderr


def test_tcp_on_loopback_serves_with_a_warning(daemon_factory, model_dir, model_files):
    address = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 2)), "--socket", address)
    assert stats(address)["daemon"]["pid"] == daemon.proc.pid
    assert "reachable by every local user" in daemon.log()


# 10.5: a request with one bad id changes nothing.

def test_a_prefetch_or_pin_with_a_bad_last_id_reserves_and_pins_nothing(running_daemon, raw, model_files):
    fp, bad = model_files.fingerprint, model_files.n_experts
    reply = raw.ask(protocol.Prefetch(id=3, model=fp, layer=0, experts=[0, 1, 2, bad]).encode())
    assert (reply.ok, reply.ename, reply.id) == (False, "OutOfRange", 3)
    reply = raw.ask(protocol.Pin(id=4, model=fp, layer=1, experts=[0, 1, bad], kind="permanent").encode())
    assert (reply.ok, reply.ename, reply.id) == (False, "OutOfRange", 4)
    request(running_daemon.socket, protocol.Pin(id=5, model=fp, layer=2, experts=[3], kind="permanent"))
    reply = raw.ask(protocol.Unpin(id=6, model=fp, layer=2, experts=[3, -1], kind="permanent").encode())
    assert (reply.ok, reply.ename) == (False, "OutOfRange")
    m = stats(running_daemon.socket)["models"][0]
    assert [(layer["loading"], layer["resident"], layer["pinned"]) for layer in m["layers"][:2]] == [(0, 0, 0)] * 2
    assert m["layers"][2]["permanent_pins"] == [3]  # the refused unpin kept it
    # Layer 0 still caches.
    request(running_daemon.socket, protocol.Prefetch(id=7, model=fp, layer=0, experts=[0, 1, 2]))
    wait_for(lambda: stats(running_daemon.socket)["models"][0]["layers"][0]["resident"] == 3, what="loads")


# 10.6: cheap requests stay cheap; a flood of legal reports does not starve heartbeats.

def test_oversized_fields_are_refused_without_work(raw, model_files):
    reply = raw.ask(msgpack.packb({"v": 1, "type": "hello", "id": 9, "model": "/" + "a/.." * 100_000,
                                   "fingerprint": "0", "client": "x"}))
    assert (reply.ename, reply.id) == ("FrameTooLarge", 0)
    reply = raw.ask(protocol.Hello(id=10, model="/" + "a/.." * 2000, fingerprint="0", client="x").encode())
    assert (reply.ename, reply.id) == ("BadField", 10)
    reply = raw.ask(protocol.Report(id=11, model=model_files.fingerprint,
                                    layers={0: [[1] * 10_000, [2] * 10_000]}).encode())
    assert (reply.ename, reply.id) == ("TooManyIds", 11)


def test_a_flood_of_legal_reports_never_detaches_a_client(running_daemon, model_files):
    fp, n = model_files.fingerprint, model_files.n_experts
    biggest = protocol.Report(id=1, model=fp, layers={0: [[e % n for e in range(protocol.MAX_IDS // 2 - 1)],
                                                          [e % n for e in range(protocol.MAX_IDS // 2 - 1)]]}).encode()
    client = L2Client(model_files, running_daemon.socket, wait_s=5, heartbeat_s=0.2, timeout_s=2.0)
    assert client.attached
    stop = threading.Event()
    refused = threading.Event()  # a Busy refusal came back: the daemon's queue of reports is full

    def flood():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 50)
        sock.connect(running_daemon.socket)
        while not stop.is_set():
            try:
                sock.send(biggest, zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.01)
            while sock.poll(0):
                sock.recv()  # Busy refusals
                refused.set()
        sock.close(0)

    flooders = [threading.Thread(target=flood) for _ in range(2)]
    for t in flooders:
        t.start()
    detached = 0
    try:
        assert refused.wait(20), "the flood never filled the daemon's queue (no Busy refusal)"
        # The subject: five seconds under a full queue, the client sampled all along (a re-attach is counted too).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            detached += not client.attached
            time.sleep(0.05)
    finally:
        stop.set()
        for t in flooders:
            t.join()
        client.close()
    assert detached == 0 and client.attaches == 1, client.last_error
    assert running_daemon.proc.poll() is None


# 10.7: memory stays bounded.

def test_messages_with_many_or_huge_parts_are_refused(running_daemon, raw):
    raw.sock.send_multipart([b"x" * 1000] * 16)
    assert not raw.sock.poll(1000)  # the gate closes the connection at the third part (tests/test_gate.py)
    assert stats(running_daemon.socket)["daemon"]["gate"]["refused"] == {"too many parts": 1}
    before = stats(running_daemon.socket)["daemon"]["rss_bytes"]
    big = Raw(running_daemon.socket)
    try:
        big.sock.send_multipart([b"y" * (16 << 20)] * 4)
        assert not big.sock.poll(1000)  # the gate closes the connection at the first part's header
    finally:
        big.close()
    after = stats(running_daemon.socket)["daemon"]["rss_bytes"]
    assert after - before < 32 << 20
    assert raw.ask(protocol.Stats(id=12).encode()).ok


def test_the_client_table_is_bounded(running_daemon, model_files):
    hello = protocol.Hello(id=1, model="/m", fingerprint=model_files.fingerprint,
                           client="c" * protocol.MAX_STRING["client"]).encode()
    context = zmq.Context.instance()
    for _ in range(MAX_CLIENTS + 50):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(running_daemon.socket)
        sock.send(hello)
        assert sock.poll(ANSWER_MS)
        sock.recv()
        sock.close(0)
    assert stats(running_daemon.socket)["daemon"]["clients"] == MAX_CLIENTS


# 10.9: clear replies, short log lines.

def test_refusals_name_the_request_and_the_log_stays_short(running_daemon, raw):
    reply = raw.ask(msgpack.packb({"v": 1, "type": ["stats"], "id": 21}))
    assert (reply.ename, reply.id) == ("UnknownType", 21)
    reply = raw.ask(msgpack.packb({"v": 1, "type": "t" * 200_000, "id": 22}))
    assert (reply.ename, reply.id) == ("UnknownType", 22) and len(reply.evalue) < 400
    reply = raw.ask(msgpack.packb({"v": 1, "type": "prefetch", "id": 23, "model": "m", "layer": [0], "experts": []}))
    assert (reply.ename, reply.id) == ("BadField", 23)
    reply = raw.ask(b"\x93\x01")  # a truncated array
    assert reply.ename == "MalformedFrame" and reply.evalue and not reply.evalue.endswith(": ")
    reply = raw.ask(b"\x80" * (protocol.MAX_FRAME_BYTES + 1))
    assert reply.ename == "FrameTooLarge" and "split" in reply.evalue
    log = running_daemon.log()
    assert "Traceback" not in log and "InternalError" not in log
    assert max(map(len, log.splitlines())) < 1000


def test_request_refuses_a_frame_over_the_limit_before_sending(running_daemon):
    huge = protocol.Hint(id=1, model="m", text="x" * (protocol.MAX_FRAME_BYTES + 1))
    with pytest.raises(ValueError, match="split it"):
        request(running_daemon.socket, huge)


def test_curve_lets_only_listed_clients_in_over_tcp(daemon_factory, model_dir, model_files, tmp_path, monkeypatch):
    keys, allowed = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    alice_public, alice_secret = zmq.auth.create_certificates(keys, "alice")
    _, mallory_secret = zmq.auth.create_certificates(keys, "mallory")
    shutil.copy(alice_public, allowed)
    port = free_port()
    args = ["--socket", f"tcp://0.0.0.0:{port}", "--curve-secret-key", server_secret, "--curve-clients", str(allowed)]
    refused = run_daemon("--model", str(model_dir), "--budget", "1MiB", *args)
    assert refused.returncode == 2 and "chmod 600" in refused.stderr
    os.chmod(server_secret, 0o600)
    daemon_factory([model_dir], str(budget_for(model_files, 2)), *args)
    address = f"tcp://127.0.0.1:{port}"
    monkeypatch.setenv("MOE_L2_CURVE_SERVER_KEY", server_public)
    monkeypatch.setenv("MOE_L2_CURVE_CLIENT_CERT", alice_secret)
    assert request(address, protocol.Stats(id=1)).ok
    client = L2Client(model_files, address, wait_s=5)
    try:
        assert client.attached
    finally:
        client.close()
    monkeypatch.setenv("MOE_L2_CURVE_CLIENT_CERT", mallory_secret)
    with pytest.raises(TimeoutError):
        request(address, protocol.Stats(id=2), timeout_s=1)
    monkeypatch.delenv("MOE_L2_CURVE_CLIENT_CERT")
    monkeypatch.delenv("MOE_L2_CURVE_SERVER_KEY")
    with pytest.raises(TimeoutError):
        request(address, protocol.Stats(id=3), timeout_s=1)


@pytest.mark.parametrize("extra, words", [
    (["--curve-clients", "/tmp"], "needs both"),
    (["--curve-secret-key", "/nonexistent", "--curve-clients", "/tmp"], "guarded by its mode"),
])
def test_bad_curve_settings_are_refused(extra, words, model_dir):
    result = run_daemon("--model", str(model_dir), "--budget", "1MiB", *extra)
    assert result.returncode == 2 and words in result.stderr


def test_silent_clients_expire_without_anyone_asking_for_stats():
    from moe_l2.daemon.loader import Loader
    from moe_l2.daemon.server import CLIENT_TIMEOUT_S, Client, Server

    directory = short_tempdir()
    loader = Loader(1)
    server = Server(f"ipc://{directory}/s.sock", [], loader, epoch=1)
    try:
        stale = time.monotonic() - CLIENT_TIMEOUT_S - 1
        server.clients.update({b"old-%d" % i: Client("c", stale, model=None) for i in range(100)})
        server.clients[b"fresh"] = Client("c", time.monotonic(), model=None)
        passes = iter(range(2))
        server.serve(lambda: next(passes, None) is None)  # one pass of the serving loop, no request
        assert list(server.clients) == [b"fresh"]
    finally:
        server.close()
        loader.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
