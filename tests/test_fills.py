"""Issue 36: fills. A process of the daemon's uid reads its misses itself and gives them to L2 (client/donor.py,
daemon/fills.py); the daemon never reads them again, publishes only bytes that pass its own check, never takes a
fill from another uid, and never hands a slot offered to a donor to anything else while that process lives."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from contextlib import contextmanager

import pytest

from moe_l2 import _native
from moe_l2.client import donor as donor_module
from moe_l2.client import layerpool
from moe_l2.client.connection import L2Client, wait_idle
from moe_l2.client.pool import ExpertPool
from moe_l2.fill_protocol import encode, fill_socket_path
from moe_l2.layout import IndexHeader
from moe_l2.model import ModelFiles

from .conftest import (AS_NOBODY, RawDonor, budget_for, daemon_segments, filling_pool, nobody_runs_python,
                       pages_mapped, quarter_budget, slot_stride, stats, wait_for)


def fills(daemon) -> dict:
    return stats(daemon)["models"][0]["fills"]


def slot_record(files, daemon, layer: int, expert: int) -> bytes | None:
    """The expert's record as L2 holds it now (copied through the seqlock), or None when L2 lacks it."""
    index_name, data_names = daemon_segments(daemon, files)
    index = _native.Segment.open(index_name, readonly=True)
    data = _native.Segment.open(data_names[layer], readonly=True)
    try:
        g = IndexHeader.unpack(index.view()).geometry
        slots = g.layer_slots(range(files.n_layers))[layer]
        out = _native.Buffer(g.slot_stride)
        if not g.slot_index(index, layer, slots, data).copy([(0, files.layout.nbytes, out, g.slot_stride)],
                                                            [expert], [0])[0]:
            return None
        return bytes(out.view()[:files.layout.nbytes])
    finally:
        index.close()
        data.close()


def assert_given(pool, daemon, files, layer: int, expert: int) -> None:
    """A miss the pool reads is donated to L2, exact."""
    donated = fills(daemon)["donated"]
    assert pool.fetch(layer, [expert]).l3_reads == 1
    wait_for(lambda: fills(daemon)["donated"] == donated + 1, what="the donation")
    assert slot_record(files, daemon, layer, expert) == files.read_record(layer, expert)


def test_misses_read_by_a_process_of_the_daemons_uid_are_given_to_l2_exact_and_never_read_again(
        running_daemon, model_files):
    with filling_pool(model_files, running_daemon) as pool:
        for layer, experts in ((0, [2, 9]), (1, [3, 7])):
            assert pool.fetch(layer, experts).l3_reads == len(experts)  # read by this process, as with no daemon
        wait_for(lambda: fills(running_daemon)["donated"] == 4, what="four donations",
                 detail=lambda: fills(running_daemon))
    model = stats(running_daemon)["models"][0]
    assert model["loads_done"] == 0  # the daemon read nothing: one disk read per miss
    assert model["fills"]["rejected"] == model["fills"]["cancelled"] == 0
    for layer, experts in ((0, [2, 9]), (1, [3, 7])):
        for expert in experts:
            assert slot_record(model_files, running_daemon, layer, expert) == model_files.read_record(layer, expert)


def test_a_gives_lookup_is_reported_once_with_the_next_flush_and_loads_nothing(running_daemon, model_files,
                                                                                 monkeypatch):
    # The give reserves the slots; the report, which loads nothing, waits for the connection's flush rather than
    # having moe-l2d fold it in beside the read (docs/decisions.md, "Fills").
    with filling_pool(model_files, running_daemon) as pool:
        reports, report = [], pool.client.report

        def spy(layer, hits, misses, routed, now=False, given=(), folded=False):
            reports.append((layer, sorted(misses), now, sorted(given), folded))
            report(layer, hits, misses, routed, now, given, folded)

        monkeypatch.setattr(pool.client, "report", spy)
        assert pool.fetch(1, [5, 2]).l3_reads == 2
        # Folded: the lookup went to the policy through the donor, before its give (test_learned.py).
        assert reports == [(1, [2, 5], False, [2, 5], True)]
        wait_for(lambda: fills(running_daemon)["donated"] == 2, what="two donations",
                 detail=lambda: fills(running_daemon))
        wait_for(lambda: stats(running_daemon)["models"][0]["misses"] == 2, what="the report, flushed")
    assert stats(running_daemon)["models"][0]["loads_done"] == 0


