"""The memory governor with a real daemon, real shared memory and real clients.

This machine cannot be made short of memory on purpose, so the daemon reads its "available memory" from the
file MOE_L2_TEST_MEMORY names (moe_l2.plan.read_memory, a hook only tests use) and the test lowers and raises
that reading; the slots it shrinks, the pages it releases and the bytes clients get are all real.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from moe_l2 import protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.cli.stats import render
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.layout import Geometry
from moe_l2.plan import GiB, MEMORY_FILE_ENV

from .conftest import assert_resident_exact, budget_for, retire, stats, wait_for

SLOTS = 8
PINS = [0, 1, 2]


def write_memory(path, available: int) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"total": 16 * GiB, "available": available}))
    os.replace(partial, path)  # the daemon never reads half a file


def layer_slots(daemon) -> list[int]:
    return [layer["slots"] for layer in stats(daemon)["models"][0]["layers"]]


def shm_bytes_held(name: str) -> int:
    return os.stat(f"/dev/shm/{name[1:]}").st_blocks * 512


def test_low_memory_shrinks_l2_keeps_pins_and_grows_back(daemon_factory, model_dir, model_files, tmp_path,
                                                         monkeypatch):
    memory = tmp_path / "memory.json"
    write_memory(memory, 8 * GiB)
    monkeypatch.setenv(MEMORY_FILE_ENV, str(memory))
    daemon = daemon_factory([model_dir], str(budget_for(model_files, SLOTS)), "--memory-floor", "1GiB")
    fp = model_files.fingerprint
    assert request(daemon.socket, protocol.Pin(id=1, model=fp, layer=0, experts=PINS)).payload["pinned"] == PINS
    n_layers, n_experts = model_files.n_layers, model_files.n_experts
    client = L2Client(model_files, daemon.socket, wait_s=5)
    pool = ExpertPool(model_files, capacity=4, client=client)
    stop, failures = threading.Event(), []

    def hammer():
        """A client fetching all along: every record must be exact, whatever the governor does."""
        rng = random.Random(0)
        while not stop.is_set():
            layer = rng.randrange(n_layers)
            experts = rng.sample(range(n_experts), 4)
            try:
                pool.fetch(layer, experts)
                assert_resident_exact(pool, model_files, layer, experts)
            except AssertionError as exc:
                failures.append(exc)
                return

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        wait_for(lambda: all(layer["resident"] == SLOTS for layer in stats(daemon)["models"][0]["layers"]),
                 what="L2 filled by the client's misses")
        stride = Geometry(n_layers, n_experts, SLOTS, model_files.layout.nbytes).slot_stride
        data = [n for n in daemon.segments if not n.endswith("i")]
        assert sys.platform != "linux" or shm_bytes_held(data[1]) == SLOTS * stride

        write_memory(memory, GiB // 2)  # below the floor
        wait_for(lambda: layer_slots(daemon) == [len(PINS) + 1] + [1] * (n_layers - 1), what="L2 shrunk")
        taken = (SLOTS - len(PINS) - 1) + (n_layers - 1) * (SLOTS - 1)
        released = taken * stride if sys.platform == "linux" else 0  # macOS: docs
        # The pages go back after the store's lock is dropped, a moment after the slots are taken.
        wait_for(lambda: stats(daemon)["models"][0]["released_bytes"] == released, what="pages released")
        m = stats(daemon)["models"][0]
        assert set(PINS) <= set(m["layers"][0]["experts"])  # pins never evicted
        assert m["layers"][0]["permanent_pins"] == PINS
        assert m["slots_per_layer"] == SLOTS  # the configured size stays
        assert all(layer["resident"] <= layer["slots"] for layer in m["layers"])
        if sys.platform == "linux":  # the pages really went back to the system
            assert shm_bytes_held(data[1]) == stride
        d = stats(daemon)["daemon"]["memory"]
        assert d["available_bytes"] == GiB // 2 and d["floor_bytes"] == GiB and d["shrinks"] >= 1
        assert "below the floor" in daemon.log()
        table = render(stats(daemon))
        assert f"memory available 512.0 MiB, floor 1.0 GiB: L2 shrunk {d['shrinks']} times" in table
        # layer 0 (decoder layer 0): 3 pins, 4 slots in use
        assert re.search(r"\n\s+0\s+\d+\s+\d+\s+3\s+4\s+0\n", table), table

        write_memory(memory, 8 * GiB)
        wait_for(lambda: layer_slots(daemon) == [SLOTS] * n_layers, what="L2 grown back")
        wait_for(lambda: all(layer["resident"] == SLOTS for layer in stats(daemon)["models"][0]["layers"]),
                 what="L2 refilled by the client's misses")
        m = stats(daemon)["models"][0]
        assert m["released_bytes"] == 0 and stats(daemon)["daemon"]["memory"]["grows"] >= 1
        assert set(PINS) <= set(m["layers"][0]["experts"])
    finally:
        stop.set()
        thread.join()
    assert not failures, failures[0]
    assert pool.counts.l2_hits > 0 and pool.counts.l3_reads > 0
    # After all the shrinking, every expert still comes out of L2 exact.
    for layer in range(n_layers):
        resident = stats(daemon)["models"][0]["layers"][layer]["experts"]
        for expert in resident[:4]:
            pool.fetch(layer, [expert])
            assert_resident_exact(pool, model_files, layer, [expert])
    pool.close()
    client.close()
    assert stats(daemon)["models"][0]["load_errors"] == 0


def test_floor_off_never_shrinks(daemon_factory, model_dir, model_files, tmp_path, monkeypatch):
    memory = tmp_path / "memory.json"
    write_memory(memory, 1)
    monkeypatch.setenv(MEMORY_FILE_ENV, str(memory))
    daemon = daemon_factory([model_dir], str(budget_for(model_files, SLOTS)), "--memory-floor", "off")
    wait_for(lambda: stats(daemon)["daemon"]["memory"]["checks"] >= 3, what="governor checks")
    d = stats(daemon)["daemon"]["memory"]
    assert d["available_bytes"] == 1 and d["floor_bytes"] == 0 and d["shrinks"] == 0
    assert layer_slots(daemon) == [SLOTS] * model_files.n_layers


@pytest.mark.parametrize("floor", ["lots", "2 parsecs"])
def test_a_bad_floor_is_refused(daemon_factory, model_dir, model_files, floor):
    with pytest.raises(RuntimeError, match="--memory-floor: invalid size"):
        daemon_factory([model_dir], str(budget_for(model_files, SLOTS)), "--memory-floor", floor)


# In a child process: the real Governor, then the descriptor table filled to its limit, then a check.
FULL_TABLE = """
import errno, json, os, resource
import psutil
from moe_l2.daemon.governor import Governor
governor = Governor([], floor=0)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    assert exc.errno == errno.EMFILE, exc
try:
    psutil.virtual_memory()
    full = False
