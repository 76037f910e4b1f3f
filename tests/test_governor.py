"""The memory governor with a real daemon, real shared memory and real clients.

This machine cannot be made short of memory on purpose, so the daemon reads its "available memory" from the
file MOE_L2_TEST_MEMORY names (moe_l2.plan.read_memory, a hook only tests use) and the test lowers and raises
that reading; the slots it shrinks, the pages it releases and the bytes clients get are all real.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading

import psutil
import pytest

from moe_l2 import protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.commands.stats import render
from moe_l2.layout import Geometry
from moe_l2.plan import GiB, MEMORY_FILE_ENV

from .conftest import assert_resident_exact, budget_for, stats, wait_for

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