def test_a_give_goes_out_while_the_miss_is_read(running_daemon, model_files, monkeypatch):
    # The donor's thread looks at its queue only when woken (or each TICK_S, here never): the desk can offer slots
    # before the read is done only if the read woke it (_native.wake_when_reading).
    monkeypatch.setattr(donor_module, "TICK_S", 3600.0)
    with filling_pool(model_files, running_daemon) as pool:
        read_done = pool.donor.read_done

        def offered_first(gifts, whole):
            wait_for(lambda: fills(running_daemon)["offered"] == 3, what="the desk's offers, before the read is done",
                     detail=lambda: fills(running_daemon))
            read_done(gifts, whole)

        monkeypatch.setattr(pool.donor, "read_done", offered_first)
        assert pool.fetch(2, [1, 4, 6]).l3_reads == 3
        wait_for(lambda: fills(running_daemon)["donated"] == 3, what="three donations",
                 detail=lambda: fills(running_daemon))
    for expert in (1, 4, 6):
        assert slot_record(model_files, running_daemon, 2, expert) == model_files.read_record(2, expert)


def test_wait_answered_holds_until_the_desk_took_every_give_then_the_daemons_idle_means_l2_holds_them(
        running_daemon, model_files, monkeypatch):
    # What the bench waits for between passes (lab/replayer.py, lab/bench.py): the donor's thread is held before
    # it tells the desk anything, so the gives stay unanswered until it is let go.
    with filling_pool(model_files, running_daemon) as pool:
        send_queued, let_go = pool.donor._send_queued, threading.Event()

        def held():
            let_go.wait()
            send_queued()

        monkeypatch.setattr(pool.donor, "_send_queued", held)
        pool.donor._wake()
        assert pool.fetch(1, [0, 5]).l3_reads == 2
        assert not pool.donor.wait_answered(0.2)
        let_go.set()
        assert pool.donor.wait_answered(10)
        wait_idle(running_daemon.socket)  # the daemon's copies and loads: no waiting on the figures themselves
        for expert in (0, 5):
            assert slot_record(model_files, running_daemon, 1, expert) == model_files.read_record(1, expert)


needs_root = pytest.mark.skipif(not nobody_runs_python(),
                                reason="the hostile side runs as uid 65534: needs root, setpriv, and this "
                                       "interpreter's packages readable by other users (a private venv is not)")


def slot_meta(files, daemon, layer: int, slot: int) -> tuple[int, int, int]:
    """(expert, seq, checksum) of a slot as the index holds it now."""
    index_name, data_names = daemon_segments(daemon, files)
    index = _native.Segment.open(index_name, readonly=True)
    try:
        g = IndexHeader.unpack(index.view()).geometry
        return g.slot_index(index, layer, g.layer_slots(range(files.n_layers))[layer]).meta(slot)
    finally:
        index.close()


@pytest.fixture(scope="module")
def packed_model(tmp_path_factory, model_dir):
    from moe_l2.model.packer import pack
    return pack(model_dir, tmp_path_factory.mktemp("fills") / "packed", progress=False, moe_l2_only=True).path