except OSError:
    full = True
governor.check()
print(json.dumps({"table_full": full, **governor.figures()}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="macOS reads memory with host_statistics: no descriptor")
def test_the_governor_reads_memory_with_the_descriptor_table_full():
    """Issue 22: over tcp:// a flood of connections filled the daemon's descriptor table and the governor
    could no longer open /proc/meminfo; it keeps a descriptor of it from start."""
    env = {k: v for k, v in os.environ.items() if k != MEMORY_FILE_ENV}
    out = subprocess.run([sys.executable, "-P", "-c", FULL_TABLE], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["table_full"], "psutil still opened /proc/meminfo: the table was not full"
    assert figures["checks"] == 1
    assert figures["total_bytes"] == psutil.virtual_memory().total
    assert 0 < figures["available_bytes"] <= figures["total_bytes"]


# ---- issue 37.3: a /dev/shm that fills while L2 is shrunk -------------------------------------------------------

@functools.cache
def private_shm_works() -> bool:
    """Whether this process may give a command a private mount namespace with a tmpfs of its own over /dev/shm
    (root, unshare, nsenter)."""
    if sys.platform != "linux" or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /dev/shm"], capture_output=True, timeout=30)
    return probe.returncode == 0


# Run in the daemon's mount namespace (nsenter): the client copies the residents named in argv out of the L2 that
# /dev/shm holds there, and checks each against the model files; prints its L2 hits.
CHECK_RESIDENTS = textwrap.dedent("""
    import json, sys
    from moe_l2.client.connection import L2Client
    from moe_l2.client.pool import ExpertPool
    from moe_l2.model import ModelFiles
    files = ModelFiles.open(sys.argv[1])
    client = L2Client(files, sys.argv[2], wait_s=10)
    assert client.attached, client.last_error
    pool = ExpertPool(files, capacity=2, client=client)
    hits = 0
    for layer, experts in enumerate(json.loads(sys.argv[3])):
        for expert in experts:
            hits += pool.fetch(layer, [expert]).l2_hits
            assert pool.layers[layer].record(expert) == files.read_record(layer, expert), (layer, expert)
    pool.close()
    client.close()
    print(hits)
""")

# Run there too: fills /dev/shm (what another user could do); prints the bytes taken.
FILL = textwrap.dedent("""
    import os
    room = os.statvfs("/dev/shm")
    fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
    os.posix_fallocate(fd, 0, room.f_bavail * room.f_frsize)
    print(room.f_bavail * room.f_frsize)
""")


@pytest.mark.slow
@pytest.mark.skipif(not private_shm_works(), reason="needs root, unshare and nsenter: the daemon runs with a small "
                                                    "tmpfs of its own over /dev/shm, in a private mount namespace")
def test_a_dev_shm_filled_while_l2_is_shrunk_leaves_slots_out_of_use_never_a_sigbus(model_dir, model_files,
                                                                                  tmp_path, monkeypatch):
    """Issue 37.3: the governor released slots' pages, another user filled /dev/shm, memory recovered and the
    governor grew back without reserving the pages: the first direct load into one was a SIGBUS (exit 135).
    Now a slot comes back only once its pages are reserved; the others stay out of use, reported, and come back
    when /dev/shm has room."""
    memory = tmp_path / "memory.json"
    write_memory(memory, 8 * GiB)
    monkeypatch.setenv(MEMORY_FILE_ENV, str(memory))
    budget = budget_for(model_files, SLOTS)
    page = os.sysconf("SC_PAGE_SIZE")
    geometry = Geometry.for_budget(model_files.n_layers, model_files.n_experts, model_files.layout.nbytes, budget)
    tmpfs = (geometry.shm_bytes // page + 16) * page  # the segments and a little more
    private_shm = ("unshare", "-m", "--propagation", "private", "sh", "-c",
                   f'mount -t tmpfs -o size={tmpfs} tmpfs /dev/shm && exec "$@"', "sh")
    daemon = DaemonProcess.serving([model_dir], str(budget), "--memory-floor", "1GiB", "--direct-io", "on",
                                   wrapper=private_shm).start()
    inside = ("nsenter", "-t", str(daemon.proc.pid), "-m", sys.executable, "-P", "-c")
    fp, n_layers = model_files.fingerprint, model_files.n_layers

    def model() -> dict:
        assert daemon.proc.poll() is None, f"moe-l2d exited with {daemon.proc.returncode}:\n{daemon.log()}"
        return stats(daemon)["models"][0]

    def load(experts, per_layer: int) -> None:
        """Prefetch `experts` in every layer, and wait for the per_layer loads that make in each."""
        done = model()["loads_done"]
        for layer in range(n_layers):
            request(daemon.socket, protocol.Prefetch(id=1, model=fp, layer=layer, experts=list(experts)))
        wait_for(lambda: model()["loads_done"] == done + per_layer * n_layers, what="the loads")

    def check_residents() -> int:
        residents = json.dumps([layer["experts"] for layer in model()["layers"]])
        out = subprocess.run([*inside, CHECK_RESIDENTS, str(model_dir), daemon.socket, residents],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    try:
        load(range(SLOTS), SLOTS)
        write_memory(memory, GiB // 2)  # below the floor: every layer down to one slot
        wait_for(lambda: layer_slots(daemon) == [1] * n_layers, what="L2 shrunk")
        taken = n_layers * (SLOTS - 1)
        stride = geometry.slot_stride
        wait_for(lambda: model()["released_bytes"] == taken * stride, what="the pages released after the grace")
        filled = subprocess.run([*inside, FILL], capture_output=True, text=True, timeout=60)
        assert filled.returncode == 0 and int(filled.stdout) >= taken * stride, filled.stderr

        write_memory(memory, 8 * GiB)  # memory is back, /dev/shm is not
        wait_for(lambda: model()["unbacked_slots"] == taken, what="the slots reported unbacked")
        m = model()
        assert [layer["slots"] for layer in m["layers"]] == [1] * n_layers  # none came back unbacked
        assert [layer["unbacked"] for layer in m["layers"]] == [SLOTS - 1] * n_layers
        assert "No space left on device" in m["unbacked_error"]
        assert f"{taken} slots cannot be backed" in render(stats(daemon))
        doctor = subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", "doctor", "--json", "--socket",
                                 daemon.socket], capture_output=True, text=True, timeout=120)
        (verdict,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "daemon"]
        assert verdict["status"] == "warn" and f"{taken} slots of L2" in verdict["detail"], verdict
        load(range(SLOTS, 2 * SLOTS), 1)  # direct loads go on, into the one slot per layer still backed
        assert check_residents() == n_layers
        assert "slots of" in daemon.log() and "stay out of use" in daemon.log()

        subprocess.run([*inside, "import os; os.unlink('/dev/shm/filler')"], check=True, timeout=60)
        wait_for(lambda: layer_slots(daemon) == [SLOTS] * n_layers, what="L2 grown back once /dev/shm has room")
        assert model()["unbacked_slots"] == 0 and model()["released_bytes"] == 0
        load(range(SLOTS), SLOTS)
        assert check_residents() == n_layers * SLOTS
        assert model()["load_errors"] == 0 and "every slot of" in daemon.log()
    finally:
        retire([daemon])
