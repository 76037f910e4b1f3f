"""The client path L0 -> L2 -> L3 against ground truth (the model file), alone and under load and faults."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moe_l2 import protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool, PoolTooSmall
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles

from .conftest import assert_every_tier_exact, assert_resident_exact, budget_for, quarter_budget, stats, wait_for

HAMMER = Path(__file__).with_name("hammer.py")

FORMATS = {
    "stacked-4bit": dict(arch="qwen3_moe", bits=4),
    "per-expert-8bit": dict(arch="mixtral", bits=8, per_expert=True),
    "sharded-fp16": dict(arch="qwen3_moe", bits=16, shards=3),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def any_model(request, tmp_path_factory) -> ModelFiles:
    out = tmp_path_factory.mktemp("formats") / request.param
    make_model(out, layers=2, experts=8, top_k=2, hidden_size=128, moe_hidden_size=64, seed=3,
               **FORMATS[request.param])
    return ModelFiles.open(out)


def test_pread_only_pool_returns_file_bytes(any_model):
    pool = ExpertPool(any_model, capacity=3)
    try:
        for layer in range(any_model.n_layers):
            for start in range(0, any_model.n_experts, 2):
                batch = [start, (start + 1) % any_model.n_experts]
                counts = pool.fetch(layer, batch)
                assert counts.l2_hits == 0
                assert_resident_exact(pool, any_model, layer, batch)
        assert pool.counts.l3_reads > pool.capacity * any_model.n_layers  # it evicted and re-read
    finally:
        pool.close()


def test_every_tier_returns_file_bytes_through_a_daemon(any_model, daemon_factory):
    assert_every_tier_exact(any_model, daemon_factory([any_model.path],
                                                      str(budget_for(any_model, any_model.n_experts))))


def test_pool_arrays_are_mlx_arrays_seen_through_the_slot_table(model_files):
    pool = ExpertPool(model_files, capacity=4)
    try:
        pool.fetch(0, [3, 9])
        piece = model_files.layout.pieces[0]
        weights = mx.load(str(model_files.files[0]))
        stacked = [n for n in weights if n.endswith("switch_mlp." + piece.key)
                   and f"layers.{model_files.layer_ids[0]}." in n]
        assert len(stacked) == 1
        rows = pool.table(0)[mx.array([9, 3])]
        got = pool.arrays(0)[piece.key][rows]
        assert mx.array_equal(got, weights[stacked[0]][mx.array([9, 3])]).item()
    finally:
        pool.close()


def test_a_batch_larger_than_the_pool_is_refused_not_corrupted(model_files):
    pool = ExpertPool(model_files, capacity=2)
    try:
        with pytest.raises(PoolTooSmall, match="does not fit"):
            pool.fetch(0, [1, 2, 3])
        with pytest.raises(IndexError):
            pool.fetch(0, [model_files.n_experts])
        pool.fetch(0, [1, 2])
        assert_resident_exact(pool, model_files, 0, [1, 2])
    finally:
        pool.close()


def test_layer_pool_methods_follow_the_slot_table(model_files):
    """What the switch layer asks a LayerPool (residents, rows, room, pins), checked against the slot table the
    device reads; and the pool's counters."""
    pool = ExpertPool(model_files, capacity=4)
    try:
        lp = pool.layers[0]
        assert not lp.holds(3) and lp.has_room_for(range(4)) and lp.fits(range(4)) and not lp.fits(range(5))
        pool.fetch(0, [3, 9, 3])
        assert lp.holds(3) and lp.holds(9) and not lp.holds(4) and not lp.holds_all()
        table = pool.table(0).tolist()
        assert lp.rows_for([9, 3, 9]) == [table[9], table[3], table[9]] and table[9] != table[3]
        assert lp.has_room_for([3, 9, 1, 2]) and not lp.has_room_for([1, 2, 4])  # two rows are free
        pool.pin(0, [3])
        assert lp.pins() == {3} and lp.unpinned_rows == 3
        assert lp.fits([3, 0, 1, 2]) and lp.fits([0, 1, 2]) and not lp.fits([0, 1, 2, 4])  # 3 keeps its row
        pool.fetch(0, [0, 1, 2])  # a full pool: evicts 9, never the pinned 3
        assert lp.holds(3) and not lp.holds(9) and pool.table(0)[9].item() == -1
        pool.evict(0, 3)
        assert not lp.holds(3) and lp.pins() == set() and lp.unpinned_rows == 4
        (row,) = lp.take_rows([5], {5})
        assert row == table[3]  # the row the eviction freed
        lp.release([row])
        assert lp.take_rows([5], {5}) == [row] and all(lp.holds(e) for e in (0, 1, 2))  # free again: no eviction
        lp.release([row])
        assert_resident_exact(pool, model_files, 0, [0, 1, 2])

        before = pool.counts
        pool.count_l0_hits(5)
        after = pool.counts
        assert after.l0_hits == before.l0_hits + 5 and after.l3_reads == before.l3_reads == 5
        after.l0_hits += 100  # a copy: the pool's own counts are unchanged
        assert pool.counts.l0_hits == before.l0_hits + 5
    finally:
        pool.close()
    whole = ExpertPool(model_files, capacity=model_files.n_experts)
    try:
        whole.fetch(1, range(model_files.n_experts - 1))
        assert not whole.layers[1].holds_all()
        whole.fetch(1, [model_files.n_experts - 1])
        assert whole.layers[1].holds_all() and not whole.layers[0].holds_all()
    finally:
        whole.close()


