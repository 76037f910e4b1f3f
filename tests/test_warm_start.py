"""Warm after a restart: a real moe-l2d saves what its L2 held and preloads it at the next start, below every
client's load, and takes no heat file it should not (docs/architecture.md, "Warm after a restart")."""

from __future__ import annotations

import os
import threading
import time

import pytest

from moe_l2 import _native, protocol
from moe_l2.cache.policy import make_policy
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.cli.stats import render
from moe_l2.daemon.heat_file import Heat, LayerHeat, file_name, max_bytes
from moe_l2.daemon.loader import Loader, Preload
from moe_l2.daemon.served import ServedModel
from moe_l2.daemon.warm_start import SAVE_EVERY_S, WarmStart, save_interval
from moe_l2.layout import Geometry, new_token, segment_name

from .conftest import assert_resident_exact, budget_for, free_port, scrape, stats, wait_for

SLOTS = 4


def settled(daemon) -> dict:
    """The model's stats once no load is in flight and the warm start (if any) has nothing left to load."""
    def done() -> bool:
        m = stats(daemon)["models"][0]
        return m["loads_in_flight"] == 0 and not (m["warm_start"] or {}).get("pending")

    wait_for(done, what="loads and the warm start's preload", detail=daemon.log)
    return stats(daemon)["models"][0]


def held(model: dict) -> list[tuple[list[int], list[int]]]:
    """Per layer, the experts resident and the permanent pins."""
    return [(layer["experts"], layer["permanent_pins"]) for layer in model["layers"]]


def teach(daemon, files) -> None:
    """Lookups through a real client, so that the daemon's policy learns which experts are hot, and a pin."""
    reply = request(daemon.socket, protocol.Pin(id=1, model=files.fingerprint, layer=1, experts=[11],
                                                kind="permanent"))
    assert reply.ok and reply.payload["pinned"] == [11]
    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, capacity=1, client=client)
    try:
        for layer in range(files.n_layers):
            for expert in (3, 5, 3, 9, 3, 5, 12, 3, 5, 14):
                pool.fetch(layer, [(expert + layer) % files.n_experts])
        looked_up = pool.counts.l2_hits + pool.counts.l3_reads
    finally:
        pool.close()
        client.close()

    def reported() -> bool:  # the client's reports reach the daemon after its fetches return
        m = stats(daemon)["models"][0]
        return m["hits"] + m["misses"] == looked_up

    wait_for(reported, what="the client's reports", detail=daemon.log)


@pytest.mark.parametrize("policy", ["adaptive", "learned"])
def test_a_daemon_stopped_and_started_again_holds_what_it_held(policy, daemon_factory, model_dir, model_files):
    budget = str(budget_for(model_files, SLOTS))
    first = daemon_factory([model_dir], budget, "--policy", policy)
    teach(first, model_files)
    before = held(settled(first))
    assert all(experts for experts, _ in before) and before[1][1] == [11]
    assert first.stop() == 0, first.log()
    saved = first.runtime_dir / file_name(model_files.fingerprint)
    assert os.stat(saved).st_mode & 0o777 == 0o600
    heat = decode(saved.read_bytes(), model_files)

    port = free_port()
    second = daemon_factory([model_dir], budget, "--policy", policy, "--metrics", f"127.0.0.1:{port}",
                            runtime_dir=first.runtime_dir)
    m = settled(second)  # no client has connected
    assert held(m) == before
    records = sum(len(experts) for experts, _ in before)
    assert m["warm_start"]["records"] == m["warm_start"]["preloaded"] == m["loads_done"] == records
    assert heat.saved_at == m["warm_start"]["saved_at"]
    assert f"warm start: preloaded {records} of {records} records" in render(stats(second))
    label = ("model", m["path"])
    samples = scrape(port)
    assert samples[("moe_l2_warm_start_records", label)] == samples[("moe_l2_warm_start_preloaded_total", label)] \
        == records
    assert samples[("moe_l2_warm_start_pending", label)] == 0
    assert samples[("moe_l2_warm_start_saved_timestamp_seconds", label)] == pytest.approx(heat.saved_at)
    assert second.stop() == 0
    # The policies' states, the pins and the experts came back exactly: with no lookup in between, the second
    # daemon saved what the first did.
    again = decode(saved.read_bytes(), model_files)
    assert again.layers == heat.layers and again.saved_at > heat.saved_at

    # What is preloaded is the model's bytes, copied from L2 without a disk read.
    third = daemon_factory([model_dir], budget, "--policy", policy, runtime_dir=first.runtime_dir)
    settled(third)
    client = L2Client(model_files, third.socket, wait_s=5)
    pool = ExpertPool(model_files, capacity=SLOTS, client=client)
    try:
        for layer, (experts, _) in enumerate(before):
            assert pool.fetch(layer, experts).l2_hits == len(experts)
            assert_resident_exact(pool, model_files, layer, experts)
    finally:
        pool.close()
        client.close()


