"""Issue 36: a record on its way into L2 is waited for, not read again, and the wait is on the record's slot_of
entry in the daemon's index (SlotIndex.wait, client/slot_waits.py), woken by the daemon's publish or abort with no
message in between: for a process that gives its misses (a record another donor gives, or the daemon loads) and for
load-through (a record this process reported). Each wait is asserted as a state (the thread asleep in a shared
futex on the word), never as a time."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2 import _native
from moe_l2.client.connection import L2Client, wait_idle
from moe_l2.client.l2view import L2View
from moe_l2.client.pool import ExpertPool
from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.fill_protocol import encode

from .conftest import (FUTEX_SYSCALL, RawDonor, assert_resident_exact, daemon_segments, filling_pool, quarter_budget,
                       sleeping_on, slot_stride, stats, wait_for)

pytestmark = pytest.mark.skipif(sys.platform != "linux" or FUTEX_SYSCALL is None,
                                reason="sees a wait as a futex in /proc")

# Far longer than anything here takes: a wait that reached it would fail the test by its join's timeout.
LONG_S = 60.0


def coming_into(slot: int) -> int:
    """slot_of's value while a record is coming into the slot (native/slot_index.h)."""
    return -slot - 2


def word_address(attachment, layer: int, expert: int) -> int:
    """Where this process maps the expert's slot_of entry."""
    return attachment.index.address + attachment.geometry.slot_of_offset(layer) + 4 * expert


