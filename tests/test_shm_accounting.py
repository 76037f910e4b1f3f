"""L2 pages locked in memory, or at least committed at create and reported (issue 13): Segment.create's mlock,
its touch-every-page fallback, the daemon's stats and its one warning, and Segment.unlink's owner check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from moe_l2 import _native, protocol
from moe_l2.client.connection import request
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir

from .conftest import budget_for

# Root without CAP_IPC_LOCK and with RLIMIT_MEMLOCK 0: mlock fails as it does for a service account without
# LimitMEMLOCK=, while the process can still read the test's models.
NO_LOCKING = ("setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "prlimit", "--memlock=0:0")
can_drop_locking = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("prlimit")),
    reason="needs root on Linux with util-linux setpriv and prlimit to take the right to lock memory away")

CREATE = """
import json, sys
from moe_l2 import _native
seg = _native.Segment.create(sys.argv[1], int(sys.argv[2]))
print(json.dumps({"locked": seg.locked, "error": seg.lock_error}))
"""


def create_in(wrapper, name: str, nbytes: int) -> dict:
    import json

    out = subprocess.run([*wrapper, sys.executable, "-P", "-c", CREATE, name, str(nbytes)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def name():
    made = f"/ml2t{uuid.uuid4().hex[:10]}"
    yield made
    _native.Segment.unlink(made)


def resident_bytes(name: str) -> int:
    """Pages of a segment that hold memory (tmpfs: the file's allocated blocks)."""
    return os.stat("/dev/shm" + name).st_blocks * 512


@pytest.mark.skipif(os.geteuid() != 0, reason="locking needs root (or a large RLIMIT_MEMLOCK)")
def test_create_locks_the_pages_where_permitted(name):
    seg = _native.Segment.create(name, 4 << 20)
    assert seg.locked and seg.lock_error == ""
    assert not _native.Segment.open(name).locked  # only the creator locks


@can_drop_locking
def test_create_without_the_right_to_lock_touches_every_page_and_says_why(name):
    size = 8 << 20
    result = create_in(NO_LOCKING, name, size)
    assert result["locked"] is False
    assert result["error"].startswith(f"[Segment.create] cannot lock the {size} bytes of segment '{name}' in memory")
    assert resident_bytes(name) >= size  # committed at create, not at the first load


@can_drop_locking
def test_daemon_reports_unlocked_shm_and_warns_once(model_dir, model_files):
    directory = short_tempdir()
    daemon = DaemonProcess(["--model", str(model_dir), "--budget", str(budget_for(model_files, 2)),
                            "--runtime-dir", str(directory)], directory, wrapper=NO_LOCKING).start()
    try:
        d = request(daemon.socket, protocol.Stats(id=1)).payload["daemon"]
        assert d["shm_locked_bytes"] == 0 and d["shm_unlocked_bytes"] == d["shm_bytes"] > 0
        log = daemon.log()
        assert log.count("cannot lock the") == 1
        assert "is committed but not locked" in log and "LimitMEMLOCK=infinity" in log
    finally:
        daemon.stop()
        daemon.unlink_leftovers()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="locking needs root (or a large RLIMIT_MEMLOCK)")
def test_stats_count_locked_shm_and_the_table_shows_it(running_daemon):
    d = request(running_daemon.socket, protocol.Stats(id=1)).payload["daemon"]
    assert d["shm_locked_bytes"] == d["shm_bytes"] > 0 and d["shm_unlocked_bytes"] == 0
    assert "cannot lock" not in running_daemon.log()
    table = subprocess.run([shutil.which("moe-l2"), "stats", "--socket", running_daemon.socket], capture_output=True,
                           text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "(locked " in table.stdout and "unlocked 0 B)" in table.stdout
    # A daemon from before locking reports neither figure; the table leaves them out.
    from moe_l2.cli.stats import render as render_stats

    payload = request(running_daemon.socket, protocol.Stats(id=1)).payload
    del payload["daemon"]["shm_locked_bytes"], payload["daemon"]["shm_unlocked_bytes"]
    assert "locked" not in render_stats(payload)


def test_unlink_with_an_owner_leaves_another_users_segment(name):
    _native.Segment.create(name, 4096)
    with pytest.raises(PermissionError, match=rf"\[Segment.unlink\] shared-memory segment '{name}' belongs to uid "
                                              rf"{os.geteuid()}, not to uid {os.geteuid() + 1}: left in place"):
        _native.Segment.unlink(name, owner=os.geteuid() + 1)
    assert _native.Segment.unlink(name, owner=os.geteuid()) is True
    assert _native.Segment.unlink(name, owner=os.geteuid()) is False