@pytest.mark.parametrize("manifest", [False, True], ids=["no-manifest", "manifest"])
def test_a_fill_claimed_but_not_made_publishes_nothing(daemon_factory, model_dir, packed_model, manifest):
    """A donor says filled with the record's true checksum, yet copied only half of it: the daemon's own check of
    the slot (against the manifest where there is one, the donor's checksum where not) refuses it."""
    path = packed_model if manifest else model_dir
    files = ModelFiles.open(path)
    assert (files.checksums is not None) == manifest
    daemon = daemon_factory([path], quarter_budget(files))
    donor = RawDonor(daemon)
    slot = donor.offer(files, 1, 6)
    record = files.read_record(1, 6)
    _, data_names = daemon_segments(daemon, files)
    data = _native.Segment.open(data_names[1], readonly=False)
    stride = slot_stride(files, daemon)
    half = len(record) // 2
    data.view()[slot * stride:slot * stride + half] = record[:half]
    donor.sock.sendall(encode("filled", model=files.fingerprint, layer=1, expert=6, slot=slot,
                              checksum=files.layout.checksum(record)))
    wait_for(lambda: fills(daemon)["rejected"] == 1, what="the fill rejected", detail=lambda: fills(daemon))
    assert slot_record(files, daemon, 1, 6) is None  # L2 does not hold it: nothing was published
    expert, seq, _ = slot_meta(files, daemon, 1, slot)
    assert expert == -1 and seq % 2 == 0  # the slot is free again, closed
    assert fills(daemon)["donated"] == 0
    donor.sock.close()
    data.close()


def test_a_packed_record_is_copied_into_l2_as_it_lands_not_when_the_read_ends(daemon_factory, packed_model,
                                                                           monkeypatch):
    """A packed model is read record by record, and each says so as it lands (pread_scatter's landed words): the
    donor copies it into its slot then, with no word of the whole read's end (read_done, never told here)."""
    monkeypatch.setattr(donor_module.Donor, "read_done", lambda self, gifts, whole: None)
    files = ModelFiles.open(packed_model)
    daemon = daemon_factory([packed_model], quarter_budget(files))
    k = files.top_k
    with filling_pool(files, daemon) as pool:
        assert pool.fetch(0, list(range(k))).l3_reads == k
        wait_for(lambda: fills(daemon)["donated"] == k, what="the records copied as they landed",
                 detail=lambda: fills(daemon))
        assert pool.donor.counts.cancelled == 0
    assert stats(daemon)["models"][0]["loads_done"] == 0
    for expert in range(k):
        assert slot_record(files, daemon, 0, expert) == files.read_record(0, expert)


def test_a_row_read_again_is_not_given_before_its_new_record_lands(daemon_factory, packed_model, monkeypatch):
    """A row's landed word is cleared as the row is handed out again: the offers for the next experts read into the
    same rows, taken while their read has not started, wait for it, and are never answered with the records the rows
    held before (which the daemon's check against the manifest would refuse)."""
    files = ModelFiles.open(packed_model)
    daemon = daemon_factory([packed_model], str(budget_for(files, 8)))  # room for both batches
    first, then = [0, 1, 2, 3], [4, 5, 6, 7]
    real_read, offers_in = ModelFiles.read_into_rows, threading.Event()

    def read_into_rows(self, fds, layer, targets, *args, **kwargs):
        if [expert for expert, _ in targets] == then:  # the donor's thread takes the offers before this read begins
            assert offers_in.wait(10), "the offers for the second experts did not come"
        return real_read(self, fds, layer, targets, *args, **kwargs)

    monkeypatch.setattr(ModelFiles, "read_into_rows", read_into_rows)
    with filling_pool(files, daemon) as pool:
        assert pool.fetch(0, first).l3_reads == 4
        wait_for(lambda: fills(daemon)["donated"] == 4, what="the first experts' donations")
        for expert in first:
            pool.evict(0, expert)

        def offers_taken():
            wait_for(lambda: pool.donor.counts.given == 8, what="the second experts given")
            if pool.donor.wait_answered(10):
                offers_in.set()

        taken = threading.Thread(target=offers_taken)
        taken.start()
        assert pool.fetch(0, then).l3_reads == 4
        taken.join()
        wait_for(lambda: fills(daemon)["donated"] == 8, what="the second experts' donations",
                 detail=lambda: fills(daemon))
        assert pool.donor.counts.filled == 8 and pool.donor.counts.cancelled == 0
    assert fills(daemon)["rejected"] == 0
    for expert in first + then:
        assert slot_record(files, daemon, 0, expert) == files.read_record(0, expert)