class Fetch:
    """pool.fetch on a thread of its own, so that the test can see it asleep and wake it."""

    def __init__(self, pool: ExpertPool, layer: int, experts: list[int]):
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(pool, layer, experts))
        self.thread.start()

    def _run(self, pool, layer, experts) -> None:
        try:
            self.result = pool.fetch(layer, experts)
        except BaseException as exc:  # re-raised by counts()
            self.error = exc

    def asleep_on(self, address: int, value: int) -> bool:
        return sleeping_on(f"/proc/self/task/{self.thread.native_id}", address) == value

    def counts(self):
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the fetch was not woken"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize("end", ["filled", "cancelled", "rejected"])
def test_a_miss_on_a_record_another_donor_gives_waits_for_it_and_reads_only_what_does_not_land(
        running_daemon, model_files, end):
    """Another donor holds the slot of MoE layer 1 expert 6 (slot_of says it is coming): a filling pool's miss on
    it sleeps on that word instead of reading it. The donor's fill published wakes it and it copies the record
    (no disk read anywhere but the donor's); cancelled, the daemon reads it and publishes, which wakes it; a fill the
    daemon rejects is aborted, which wakes it, and it reads the record itself."""
    donor = RawDonor(running_daemon)
    try:
        slot = donor.offer(model_files, 1, 6)
        record = model_files.read_record(1, 6)
        with filling_pool(model_files, running_daemon, load_through_s=LONG_S) as pool:
            address = word_address(pool.client.attachment, 1, 6)
            fetch = Fetch(pool, 1, [6])
            wait_for(lambda: fetch.asleep_on(address, coming_into(slot)), what="the fetch asleep on the coming record")
            fields = dict(model=model_files.fingerprint, layer=1, expert=6, slot=slot)
            if end == "cancelled":
                donor.sock.sendall(encode("cancelled", **fields))
            else:
                data = _native.Segment.open(daemon_segments(running_daemon, model_files)[1][1], readonly=False)
                stride = slot_stride(model_files, running_daemon)
                copied = record if end == "filled" else record[:len(record) // 2]
                data.view()[slot * stride:slot * stride + len(copied)] = copied
                donor.sock.sendall(encode("filled", checksum=model_files.layout.checksum(record), **fields))
                data.close()
            counts = fetch.counts()
            waits = pool.waits
            assert (waits.waits, waits.woken, waits.expired) == (1, 1, 0)
            assert_resident_exact(pool, model_files, 1, [6])
            # The fetch's report goes with the connection's flush; whatever it has the daemon load is counted once
            # the daemon is idle after it.
            wait_for(lambda: sum(stats(running_daemon)["models"][0][k] for k in ("hits", "misses")) == 1,
                     what="the fetch's report")
            wait_idle(running_daemon.socket)
        model = stats(running_daemon)["models"][0]
        read_by = {"filled": (1, 0, 0), "cancelled": (1, 0, 1), "rejected": (0, 1, 0)}[end]
        assert (counts.l2_awaited, counts.l3_reads, model["loads_done"]) == read_by
        assert model["fills"]["offered"] == 1  # the waiting pool gave nothing: the record was on its way
    finally:
        donor.sock.close()


def test_load_through_is_woken_on_the_slot_and_copies_what_the_daemon_loaded(running_daemon, model_files):
    """A process that does not give its misses reports them and sleeps on their slot_of entries (first absent, then
    coming): the daemon's begin_fill and publish wake it, and it copies the records; it reads nothing."""
    # Reports queue for a minute: the misses reach the daemon only because load-through sends them at once.
    client = L2Client(model_files, running_daemon.socket, wait_s=5, flush_s=60)
    pool = ExpertPool(model_files, capacity=4, client=client, load_through_s=LONG_S, lend=False)
    try:
        assert client.wait_attached(30)
        for layer, experts in ((0, [2, 9]), (1, [3, 7, 3]), (2, [11])):
            counts = pool.fetch(layer, experts)
            assert (counts.l2_hits, counts.l2_awaited, counts.l3_reads) == (len(set(experts)),) * 2 + (0,)
            assert_resident_exact(pool, model_files, layer, experts)
        assert pool.waits.expired == 0  # woken, every one (a record may land before its lookup sleeps)
        assert stats(running_daemon)["models"][0]["loads_done"] == 5
    finally:
        pool.close()
        client.close()


@pytest.mark.skipif(not L2View.supported(), reason="this MLX build cannot compute on mapped memory")
def test_load_through_lends_what_the_daemon_loaded_once_woken_on_the_slot(running_daemon, model_files):
    client = L2Client(model_files, running_daemon.socket, wait_s=5, flush_s=60)
    pool = ExpertPool(model_files, capacity=4, client=client, load_through_s=LONG_S)
    try:
        assert client.wait_attached(30)
        for layer, experts in ((0, [1, 6]), (1, [4]), (2, [8, 12])):
            counts, loan = pool.borrow(layer, experts)
            assert sorted(loan.experts) == experts and (counts.l2_awaited, counts.l3_reads) == (len(experts), 0)
            arrays, slot_of = loan.arrays(), loan.slot_of()
            for expert in experts:
                record = model_files.read_record(layer, expert)
                for p in model_files.layout.pieces:
                    assert np.array(arrays[p.key][slot_of[expert]]).tobytes() == record[p.offset:p.offset + p.nbytes]
            assert loan.torn() == []
        assert pool.waits.expired == 0
    finally:
        pool.close()
        client.close()


def test_a_daemon_killed_with_records_coming_costs_the_waiter_its_timeout_and_the_tokens_stay_exact(
        daemon_factory, model_dir, model_files):
    """A donor holds slots of layer 0 (records coming that no one will publish) when the daemon is killed: a
    generation asleep on one of them wakes at its timeout, reads the file, and gives the whole model's tokens."""
    daemon = daemon_factory([model_dir], quarter_budget(model_files))
    whole, tokenizer = load(str(model_dir))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, " * 4)[:40]
    expected = [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=8)]
    donor = RawDonor(daemon)
    donor.sock.sendall(encode("give", model=model_files.fingerprint, layer=0,
                              experts=list(range(model_files.n_experts)), keep=[]))
    coming = {expert: slot for expert, slot in donor.next().slots}
    assert coming
    try:
        with StreamedLM(model_dir, l0_slots=model_files.top_k + 1, socket=daemon.socket, load_through_ms=1000,
                        client_wait_s=5) as lm:
            attachment = lm.client.attachment
            words = {word_address(attachment, 0, e): coming_into(slot) for e, slot in coming.items()}
            got = []
            thread = threading.Thread(target=lambda: got.extend(
                r.token for r in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=8)))
            thread.start()
            tasks = Path("/proc/self/task")

            def asleep() -> bool:
                return any(sleeping_on(str(task), address) == value
                           for task in tasks.iterdir() for address, value in words.items())

            wait_for(asleep, what="the generation asleep on a coming record")
            daemon.kill9()
            thread.join(timeout=60)
            assert not thread.is_alive()
            assert got == expected
            assert lm.pool.waits.expired >= 1
    finally:
        donor.sock.close()
        daemon.unlink_leftovers()  # a SIGKILLed daemon leaves its segments
