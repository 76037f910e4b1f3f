"""Socket activation (daemon/activation.py): a real moe-l2d started by systemd-socket-activate on its first
client's connection, and the inherited sockets it must refuse, each with the message that says why."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from moe_l2 import protocol

from moe_l2.lab import lifeline
from moe_l2.client.connection import L2Client
from moe_l2.control import dealer
from moe_l2.daemon.activation import ActivationError, Handed, _from_systemd, listener, take
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.model import ModelFiles

from .conftest import NOBODY, budget_for, free_port, wait_for

ACTIVATE = shutil.which("systemd-socket-activate")
needs_activate = pytest.mark.skipif(ACTIVATE is None, reason="systemd-socket-activate (Debian's systemd package) "
                                                             "is not on PATH")


@pytest.fixture
def runtime():
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


class Activated:
    """systemd-socket-activate listening at `listen` (its flags), exec'ing moe-l2d ARGS (tied to this process)
    on the first connection, as a socket unit would start the service."""

    def __init__(self, runtime, listen: list[str], *args: str):
        self.log_path = runtime / "daemon.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([ACTIVATE, *listen, "--fdname=moe-l2d",
                                          *lifeline.command("moe_l2.daemon.main"), *args], stdout=log, stderr=log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def daemon_args(model_dir, model_files, runtime, sock) -> list[str]:
    return ["--model", str(model_dir), "--budget", str(budget_for(model_files, 4)), "--socket", f"ipc://{sock}",
            "--runtime-dir", str(runtime)]


@needs_activate
def test_the_first_clients_start_the_daemon_and_are_served(runtime, model_dir, model_files):
    sock = runtime / "moe-l2d.sock"
    daemon = Activated(runtime, ["-l", str(sock)], *daemon_args(model_dir, model_files, runtime, sock))
    try:
        wait_for(sock.exists, what="the listening socket", detail=daemon.log)
        os.chmod(sock, 0o600)  # SocketMode=0600: systemd-socket-activate has no flag for it
        # Three clients connect before any daemon runs; the first connection execs the daemon, and all wait in
        # the backlog until it is ready. The first never reconnects: it is answered only if the daemon accepts
        # the very connection that started it.
        first = dealer(f"ipc://{sock}", None, protocol.MAX_REPLY_BYTES, options=((zmq.RECONNECT_IVL, -1),))
        first.send(protocol.Stats(id=7).encode())
        stats = subprocess.Popen([sys.executable, "-P", "-m", "moe_l2.cli", "stats", "--json", "--timeout", "60",
                                  "--socket", f"ipc://{sock}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        client = L2Client(ModelFiles.open(model_dir), f"ipc://{sock}", wait_s=0, timeout_s=60)
        try:
            assert first.poll(60_000), daemon.log()
            assert protocol.decode_reply(first.recv()).payload["daemon"]["pid"] == daemon.proc.pid  # exec'd in place
            out, err = stats.communicate(timeout=90)
            assert stats.returncode == 0 and json.loads(out)["daemon"]["pid"] == daemon.proc.pid, err + daemon.log()
            assert client.wait_attached(60), client.last_error + daemon.log()
        finally:
            first.close(0)
            client.close()
        assert "serving the socket systemd passed" in daemon.log()
        # The descriptor is close-on-exec (sd_listen_fds' contract), so no child inherits the listening socket.
        fdinfo = Path(f"/proc/{daemon.proc.pid}/fdinfo/3").read_text()
        flags = next(line for line in fdinfo.splitlines() if line.startswith("flags:"))
        assert int(flags.split()[1], 8) & os.O_CLOEXEC
    finally:
        assert daemon.stop() == 0, daemon.log()
    # The socket file is the manager's: it stays for the next client to start the daemon again.
    assert sock.exists() and not list(runtime.glob("*.gate")) and not list(runtime.glob("*.segments"))


@needs_activate
@pytest.mark.parametrize("listen, trigger, expected", [
    ("mode", "connect", "its mode is 0644, not the socket_mode 0600"),
    ("path", "connect", "is bound to"),
    ("tcp", "connect", "is of family AF_INET, not a unix socket"),
    ("datagram", "send", "is of type SOCK_DGRAM, not a stream socket"),
])
def test_a_wrong_inherited_socket_stops_the_daemon_with_the_reason(runtime, model_dir, model_files, listen, trigger,
                                                                     expected):
    sock = runtime / "moe-l2d.sock"
    address = {"mode": str(sock), "path": str(runtime / "other.sock"), "datagram": str(sock),
               "tcp": f"127.0.0.1:{free_port()}"}[listen]
    flags = ["--datagram"] if listen == "datagram" else []
    daemon = Activated(runtime, [*flags, "-l", address], *daemon_args(model_dir, model_files, runtime, sock))
    try:
        family = socket.AF_INET if listen == "tcp" else socket.AF_UNIX
        target = ("127.0.0.1", int(address.rpartition(":")[2])) if listen == "tcp" else address
        kind = socket.SOCK_DGRAM if trigger == "send" else socket.SOCK_STREAM

        def poke() -> bool:
            with socket.socket(family, kind) as s:
                try:
                    s.sendto(b"x", target) if trigger == "send" else s.connect(target)
                    return True
                except OSError:
                    return False
        wait_for(poke, what="the activator's socket", detail=daemon.log)
        assert daemon.proc.wait(60) == 1, daemon.log()
    finally:
        daemon.stop()
    assert expected in daemon.log() and "moe-l2 service install writes them" in daemon.log()
    if listen in ("mode", "path"):
        assert os.path.exists(address)  # refused, not removed: it is the manager's


def test_sockets_passed_to_another_process_are_refused(runtime, model_dir, model_files):
    """$LISTEN_PID names the process the sockets are for: a daemon started by a wrapper that did not exec it
    must not take the wrapper's descriptors for its own."""
    env = dict(os.environ, LISTEN_FDS="1", LISTEN_PID="1", LISTEN_FDNAMES="moe-l2d")
    done = subprocess.run([*lifeline.command("moe_l2.daemon.main"),
                           *daemon_args(model_dir, model_files, runtime, runtime / "moe-l2d.sock")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "$LISTEN_PID is 1, not this process" in done.stderr and "exec" in done.stderr


# ---- the checks, on real sockets in this process -------------------------------------------------------------

def test_the_sd_listen_fds_variables_are_read_and_unset():
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "metrics:moe-l2d", "HOME": "/x"}
    assert _from_systemd(env) == Handed("systemd", (3, 4), ("metrics", "moe-l2d"))
    assert env == {"HOME": "/x"}  # no child takes them for its own
    assert _from_systemd({"HOME": "/x"}) is None
    for bad, message in (({"LISTEN_FDS": "1"}, "$LISTEN_PID is unset"),
                         ({"LISTEN_FDS": "x", "LISTEN_PID": str(os.getpid())}, "not a number"),
                         ({"LISTEN_FDS": "2", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": "a"}, "names 1")):
        with pytest.raises(ActivationError, match=message.replace("$", r"\$")):
            _from_systemd(bad)


def _bound(path, kind=socket.SOCK_STREAM, mode=0o600, listen=True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.bind(str(path))
    os.chmod(path, mode)
    if listen:
        sock.listen()
    return sock


def _handed(*socks, names=None) -> Handed:
    return Handed("systemd", tuple(os.dup(s.fileno()) for s in socks), names or ("",) * len(socks))


def _refusal(handed: Handed, address: str, mode=0o600, group=None) -> str:
    try:
        with pytest.raises(ActivationError) as info:
            listener(handed, address, mode, group)
    finally:
        for fd in handed.fds:
            os.close(fd)
    return str(info.value)


def test_the_daemons_socket_is_taken_when_it_is_what_its_options_say(runtime):
    path = runtime / "moe-l2d.sock"
    with _bound(path, mode=0o660) as sock:
        taken = listener(_handed(sock), f"ipc://{path}", 0o660, None)
        with taken, socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # served by the socket taken: the same listening socket
            accepted, _ = taken.accept()
            accepted.close()
    path.unlink()
    with _bound(runtime / "metrics.sock") as other, _bound(path) as named:
        handed = _handed(other, named, names=("metrics", "moe-l2d"))  # among several, the one of its name
        with listener(handed, f"ipc://{path}", 0o600, None) as taken:
            assert taken.getsockname() == str(path)
        os.close(handed.fds[0])


def test_inherited_sockets_unlike_the_daemons_own_bind_are_refused(runtime):
    path, address = runtime / "moe-l2d.sock", f"ipc://{runtime / 'moe-l2d.sock'}"
    with _bound(path, mode=0o640) as sock:
        assert "its mode is 0640, not the socket_mode 0600" in _refusal(_handed(sock), address)
    path.unlink()
    with _bound(path, mode=0o660) as sock:
        refused = _refusal(_handed(sock), address, 0o660, group=os.getegid() + 1)
        assert f"its group is gid {os.getegid()}, not gid {os.getegid() + 1}" in refused
    with _bound(runtime / "elsewhere.sock") as sock:
        assert f"is bound to '{runtime / 'elsewhere.sock'}', but the daemon's socket is {path}" in \
            _refusal(_handed(sock), address)
    with socket.socket() as tcp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        assert "is of family AF_INET, not a unix socket" in _refusal(_handed(tcp), address)
    with _bound(runtime / "dgram.sock", socket.SOCK_DGRAM, listen=False) as dgram:
        assert "is of type SOCK_DGRAM" in _refusal(_handed(dgram), address)
    with _bound(runtime / "quiet.sock", listen=False) as quiet:
        assert "is not listening" in _refusal(_handed(quiet), address)
    read, write = os.pipe()
    os.close(write)
    assert "is not a socket" in _refusal(Handed("systemd", (read,), ("",)), address)
    with _bound(runtime / "x.sock") as x, _bound(runtime / "y.sock") as y:
        assert "passed 2 sockets ('a', 'b'), and not one named 'moe-l2d'" in \
            _refusal(_handed(x, y, names=("a", "b")), address)
    with _bound(runtime / "z.sock") as z:
        assert "serves the ipc:// socket only" in _refusal(_handed(z), "tcp://127.0.0.1:5557")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the socket file to another user")
def test_an_inherited_socket_of_another_user_is_refused(runtime):
    path = runtime / "moe-l2d.sock"
    with _bound(path) as sock:
        os.chown(path, NOBODY, -1)
        refused = _refusal(_handed(sock), f"ipc://{path}")
    assert f"it belongs to uid {NOBODY}, not to the daemon's user (uid 0)" in refused


def test_a_process_no_manager_started_takes_no_sockets(monkeypatch):
    """On macOS this asks launchd (launch_activate_socket): a process it did not start gets ESRCH, hence None."""
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    assert take() is None