KILLED_DONOR = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from moe_l2 import _native
    from moe_l2.model import ModelFiles
    from tests.conftest import RawDonor
    class Daemon:
        socket = {address!r}
    files = ModelFiles.open({model!r})
    donor = RawDonor(Daemon)
    slot = donor.offer(files, 0, 5)
    data = _native.Segment.open({data!r}, readonly=False)
    data.view()[slot * {stride}:slot * {stride} + 4096] = b"\\xab" * 4096  # a quarter of a fill, then stopped
    print(slot, flush=True)
    donor.sock.close()
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def test_a_donor_stopped_mid_fill_keeps_its_slot_until_its_process_is_gone_and_nothing_torn_is_published(
        running_daemon, model_dir, model_files):
    _, data_names = daemon_segments(running_daemon, model_files)
    stride = slot_stride(model_files, running_daemon)
    code = KILLED_DONOR.format(tests=str(os.path.dirname(os.path.dirname(__file__))), address=running_daemon.socket,
                               model=str(model_dir), data=data_names[0], stride=stride)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        slot = int(child.stdout.readline())
        # Its connection is closed, its process stopped (it could still write): the slot stays its own.
        wait_for(lambda: stats(running_daemon)["daemon"]["fills"]["awaiting_exit"] == 1, what="the hang-up seen")
        expert, seq, _ = slot_meta(model_files, running_daemon, 0, slot)
        assert expert == -1 and seq % 2 == 1  # still being filled: every reader passes it by
        assert slot_record(model_files, running_daemon, 0, 5) is None
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    wait_for(lambda: fills(running_daemon)["reclaimed"] == 1, what="the slot reclaimed once the donor was gone")
    assert stats(running_daemon)["daemon"]["fills"]["awaiting_exit"] == 0
    expert, seq, _ = slot_meta(model_files, running_daemon, 0, slot)
    assert expert == -1 and seq % 2 == 0 and slot_record(model_files, running_daemon, 0, 5) is None
    # The record can be given again, whole, by a live donor.
    with filling_pool(model_files, running_daemon) as pool:
        assert_given(pool, running_daemon, model_files, 0, 5)


NOBODY_DONOR = textwrap.dedent("""
    import socket
    from moe_l2 import _native
    from moe_l2.fill_protocol import FrameReader, encode
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect({path!r})
    reader, messages = FrameReader(("welcome", "refused", "offer")), []
    while data := s.recv(65536):
        messages += reader.feed(data)
    print(" ".join(m.type for m in messages))
    try:
        s.sendall(encode("give", model={model!r}, layer=0, experts=[1], keep=[]))
    except OSError:
        pass
    try:
        _native.Segment.open({data!r}, readonly=False)
        print("opened writable")
    except PermissionError:
        print("not writable")
""")


@needs_root
def test_a_process_of_another_uid_is_refused_a_fill_and_cannot_write_l2(running_daemon, model_files):
    path = fill_socket_path(running_daemon.socket)
    assert os.stat(path).st_mode & 0o777 == 0o600  # the file's mode keeps other users out first
    os.chmod(running_daemon.runtime_dir, 0o755)
    os.chmod(path, 0o666)  # past the mode: the desk's own check of the peer's uid refuses it
    _, data_names = daemon_segments(running_daemon, model_files)
    result = subprocess.run([*AS_NOBODY, sys.executable, "-P", "-c",
                             NOBODY_DONOR.format(path=path, model=model_files.fingerprint, data=data_names[0])],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.split("\n")[:2] == ["refused", "not writable"], result.stderr
    assert stats(running_daemon)["daemon"]["fills"]["turned_away"] == 1
    assert fills(running_daemon)["offered"] == 0
    assert slot_record(model_files, running_daemon, 0, 1) is None


def test_a_donor_follows_the_daemon_across_a_restart(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], quarter_budget(model_files))
    client = L2Client(model_files, daemon.socket, wait_s=5, heartbeat_s=0.2)
    pool = ExpertPool(model_files, capacity=4, client=client, fill_l2=True, lend=False)
    try:
        wait_for(lambda: pool.donor.accepting, what="the fill desk's welcome")
        pool.fetch(0, [3])
        wait_for(lambda: fills(daemon)["donated"] == 1, what="the first daemon's donation")
        first = client.attachment.epoch
        daemon.stop()
        daemon.unlink_leftovers()
        again = daemon_factory([model_dir], quarter_budget(model_files), runtime_dir=daemon.runtime_dir)
        wait_for(lambda: client.attached and client.attachment.epoch != first and pool.donor.accepting,
                 what="the donor welcomed by the new daemon")
        assert_given(pool, again, model_files, 0, 4)
    finally:
        pool.close()
        client.close()