def decode(data: bytes, files) -> Heat:
    return Heat.decode(data, files.fingerprint, files.n_layers, files.n_experts)


def valid_heat(files, fingerprint: str | None = None) -> bytes:
    policy = make_policy("adaptive", SLOTS)
    for expert in (1, 2, 1, 3):
        policy.access(expert)
    layers = tuple(LayerHeat(layer, (1, 2, 3), {}, policy.state()) for layer in range(files.n_layers))
    return Heat(fingerprint or files.fingerprint, files.n_layers, files.n_experts, "adaptive", time.time(), None,
                layers).encode()


def with_nan_score(files) -> bytes:
    heat = decode(valid_heat(files), files)
    state = heat.layers[0].policy_state
    state["scores"][0][0][1] = float("nan")
    return Heat(heat.fingerprint, heat.n_layers, heat.n_experts, heat.policy, heat.saved_at, None,
                (LayerHeat(0, (1,), {}, state),)).encode()


def plant(path, case: str, files) -> str:
    """Put a heat file that must not be taken at `path`; returns what the log line says of it."""
    good = valid_heat(files)
    if case == "damaged":
        path.write_bytes(good[:40] + b"\xc1" * 8 + good[48:])
        return "not a heat file"
    if case == "truncated":
        path.write_bytes(good[:len(good) // 2])
        return "not a heat file"
    if case == "another model's":
        path.write_bytes(valid_heat(files, "0" * 32))
        return "another model's"
    if case == "oversized":
        path.write_bytes(good + b"\0" * max_bytes(files.n_layers, files.n_experts))
        return "more than the"
    if case == "a hostile policy state":
        path.write_bytes(with_nan_score(files))
        return "policy state"
    if case == "a time past any clock":
        heat = decode(good, files)
        path.write_bytes(Heat(heat.fingerprint, heat.n_layers, heat.n_experts, heat.policy, 1e20, None,
                              heat.layers).encode())
        return "no time"
    if case == "a symbolic link":
        target = path.with_name("elsewhere")
        target.write_bytes(good)
        path.symlink_to(target)
        return "symbolic link"
    if case == "a FIFO":
        os.mkfifo(path, 0o600)
        return "not a regular file"
    path.write_bytes(good)
    if case == "writable by others":
        path.chmod(0o666)
    else:  # another user's
        os.chown(path, 65534, 65534)
    return "not a private file"


@pytest.mark.parametrize("case", ["damaged", "truncated", "another model's", "oversized", "a hostile policy state",
                                  "a time past any clock", "a symbolic link", "a FIFO", "writable by others",
                                  "another user's"])
def test_a_heat_file_that_is_not_the_daemons_own_is_ignored_in_one_line(case, daemon_factory, model_dir,
                                                                           model_files):
    if case == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    from moe_l2.lab.daemon_process import short_tempdir

    directory = short_tempdir()
    says = plant(directory / file_name(model_files.fingerprint), case, model_files)
    # The planted files are the adaptive policy's: a daemon of another policy would not read their states.
    daemon = daemon_factory([model_dir], str(budget_for(model_files, SLOTS)), "--policy", "adaptive",
                            runtime_dir=directory)
    lines = [line for line in daemon.log().splitlines() if "heat" in line]
    assert len(lines) == 1 and "ignoring the heat file" in lines[0] and says in lines[0], daemon.log()
    assert "Traceback" not in daemon.log()
    m = stats(daemon)["models"][0]  # it serves, cold
    assert m["warm_start"] is None and m["loads_done"] == 0
    assert request(daemon.socket, protocol.Prefetch(id=2, model=model_files.fingerprint, layer=0, experts=[4])).ok
    assert settled(daemon)["layers"][0]["experts"] == [4]


def test_a_state_dir_the_daemon_cannot_use_is_said_once_and_it_serves_cold(daemon_factory, model_dir, model_files,
                                                                             tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    daemon = daemon_factory([model_dir], str(budget_for(model_files, SLOTS)), "--state-dir", str(not_a_dir))
    assert stats(daemon)["models"][0]["warm_start"] is None
    assert daemon.stop() == 0
    (line,) = [line for line in daemon.log().splitlines() if "heat" in line]  # not again at the stop
    assert "cannot keep L2's heat" in line and str(not_a_dir) in line


def test_warm_start_off_saves_nothing_and_preloads_nothing(daemon_factory, model_dir, model_files):
    budget = str(budget_for(model_files, SLOTS))
    off = daemon_factory([model_dir], budget, "--warm-start", "off")
    teach(off, model_files)
    settled(off)
    assert off.stop() == 0
    saved = off.runtime_dir / file_name(model_files.fingerprint)
    assert not saved.exists()
    on = daemon_factory([model_dir], budget, runtime_dir=off.runtime_dir)
    teach(on, model_files)
    settled(on)
    assert on.stop() == 0 and saved.exists()
    again_off = daemon_factory([model_dir], budget, "--warm-start", "off", runtime_dir=off.runtime_dir)
    m = settled(again_off)
    assert m["warm_start"] is None and m["loads_done"] == 0
    assert all(layer["resident"] == 0 and layer["pinned"] == 0 for layer in m["layers"])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_clients_misses_are_loaded_before_the_preload_still_queued(threads, model_files):
    """The loader's order of fills, in a real ServedModel over real segments: a preload record's fill waits on the
    test while a client's misses are queued. One thread loads the misses next, before the rest of the preload;
    of two, the preload holds one only and the other loads the misses at once. The preload then skips the record
    a miss loaded first."""
    geometry = Geometry.for_budget(model_files.n_layers, model_files.n_experts, model_files.layout.nbytes,
                                   budget_for(model_files, 8))
    served = ServedModel(model_files, geometry, lambda layer, nbytes: _native.Segment.create(
        segment_name("i39warm", 0, layer, new_token()), nbytes, 0o600), epoch=1)
    filled, release = [], threading.Event()

    publish = served.finish_fill

    def finish_fill(layer: int, r, checksum: int) -> None:  # the loader thread holds here on the first record
        publish(layer, r, checksum)
        filled.append(r.expert)
        if len(filled) == 1:
            release.wait(30)

    served.finish_fill = finish_fill
    loader = Loader(threads)
    try:
        preload = Preload(served, [(0, e) for e in (0, 1, 2, 3, 4)])
        loader.preload(preload)
        wait_for(lambda: filled == [0], what="the first preload record")
        # Taken by a thread, the first record is still to load until that thread is done with it (what `stats`
        # counts as pending: a caller that waits for none pending sees every preloaded record).
        assert preload.unfinished() == 5 and len(preload.untaken()) < 5
        assert served.demand(0, [9, 3], loader) == 2
        if threads == 2:
            wait_for(lambda: len(filled) == 3, what="the misses, on the thread the preload leaves free")
        release.set()
        wait_for(lambda: preload.unfinished() == 0, what="the rest of the preload")
        assert filled == [0, 9, 3, 1, 2, 4]
        assert preload.loaded == 4  # 3 was in L2 already when the preload came to it
        g = served.geometry
        for expert in filled:
            slot = served.slot_indexes[0].slot_of(expert)
            start = slot * g.slot_stride
            assert bytes(served.data[0].view()[start:start + g.record_bytes]) == model_files.read_record(0, expert)
    finally:
        release.set()
        loader.shutdown()
        served.close()


def test_a_heat_that_did_not_change_is_not_written_again(model_files, tmp_path):
    """The periodic save writes a model's heat only where it changed since the last write (a learned model's state
    is megabytes for a large model): the file is replaced after a lookup, not after nothing, and save() says how
    many bytes it wrote, which sets the wait before the next (test_a_large_heat_is_saved_less_often)."""
    geometry = Geometry.for_budget(model_files.n_layers, model_files.n_experts, model_files.layout.nbytes,
                                   budget_for(model_files, SLOTS))
    served = ServedModel(model_files, geometry, lambda layer, nbytes: _native.Segment.create(
        segment_name("i40heat", 0, layer, new_token()), nbytes, 0o600), epoch=1)
    loader = Loader(1)
    warm = WarmStart(tmp_path, [served], loader)
    saved = tmp_path / file_name(model_files.fingerprint)
    try:
        assert warm.save() == saved.stat().st_size
        first = os.stat(saved).st_ino
        assert warm.save() == 0
        assert os.stat(saved).st_ino == first
        with served.lock:
            served.stores[0].observe([1, 2])
        assert warm.save() == saved.stat().st_size
        assert os.stat(saved).st_ino != first
        assert decode(saved.read_bytes(), model_files).layers[0].policy_state["clock"] == 1
    finally:
        warm.stop(save=False)
        loader.shutdown()
        served.close()


def test_a_large_heat_is_saved_less_often():
    """The saves write at most a GiB an hour on average: a small model's heat every SAVE_EVERY_S, the largest heat of
    DeepSeek-V3's shape (about 350 MiB, most of it learned weights) every 20 minutes; after nothing written, the
    usual wait."""
    assert save_interval(0) == save_interval(10 << 20) == SAVE_EVERY_S
    dsv3 = max_bytes(58, 256)
    assert 19 * 60 < save_interval(dsv3) < 22 * 60
    assert dsv3 / save_interval(dsv3) * 3600 <= 1 << 30