def test_a_shared_l0_gives_rows_to_any_layer_and_evicts_the_least_recently_used(model_files):
    """ExpertPool(shared_l0=True): `capacity` rows in all; a layer takes free rows, then the row of the least
    recently used expert of any layer outside its batch; pins hold rows for every layer."""
    assert model_files.n_layers >= 2
    pool = ExpertPool(model_files, capacity=4, shared_l0=True)
    try:
        l0, l1 = pool.layers[0], pool.layers[1]
        assert pool.arrays(0) is pool.arrays(1) and pool.nbytes == 4 * model_files.layout.stride
        pool.fetch(0, [1, 2])
        pool.fetch(1, [5])
        assert l1.has_room_for([6]) and not l1.has_room_for([6, 7])  # one row left in all
        pool.fetch(0, [1])  # 1 is now more recent than 2 and 5
        pool.fetch(1, [6, 7])  # takes the last free row, then the oldest expert outside the batch: layer 0's 2
        assert l0.holds(1) and not l0.holds(2) and l1.holds(5) and l1.holds(6) and l1.holds(7)
        assert pool.table(0)[2].item() == -1 and not l0.holds_all()
        rows = {pool.table(0)[1].item(), *(pool.table(1)[e].item() for e in (5, 6, 7))}
        assert rows == {0, 1, 2, 3}  # four experts of two layers in the four rows
        for layer, experts in ((0, [1]), (1, [5, 6, 7])):
            assert_resident_exact(pool, model_files, layer, experts)
        pool.pin(1, [5])
        assert l0.unpinned_rows == 3 and l0.fits([0, 1, 2]) and not l0.fits([0, 1, 2, 3])
        pool.fetch(0, [0, 2, 3])  # no free row: the oldest unpinned experts go (layer 0's 1, layer 1's 6 and 7)
        assert l1.holds(5) and not l1.holds(6) and not l1.holds(7) and not l0.holds(1)
        assert_resident_exact(pool, model_files, 0, [0, 2, 3])
        pool.prefetch(1, [4])  # no side rows (ExpertPool(prefetch=False)): nowhere to load a guess
        c = pool.prefetch_counts
        assert c.requests == 1 and c.issued == 0 and not l1.holds(4)
    finally:
        pool.close()
    with pytest.raises(ValueError, match="per-layer rows"):
        ExpertPool(model_files, capacity=4, shared_l0=True, policy="lfu")
    with pytest.raises(ValueError, match="experts in all"):
        ExpertPool(model_files, capacity=model_files.n_layers * model_files.n_experts + 1, shared_l0=True)