def test_a_donation_cancelled_is_read_by_the_daemon_so_that_l2_holds_the_record(running_daemon, model_files):
    donor = RawDonor(running_daemon)
    slot = donor.offer(model_files, 2, 8)
    donor.sock.sendall(encode("cancelled", model=model_files.fingerprint, layer=2, expert=8, slot=slot))
    wait_for(lambda: stats(running_daemon)["models"][0]["loads_done"] == 1, what="the daemon's read")
    assert fills(running_daemon)["cancelled"] == 1 and fills(running_daemon)["donated"] == 0
    assert slot_record(model_files, running_daemon, 2, 8) == model_files.read_record(2, 8)
    donor.sock.close()


def test_a_give_or_look_with_an_id_out_of_range_is_offered_nothing_and_changes_nothing(running_daemon, model_files):
    donor = RawDonor(running_daemon)
    fp, n = model_files.fingerprint, model_files.n_experts
    for model, layer, experts in ((fp, 1, [3, n]), (fp, 1, [-1]), (fp, model_files.n_layers, [3]), ("other", 1, [3])):
        donor.sock.sendall(encode("look", model=model, layer=layer, experts=experts))  # not answered: ignored
    for experts, keep in (([3, n], []), ([3], [-1])):
        donor.sock.sendall(encode("give", model=fp, layer=1, experts=experts, keep=keep))
        offer = donor.next()
        assert (offer.type, offer.slots) == ("offer", [])
    layer = stats(running_daemon)["models"][0]["layers"][1]
    assert (layer["loading"], layer["resident"], fills(running_daemon)["offered"]) == (0, 0, 0)
    donor.offer(model_files, 1, 3)  # the desk serves on
    donor.sock.close()


class WatchedCondition(threading.Condition):
    """The shared rows' `copied`, saying once a layer has waited on it."""

    def __init__(self, lock):
        super().__init__(lock)
        self.waited = threading.Event()

    def wait(self, timeout=None):
        self.waited.set()
        return super().wait(timeout)


@contextmanager
def shared_pool_with_copies_held(files, daemon, monkeypatch):
    """A filling pool with one shared L0 of top-k rows whose donor learns of no read's end until `release()`: the
    rows of layer 0's misses, their slots offered, stay the donor's, to copy, while the test looks."""
    held, go = [], threading.Event()
    real_read_done = donor_module.Donor.read_done

    def read_done(self, gifts, whole):
        if go.is_set():
            return real_read_done(self, gifts, whole)
        held.append((self, list(gifts), whole))

    def release():
        go.set()
        for donor, gifts, whole in held:
            real_read_done(donor, gifts, whole)

    monkeypatch.setattr(donor_module.Donor, "read_done", read_done)
    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, capacity=files.top_k, client=client, fill_l2=True, lend=False, shared_l0=True)
    try:
        wait_for(lambda: pool.donor.accepting, what="the fill desk's welcome")
        rows = pool.layers[0].rows
        rows.copied = WatchedCondition(rows.lock)
        k = files.top_k
        assert pool.fetch(0, list(range(k))).l3_reads == k
        wait_for(lambda: sum(rows.offered.values()) == k, what="the slots of layer 0's misses offered")
        yield pool, release
    finally:
        if not go.is_set():
            release()
        pool.close()
        client.close()


