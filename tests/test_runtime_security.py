"""Issue 10.1 and 10.3 against a real daemon running as root: a runtime directory another user prepared, links
planted in it, a planted segment list, and two daemons on one socket with different runtime dirs.

The other user is uid 65534 (nobody), reached with util-linux's setpriv; these tests need root for that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from moe_l2 import _native, protocol
from moe_l2.client.connection import request
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir
from moe_l2.runtime import instance_tag

from .conftest import budget_for, segment_exists

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # one that uid 65534 can run (the test's own may sit under /root)
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and util-linux setpriv to act as a second user (uid 65534)")


def as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv], check=True,
                   timeout=30)




@pytest.fixture
def dirs():
    made = []

    def make():
        made.append(short_tempdir())
        os.chmod(made[-1], 0o755)  # nobody must be able to reach what it plants below
        return made[-1]

    yield make
    for directory in made:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def victim(dirs):
    """A root-owned file that a daemon tricked through a link would overwrite or chmod."""
    path = dirs() / "victim"
    path.write_text("precious\n")
    path.chmod(0o644)
    return path


def refused(harness, model_dir, model_files, runtime_dir, *extra) -> str:
    """Start a real daemon on runtime_dir, expect it to refuse; returns its log. Its own log and notify socket
    live in `harness`, away from the directory under attack."""
    args = ["--model", str(model_dir), "--budget", str(budget_for(model_files, 2)), "--runtime-dir",
            str(runtime_dir), *extra]
    daemon = DaemonProcess(args, harness)
    with pytest.raises(RuntimeError, match="exited with 1") as info:
        daemon.start()
    return str(info.value)


def test_a_runtime_dir_another_user_made_first_is_refused(dirs, victim, model_dir, model_files):
    parent = dirs()
    parent.chmod(0o1777)  # like /tmp, where the fallback runtime dir lives
    runtime = parent / "moe-l2-0"
    as_nobody("mkdir", "-m", "0700", str(runtime))
    socket = f"ipc://{runtime / 'moe-l2d.sock'}"
    as_nobody("ln", "-s", str(victim), str(runtime / f"moe-l2d-{instance_tag(socket)}.lock"))
    log = refused(dirs(), model_dir, model_files, runtime)
    assert f"runtime directory {runtime} belongs to uid {NOBODY}" in log
    assert "rm -r" in log
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644


def test_a_runtime_dir_others_can_write_is_refused(dirs, model_dir, model_files):
    runtime = dirs() / "shared"
    runtime.mkdir()
    runtime.chmod(0o1777)
    log = refused(dirs(), model_dir, model_files, runtime)
    assert "is writable by other users (mode 1777)" in log and f"chmod go-w {runtime}" in log


def test_a_symlinked_runtime_dir_is_refused(dirs, model_dir, model_files):
    parent = dirs()
    (parent / "real").mkdir(mode=0o700)
    (parent / "link").symlink_to(parent / "real")
    log = refused(dirs(), model_dir, model_files, parent / "link")
    assert "is a symbolic link" in log
    assert not any((parent / "real").iterdir())


def test_links_planted_for_the_lock_and_the_segment_list_are_not_followed(dirs, victim, model_dir, model_files):
    runtime = dirs()
    os.chmod(runtime, 0o700)
    socket = f"ipc://{runtime / 'moe-l2d.sock'}"
    lock = runtime / f"moe-l2d-{instance_tag(socket)}.lock"
    lock.symlink_to(victim)
    log = refused(dirs(), model_dir, model_files, runtime)
    assert f"cannot open the lock file {lock}" in log and "symbolic link" in log
    assert victim.read_text() == "precious\n"
    lock.unlink()
    # The segment list as a link: the daemon neither reads it nor writes (or chmods) through it.
    (runtime / f"moe-l2d-{instance_tag(socket)}.segments").symlink_to(victim)
    daemon = DaemonProcess(["--model", str(model_dir), "--budget", str(budget_for(model_files, 2)),
                            "--runtime-dir", str(runtime)], runtime).start()
    try:
        assert "ignoring the segment list" in daemon.log()
        assert json.loads((runtime / f"moe-l2d-{instance_tag(socket)}.segments").read_text())  # replaced, not followed
        assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644
    finally:
        assert daemon.stop() == 0
        daemon.unlink_leftovers()


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"needs {SYSTEM_PYTHON} to create a segment as uid 65534")
def test_a_planted_segment_list_unlinks_no_other_daemons_or_users_segments(daemon_factory, dirs, model_dir,
                                                                          model_files):
    first = daemon_factory([model_dir], str(budget_for(model_files, 2)))
    live = json.loads(next(first.runtime_dir.glob("moe-l2d-*.segments")).read_text())
    assert all(segment_exists(n) for n in live)
    runtime = dirs()
    os.chmod(runtime, 0o700)
    socket = f"ipc://{runtime / 'moe-l2d.sock'}"
    foreign = f"/ml2{instance_tag(socket)}.9i"  # this daemon's tag, but another user's segment
    as_nobody(SYSTEM_PYTHON, "-I", "-c", "import os, sys, _posixshmem; "
              "os.ftruncate(_posixshmem.shm_open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), 4096)",
              foreign)
    try:
        (runtime / f"moe-l2d-{instance_tag(socket)}.segments").write_text(json.dumps([*live, foreign]))
        second = daemon_factory([model_dir], str(budget_for(model_files, 2)), runtime_dir=runtime)
        assert all(segment_exists(n) for n in live), "the first daemon's live segments survive"
        assert segment_exists(foreign)
        log = second.log()
        assert "not a segment of this daemon" in log
        assert f"belongs to uid {NOBODY}, not to uid 0" in log
        assert request(first.socket, protocol.Stats(id=1)).ok
    finally:
        _native.Segment.unlink(foreign)


def test_two_daemons_on_one_socket_meet_at_the_lock_whatever_their_runtime_dirs(daemon_factory, dirs, model_dir,
                                                                              model_files):
    first = daemon_factory([model_dir], str(budget_for(model_files, 2)))
    live = json.loads(next(first.runtime_dir.glob("moe-l2d-*.segments")).read_text())
    with pytest.raises(RuntimeError, match=rf"another moe-l2d \(pid {first.proc.pid}\) is already serving"):
        daemon_factory([model_dir], str(budget_for(model_files, 2)), "--socket", first.socket, runtime_dir=dirs())
    assert all(segment_exists(n) for n in live)
    reply = request(first.socket, protocol.Stats(id=1))
    assert reply.ok and reply.payload["daemon"]["pid"] == first.proc.pid


def test_two_daemons_on_one_tcp_address_are_refused_before_shared_memory(daemon_factory, dirs, model_dir,
                                                                          model_files):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    budget = str(budget_for(model_files, 2))
    first = daemon_factory([model_dir], budget, "--socket", address)
    live = json.loads(next(first.runtime_dir.glob("moe-l2d-*.segments")).read_text())
    with pytest.raises(RuntimeError, match=f"listens on {address}; stop it first"):
        daemon_factory([model_dir], budget, "--socket", address, runtime_dir=dirs())
    assert all(segment_exists(n) for n in live)
    reply = request(address, protocol.Stats(id=1))
    assert reply.ok and reply.payload["daemon"]["pid"] == first.proc.pid