def start_hammers(files: ModelFiles, socket: str, n: int = 3) -> list[subprocess.Popen]:
    """Hammer processes (tests/hammer.py), fetching until finish() closes their standard input."""
    procs = [subprocess.Popen([sys.executable, str(HAMMER), str(files.path), socket, str(seed)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for seed in range(n)]
    for proc in procs:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
    return procs


def wait_attached(procs: list[subprocess.Popen], state: bool) -> None:
    """Until each hammer says its client is attached (True) or detached (False); fails if one ends first."""
    for proc in procs:
        while (line := proc.stdout.readline()) and json.loads(line) != {"attached": state}:
            pass
        assert line, f"a hammer ended before its client was {'attached' if state else 'detached'}"


def finish(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_three_clients_hammering_an_evicting_daemon_never_see_a_wrong_record(running_daemon, model_files):
    procs = start_hammers(model_files, running_daemon.socket)
    m = stats(running_daemon)["models"][0]
    slots = m["slots_per_layer"] * m["n_layers"]

    def hammered() -> bool:
        # The daemon counts the lookups reported to it (each a copy from L2 or a read of the file).
        m = stats(running_daemon)["models"][0]
        return m["hits"] + m["misses"] >= 3000 and m["loads_done"] > 5 * slots

    wait_for(hammered, timeout=120, what="3000 lookups and the daemon reloading its slots five times over",
             detail=lambda: stats(running_daemon)["models"][0])
    results = [finish(p) for p in procs]
    for r in results:
        assert r["mismatches"] == 0, r
        assert r["l2_hits"] > 0 and r["l3_reads"] > 0
    assert sum(r["l2_hits"] + r["l3_reads"] for r in results) >= 3000
    m = stats(running_daemon)["models"][0]
    assert m["loads_done"] > 5 * slots  # the daemon evicted and reloaded all along
    assert m["load_errors"] == 0


def test_kill9_mid_hammer_then_restart(daemon_factory, model_dir, model_files):
    budget = quarter_budget(model_files)
    daemon = daemon_factory([model_dir], budget)
    procs = start_hammers(model_files, daemon.socket)
    wait_attached(procs, True)
    wait_for(lambda: stats(daemon)["models"][0]["hits"] > 0, what="the hammers copying from L2")
    daemon.kill9()
    wait_attached(procs, False)  # each serves from the file meanwhile (counted below)
    restarted = daemon_factory([model_dir], budget, runtime_dir=daemon.runtime_dir)
    assert "reclaimed shared-memory segment" in restarted.log()
    wait_attached(procs, True)
    wait_for(lambda: stats(restarted)["models"][0]["hits"] > 0, what="the hammers copying from the new epoch")
    results = [finish(p) for p in procs]
    for r in results:
        assert r["mismatches"] == 0, r
        assert r["attaches"] >= 2, r  # re-attached to the new epoch
        assert r["l3_reads_detached"] > 0, r  # and read the file while the daemon was gone


def test_a_client_killed_while_copying_leaves_the_daemon_unaffected(running_daemon, model_files):
    (victim,) = start_hammers(model_files, running_daemon.socket, n=1)
    wait_for(lambda: stats(running_daemon)["models"][0]["hits"] > 0, what="the victim copying from L2")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    victim.stdin.close()
    victim.stdout.close()
    before = stats(running_daemon)["models"][0]["hits"]
    (survivor,) = start_hammers(model_files, running_daemon.socket, n=1)
    wait_for(lambda: stats(running_daemon)["models"][0]["hits"] > before, what="the survivor copying from L2")
    r = finish(survivor)
    assert r["mismatches"] == 0 and r["l2_hits"] > 0
    reply = request(running_daemon.socket, protocol.Stats(id=1))
    assert reply.ok and reply.payload["models"][0]["load_errors"] == 0
    assert reply.payload["models"][0]["hits"] > before
    assert running_daemon.proc.poll() is None


def test_client_without_daemon_serves_from_the_file_and_attaches_when_it_starts(daemon_factory, model_dir,
                                                                                 model_files):
    from .conftest import short_tempdir

    directory = short_tempdir()
    socket = f"ipc://{directory / 'moe-l2d.sock'}"
    client = L2Client(model_files, socket, wait_s=0.2, heartbeat_s=0.2, timeout_s=0.5)
    pool = ExpertPool(model_files, capacity=2, client=client)
    try:
        assert not client.attached
        assert pool.fetch(0, [1, 2]).l3_reads == 2
        assert_resident_exact(pool, model_files, 0, [1, 2])
        daemon = daemon_factory([model_dir], quarter_budget(model_files), runtime_dir=directory)
        assert client.wait_attached(10)
        request(daemon.socket, protocol.Prefetch(id=1, model=model_files.fingerprint, layer=0, experts=[5, 6]))
        wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 2, what="prefetch")
        assert pool.fetch(0, [5, 6]).l2_hits == 2
        assert_resident_exact(pool, model_files, 0, [5, 6])
    finally:
        pool.close()
        client.close()


def test_a_flood_of_reports_is_split_into_frames_the_daemon_accepts(running_daemon, model_files):
    """A long prefill reported pick by pick must not become one frame over the daemon's limit."""
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    picks = [e % model_files.n_experts for e in range(2_000_000)]  # 2 MB of ids in one frame
    try:
        client.report(0, [], [], picks)
    finally:
        client.close()
    # The daemon folds reports in between other requests: wait until every pick is counted.
    def counted() -> int:
        reply = request(running_daemon.socket, protocol.Stats(id=1, routing=True))
        assert reply.payload["daemon"]["errors"] == 0  # nothing refused as too large
        routing = reply.payload["models"][0]["routing"]
        return sum(routing[""][0]) if "" in routing else 0  # none counted before the first report is folded

    wait_for(lambda: counted() == len(picks), timeout=60, what="every pick counted")


def test_lookups_folded_in_through_a_donor_and_others_never_share_a_report(running_daemon, model_files):
    """moe-l2d observes all of a report's lookups or none (`folded`: they reached its policy through the fill socket
    already), so lookups of either kind go out in reports of their own, in order, and every one is counted."""
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    assert client.wait_attached(5)
    sent, send = [], client._send

    def spy(message) -> bool:
        if isinstance(message, protocol.Report) and message.layers:
            sent.append(message)
        return send(message)

    client._send = spy
    try:  # queued at once: one flush takes the three
        client.report(0, [1], [2], [1, 2], folded=True)
        client.report(0, [3], [], [3])
        client.report(1, [], [4], [4], folded=True)
        wait_for(lambda: stats(running_daemon)["models"][0]["misses"] == 2, what="the reports, counted")
    finally:
        client.close()
    assert stats(running_daemon)["models"][0]["hits"] == 2
    looked = [(report.folded, sorted(e for hits, misses in report.layers.values() for e in [*hits, *misses]))
              for report in sent]
    assert [folded for folded, _ in looked] == [True, False, True]
    assert [experts for _, experts in looked] == [[1, 2], [3], [4]]


def test_a_refill_waits_for_work_queued_on_the_evicted_row(model_files):
    """mx.async_eval queues a long computation that reads an expert's row last; a fetch that evicts that row
    right away must not overwrite it before the queued work has read it."""
    piece = model_files.layout.pieces[0]
    pool = ExpertPool(model_files, capacity=1)
    try:
        pool.fetch(0, [2])
        weights = pool.arrays(0)[piece.key]
        row = int(pool.table(0)[2].item())
        before = mx.array(np.asarray(weights[row]))  # the row's value now, copied out
        slow = mx.random.normal((1024, 1024), key=mx.random.key(0))
        for _ in range(4):
            slow = slow @ slow / 1024
        late = weights[mx.array(row) + (0 * slow.sum()).astype(mx.int32)]  # reads the row after the chain
        mx.async_eval(late)
        pool.fetch(0, [5])  # capacity 1: evicts expert 2 and refills its row
        assert int(pool.table(0)[5].item()) == row
        assert mx.array_equal(late, before).item()
        assert not mx.array_equal(weights[row], before).item()
    finally:
        pool.close()


def test_load_through_copies_a_miss_from_l2_once_the_daemon_loaded_it(running_daemon, model_files):
    # Reports queue for a minute here: the misses' report reaches the daemon only because load-through sends it
    # at once (L2Client.report(now=True)); otherwise the pool would read the file after its 5 s.
    client = L2Client(model_files, running_daemon.socket, wait_s=5, flush_s=60)
    pool = ExpertPool(model_files, capacity=4, client=client, load_through_s=5.0, lend=False)
    try:
        counts = pool.fetch(1, [3, 7, 3])
        # Cold: the daemon read both records into L2 and the client copied them; it read nothing itself.
        assert (counts.l2_hits, counts.l3_reads, counts.bytes_read) == (2, 0, 0)
        assert_resident_exact(pool, model_files, 1, [3, 7])
        m = stats(running_daemon)["models"][0]
        assert (m["loads_done"], m["layers"][1]["misses"]) == (2, 2)
    finally:
        pool.close()
        client.close()


class StuckDaemon:
    """A daemon whose loads never finish (a stuck disk, which cannot be made on purpose here): answers every
    request with stats that name loads in flight."""

    def __init__(self):
        import threading

        import msgpack
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stopping = threading.Event()
        self.unpack = msgpack.unpackb
        self.thread = threading.Thread(target=self._serve)  # the socket is this thread's from here on
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if self.sock.poll(20):
                identity, payload = self.sock.recv_multipart()
                req_id = self.unpack(payload)["id"]
                self.sock.send_multipart([identity, protocol.encode_reply(req_id, daemon={"loads_in_flight": 2})])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.sock.close(0)


def test_wait_idle_says_when_the_daemon_is_still_loading_at_its_timeout(running_daemon, model_files):
    from moe_l2.client.connection import wait_idle

    request(running_daemon.socket, protocol.Prefetch(id=1, model=model_files.fingerprint, layer=0, experts=[1, 2, 3]))
    wait_idle(running_daemon.socket)
    assert stats(running_daemon)["models"][0]["loads_done"] == 3  # returned once the loads were done
    stuck = StuckDaemon()
    try:
        with pytest.raises(RuntimeError, match="still has 2 loads in flight after 0.2 s"):
            wait_idle(stuck.address, timeout_s=0.2)
    finally:
        stuck.close()


def test_wait_attached_says_false_when_no_daemon_answers_in_time(model_files):
    from .conftest import short_tempdir

    client = L2Client(model_files, f"ipc://{short_tempdir() / 'moe-l2d.sock'}", wait_s=0)
    try:
        assert client.wait_attached(0.2) is False and not client.attached
        assert client.last_error  # why, for the caller to say
    finally:
        client.close()