def test_a_layer_waits_for_its_donor_to_copy_a_row_whose_slot_is_offered_instead_of_cancelling(
        running_daemon, model_files, monkeypatch):
    """Layer 1's misses need every row, all still being given from layer 0, their slots offered: the layer waits
    for the donor's copies (the donor alone, not moe-l2d), so nothing is cancelled and nothing read twice."""
    monkeypatch.setattr(layerpool, "DONATION_WAIT_S", 60.0)
    k = model_files.top_k
    with shared_pool_with_copies_held(model_files, running_daemon, monkeypatch) as (pool, release):
        fetched = []
        fetch = threading.Thread(target=lambda: fetched.append(pool.fetch(1, list(range(k)))))
        fetch.start()
        rows = pool.layers[1].rows
        wait_for(rows.copied.waited.is_set, what="layer 1 waiting for the copies")
        release()
        fetch.join(60)
        assert fetched[0].l3_reads == k
        wait_for(lambda: fills(running_daemon)["donated"] == 2 * k, what="both layers' donations",
                 detail=lambda: fills(running_daemon))
        assert pool.donor.counts.cancelled == 0
    model = stats(running_daemon)["models"][0]
    assert model["loads_done"] == 0 and model["fills"]["cancelled"] == 0
    for layer in (0, 1):
        for expert in range(k):
            assert slot_record(model_files, running_daemon, layer, expert) == model_files.read_record(layer, expert)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")
def test_the_donor_maps_an_offered_slot_while_the_read_runs(running_daemon, model_files, monkeypatch):
    """The slots offered for layer 0's misses are mapped for writing while their reads still run (held), so that
    the copy after the read takes no page fault; a slot not offered (layer 1's) is not; the copies land exact. The
    same slots offered again (L2 holds top-k experts a layer) are not asked for again."""
    k = model_files.top_k
    stride = slot_stride(model_files, running_daemon)
    page = os.sysconf("SC_PAGESIZE")
    with shared_pool_with_copies_held(model_files, running_daemon, monkeypatch) as (pool, release):
        segment = pool.donor._writable[0]
        offered = sorted(gift.slot for gift in pool.donor._offered)
        assert len(offered) == k
        wait_for(lambda: all(pages_mapped(segment.address + slot * stride, stride) == stride // page
                             for slot in offered), what="the offered slots mapped before their reads end")
        assert pages_mapped(pool.donor._writable[1].address, stride) == 0  # layer 1 gave nothing
        assert pool.donor.counts.mapped == k
        release()
        wait_for(lambda: fills(running_daemon)["donated"] == k, what="layer 0's donations")
        through, held = donor_module.Donor.read_done, []
        monkeypatch.setattr(donor_module.Donor, "read_done",
                            lambda self, gifts, whole: held.append((self, list(gifts), whole)))
        assert pool.fetch(0, list(range(k, 2 * k))).l3_reads == k
        rows = pool.layers[0].rows
        wait_for(lambda: sum(rows.offered.values()) == k, what="the same slots offered for k other experts")
        for args in held:
            through(*args)
        wait_for(lambda: fills(running_daemon)["donated"] == 2 * k, what="the second donations",
                 detail=lambda: fills(running_daemon))
        assert pool.donor.counts.mapped == k
    for expert in range(k, 2 * k):
        assert slot_record(model_files, running_daemon, 0, expert) == model_files.read_record(0, expert)


def test_a_copy_that_does_not_come_is_waited_for_only_so_long_and_its_donation_read_by_the_daemon(
        running_daemon, model_files, monkeypatch):
    """The donor's copies held past DONATION_WAIT_S: layer 1 takes the rows and goes on; the donations those rows
    held are cancelled once the donor looks, and moe-l2d reads them, so that L2 still holds them exact."""
    monkeypatch.setattr(layerpool, "DONATION_WAIT_S", 0.05)
    k = model_files.top_k
    with shared_pool_with_copies_held(model_files, running_daemon, monkeypatch) as (pool, release):
        assert pool.fetch(1, list(range(k))).l3_reads == k  # returns with the copies still held
        assert pool.layers[1].rows.copied.waited.is_set()
        release()
        wait_for(lambda: pool.donor.counts.cancelled == k and fills(running_daemon)["donated"] == k,
                 what="layer 0's donations cancelled, layer 1's filled", detail=lambda: fills(running_daemon))
    wait_for(lambda: stats(running_daemon)["models"][0]["loads_done"] == k, what="the daemon's reads")
    for layer in (0, 1):
        for expert in range(k):
            assert slot_record(model_files, running_daemon, layer, expert) == model_files.read_record(layer, expert)
