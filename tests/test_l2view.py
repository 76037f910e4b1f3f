"""Zero-copy L2 reads (client/l2view.py): MLX arrays over the daemon's shared memory, loans of its slots, and
streamed forwards that compute on them, against ground truth (the model file, the model loaded whole)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from moe_l2 import _native
from moe_l2.client.l2view import L2View
from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.client.pool import ExpertPool
from moe_l2.layout import Geometry
from moe_l2.model import ModelFiles

from .conftest import (assert_resident_exact, assert_same_as_whole, budget_for, daemon_segments, made_and_loaded_whole,
                       stats, wait_for)

PAGE = os.sysconf("SC_PAGE_SIZE")
TEXT = ("The cache keeps the experts that the router picks most often close to the model, and reads "
        "the others from the file when a token asks for them. ")
ARCHS = {
    "qwen3_moe": dict(arch="qwen3_moe", bits=4),
    "mixtral-8bit": dict(arch="mixtral", bits=8, per_expert=True),
    "gpt_oss": dict(arch="gpt_oss", bits=4),  # expert biases: gathered from the view too
    "deepseek_v3": dict(arch="deepseek_v3", bits=4),
}
DIMS = dict(layers=3, experts=16, top_k=4, hidden_size=128, moe_hidden_size=64, seed=9)


@pytest.fixture
def segment():
    name = f"/ml2t{os.getpid() % 100000}v"
    seg = _native.Segment.create(name, 4 * PAGE, 0o600)
    yield name, seg
    seg.close()
    _native.Segment.unlink(name)


def test_a_segment_array_is_a_strided_view_of_the_mapped_bytes(segment):
    name, seg = segment
    words = np.frombuffer(seg, dtype=np.uint32)
    words[:] = np.arange(words.size, dtype=np.uint32)
    ro = _native.Segment.open(name, readonly=True)
    stride = PAGE // 4
    view = ro.array(64, [4, 4, 8], [stride, 8, 1], mx.uint32)
    want = np.stack([words[s * stride + 16:s * stride + 16 + 32].reshape(4, 8) for s in range(4)])
    ro.close()  # the view keeps the mapping
    assert np.array_equal(np.array(view), want)
    assert np.array_equal(np.array(view[mx.array([3, 1])]), want[[3, 1]])
    words[stride + 16] = 7  # a write through another mapping is seen: no copy was made
    assert np.array(view)[1, 0, 0] == 7


def test_segment_array_refuses_what_does_not_fit(segment):
    name, seg = segment
    with pytest.raises(ValueError, match=r"\[Segment.array\] bytes .* are outside"):
        seg.array(0, [5, 4], [PAGE // 4, 1], mx.uint32)
    with pytest.raises(ValueError, match=r"\[Segment.array\] offset 2 is not a multiple"):
        seg.array(2, [2], [1], mx.uint32)
    with pytest.raises(ValueError, match=r"\[Segment.array\] shape and strides"):
        seg.array(0, [2, 2], [1], mx.uint32)
    with pytest.raises(ValueError, match=r"\[Segment.array\] stride must be >= 0"):
        seg.array(0, [2, 2], [-2, 1], mx.uint32)


def test_gather_qmm_on_slots_in_a_segment_matches_contiguous_weights(segment):
    """The kernels read a view whose rows are a page apart exactly as they read packed weights."""
    name, seg = segment
    w, scales, biases = mx.quantize(mx.random.normal((4, 32, 64), key=mx.random.key(1)), group_size=32, bits=4)
    mx.eval(w, scales, biases)
    buf = np.frombuffer(seg, dtype=np.uint8)
    pieces = {}
    for at, arr in ((0, w), (1024, scales), (2048, biases)):
        raw = np.array(arr).view(np.uint8).reshape(4, -1)
        for slot in range(4):
            buf[slot * PAGE + at:slot * PAGE + at + raw.shape[1]] = raw[(slot + 1) % 4]  # slot s holds expert s+1
        item = arr.dtype.size
        rest = [arr.shape[2], 1]
        pieces[at] = seg.array(at, [4, *arr.shape[1:]], [PAGE // item, *rest], arr.dtype)
    x = mx.random.normal((6, 1, 64), key=mx.random.key(2))
    experts = mx.array([0, 3, 2, 1, 1, 0], dtype=mx.uint32)
    slots = (experts + 3) % 4
    want = mx.gather_qmm(x, w, scales, biases, rhs_indices=experts, transpose=True, group_size=32, bits=4)
    got = mx.gather_qmm(x, pieces[0], pieces[1024], pieces[2048], rhs_indices=slots, transpose=True,
                        group_size=32, bits=4)
    assert mx.array_equal(got, want).item()


def full_budget_daemon(daemon_factory, path):
    files = ModelFiles.open(path)
    return daemon_factory([path], str(budget_for(files, files.n_experts)))


def warm(daemon, files: ModelFiles) -> None:
    """Every expert of every layer loaded into the daemon's L2 (reported as misses by a throwaway pool)."""
    from moe_l2.client.connection import L2Client

    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, files.n_experts, client)
    for layer in range(files.n_layers):
        pool.fetch(layer, range(files.n_experts))
    pool.close()
    client.close()
    wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="loads")


def test_a_reports_misses_never_evict_the_experts_it_names(daemon_factory, model_dir, model_files):
    """L2 of two slots a layer holds 0 and 1 (LFU: 1 looked up more often). A report of the batch {0, 2}, 0 found
    and 2 missing, loads 2 over 1, not over 0, which its client may be computing on in place."""
    from moe_l2.client.connection import L2Client

    daemon = daemon_factory([model_dir], str(budget_for(model_files, 2)), "--policy", "lfu")
    client = L2Client(model_files, daemon.socket, wait_s=5)
    pool = ExpertPool(model_files, model_files.top_k, client)
    seen = 0

    def report(hits, misses):
        # One at a time: the client merges reports it queues together.
        nonlocal seen
        client.report(0, hits, misses, [*hits, *misses])
        seen += len(hits) + len(misses)
        wait_for(lambda: stats(daemon)["models"][0]["hits"] + stats(daemon)["models"][0]["misses"] == seen,
                 what="the report")

    try:
        view = pool._l2_view()
        for expert in (0, 1):
            report([], [expert])
            wait_for(lambda: view.lend(0, [expert]), what=f"expert {expert} in L2")
        for _ in range(3):
            report([1], [])
        report([0], [2])
        wait_for(lambda: view.lend(0, [2]), what="expert 2 in L2")
        assert view.lend(0, [0, 1, 2]).experts == (0, 2)
    finally:
        pool.close()
        client.close()


def test_a_loan_reads_the_files_records_and_sees_a_rewrite(daemon_factory, model_dir, model_files):
    from moe_l2.client.connection import L2Client

    daemon = full_budget_daemon(daemon_factory, model_dir)
    warm(daemon, model_files)
    client = L2Client(model_files, daemon.socket, wait_s=5)
    try:
        pool = ExpertPool(model_files, model_files.top_k, client)
        layer, experts = 1, [5, 0, 3]
        counts, loan = pool.borrow(layer, experts)
        assert sorted(loan.experts) == sorted(experts) and counts.l2_hits == 3 and counts.l3_reads == 0
        arrays, slot_of = loan.arrays(), loan.slot_of()
        for expert in experts:
            record = model_files.read_record(layer, expert)
            for p in model_files.layout.pieces:
                got = np.array(arrays[p.key][slot_of[expert]]).tobytes()
                assert got == record[p.offset:p.offset + p.nbytes]
        assert loan.torn() == []
        evict_in_shm(daemon, model_files, layer, 3, slot_of[3])
        assert loan.torn() == [3]
        assert pool.borrow(layer, [3])[1] is None  # gone from L2: nothing to lend
        pool.close()
    finally:
        client.close()


def test_a_budget_between_whole_slots_per_layer_is_spent_and_every_layer_lends_and_copies_whole_records(
        daemon_factory, model_dir, model_files, capsys):
    """A budget of 2 slots in every layer and 1 more in all but one: the daemon spends it all (3 slots in the
    first layers, 2 in the last), and clients lend and copy exact records from both kinds of layer."""
    from moe_l2.cli import main as cli
    from moe_l2.client.connection import L2Client

    files, last = model_files, model_files.n_layers - 1
    stride = Geometry(files.n_layers, files.n_experts, 2, files.layout.nbytes).slot_stride
    budget = budget_for(files, 2) + last * stride
    daemon = daemon_factory([model_dir], str(budget))
    (m,) = stats(daemon)["models"]
    assert (m["slots_per_layer"], m["short_layers"]) == (3, 1)
    assert [layer["slots"] for layer in m["layers"]] == [3] * last + [2]
    assert m["shm_bytes"] <= budget < m["shm_bytes"] + stride
    assert cli(["stats", "--socket", daemon.socket]) == 0
    assert "2-3 slots per layer" in capsys.readouterr().out
    client = L2Client(files, daemon.socket, wait_s=5)
    try:
        assert client.attachment.slots == (3,) * last + (2,)
        pool = ExpertPool(files, files.n_experts, client)
        view = L2View(client.attachment, files.layout)
        for layer in (0, last):
            held = list(range(client.attachment.slots[layer]))
            pool.fetch(layer, held)  # misses: the daemon loads them, filling the layer's every slot
            wait_for(lambda: len(view.lend(layer, held).experts) == len(held), what=f"layer {layer} in L2")
            loan = view.lend(layer, held)
            assert sorted(loan.slots) == held
            arrays, slot_of = loan.arrays(), loan.slot_of()
            for expert in held:
                record = files.read_record(layer, expert)
                for p in files.layout.pieces:
                    assert np.array(arrays[p.key][slot_of[expert]]).tobytes() == record[p.offset:p.offset + p.nbytes]
        copier = ExpertPool(files, files.top_k, client, lend=False)
        for layer in (0, last):
            assert copier.fetch(layer, [0, 1]).l2_hits == 2
            assert_resident_exact(copier, files, layer, [0, 1])
        copier.close()
        pool.close()
    finally:
        client.close()


def evict_in_shm(daemon, files: ModelFiles, layer: int, expert: int, slot: int) -> None:
    """What the daemon does to a slot it refills, done from outside: under the slot's seqlock the expert is
    unmapped and the bytes overwritten."""
    g = _geometry(daemon, files)
    index_name, data_names = daemon_segments(daemon, files)
    index = _native.Segment.open(index_name, readonly=False)
    data = _native.Segment.open(data_names[layer], readonly=False)
    slots = g.slot_index(index, layer, data.nbytes // g.slot_stride, data)
    slots.begin_fill(slot, evicted=expert)
    data.view()[slot * g.slot_stride:slot * g.slot_stride + g.record_bytes] = os.urandom(g.record_bytes)
    slots.abort_fill(slot)
    index.close()
    data.close()


def _geometry(daemon, files: ModelFiles):
    from moe_l2.layout import IndexHeader

    index_name, _ = daemon_segments(daemon, files)
    index = _native.Segment.open(index_name, readonly=True)
    try:
        return IndexHeader.unpack(index.view()).geometry
    finally:
        index.close()


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_model(request, tmp_path_factory):
    return made_and_loaded_whole(tmp_path_factory, "l2view", request.param, **DIMS, **ARCHS[request.param])


def test_experts_computed_in_l2_give_the_whole_models_logits(arch_model, daemon_factory):
    path, whole, tokenizer = arch_model
    files = ModelFiles.open(path)
    daemon = full_budget_daemon(daemon_factory, path)
    warm(daemon, files)
    ids = tokenizer.encode(TEXT * 6)
    for slots in (files.top_k, files.n_experts):  # the least a token needs, and every expert
        with StreamedLM(path, l0_slots=slots, socket=daemon.socket, client_wait_s=5) as lm:
            assert lm.client.attached
            # 1 and 12 tokens: mlx-lm's unsorted kernels; 40 tokens x top 4: its sorted ones.
            for n in (1, 12, 40):
                x = mx.array(ids[:n])[None]
                assert_same_as_whole(lm.model(x), whole(x), chunked=False)
            assert lm.stats.lent_calls > 0 and lm.stats.torn_calls == 0
            assert lm.pool.counts.l2_hits > 0 and lm.pool.counts.bytes_copied == 0


def test_a_shared_l0_streams_the_whole_models_tokens_with_and_without_a_daemon(daemon_factory, model_dir,
                                                                              model_files):
    """L0 rows shared by every layer (top-k in all, the least the forward needs) beside a warm L2, a cold L2,
    and no daemon: greedy tokens are the whole model's."""
    from mlx_lm.generate import stream_generate

    whole, tokenizer = load(str(model_dir))
    ids = mx.array(tokenizer.encode(TEXT * 3))

    def greedy(model, tok):
        return [r.token for r in stream_generate(model, tok, ids, max_tokens=12, prefill_step_size=16)]

    expected = greedy(whole, tokenizer)
    daemon = full_budget_daemon(daemon_factory, model_dir)
    for warm_l2 in (False, True):
        # Without load-through, so that the cold misses are read from the file.
        with StreamedLM(model_dir, l0_slots=model_files.top_k, socket=daemon.socket, client_wait_s=5,
                        shared_l0=True, load_through_ms=0) as lm:
            assert lm.pool.nbytes == model_files.top_k * model_files.layout.stride
            assert greedy(lm.model, lm.tokenizer) == expected
            # Cold, prefill batches needed more experts than the rows in all; warm, L2 lent them all.
            assert (lm.stats.chunked_calls > 0) != warm_l2
            # Cold, the misses are read from the file (and loaded by the daemon); warm, L2 holds every expert.
            assert (lm.pool.counts.l3_reads == 0) == warm_l2 and lm.stats.lent_calls > 0
        wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="loads")
    with StreamedLM(model_dir, l0_slots=model_files.top_k + 2, daemon=False, shared_l0=True) as lm:
        assert greedy(lm.model, lm.tokenizer) == expected


def test_a_slot_rewritten_during_the_layer_is_computed_again(daemon_factory, model_dir, model_files, monkeypatch):
    """Every lent slot is rewritten between the loan and the layer's evaluation: the layer reads garbage,
    sees the seqlocks moved, and is computed again from the file; the logits stay the whole model's."""
    whole, tokenizer = load(str(model_dir))
    daemon = full_budget_daemon(daemon_factory, model_dir)
    warm(daemon, model_files)
    lend = L2View.lend

    def lend_then_rewrite(self, layer, experts):
        loan = lend(self, layer, experts)
        for expert, slot in zip(loan.experts, loan.slots):
            evict_in_shm(daemon, model_files, layer, expert, slot)
        return loan

    monkeypatch.setattr(L2View, "lend", lend_then_rewrite)
    ids = mx.array(tokenizer.encode(TEXT)[:12])[None]
    with StreamedLM(model_dir, l0_slots=model_files.n_experts, socket=daemon.socket, client_wait_s=5) as lm:
        assert_same_as_whole(lm.model(ids), whole(ids), chunked=False)
        assert lm.stats.torn_calls == lm.stats.lent_calls > 0
        assert lm.pool.counts.l3_reads > 0  # the evicted records came from the file


def test_lend_off_copies_every_l2_hit(daemon_factory, model_dir, model_files):
    whole, tokenizer = load(str(model_dir))
    daemon = full_budget_daemon(daemon_factory, model_dir)
    warm(daemon, model_files)
    ids = mx.array(tokenizer.encode(TEXT)[:12])[None]
    with StreamedLM(model_dir, l0_slots=model_files.n_experts, socket=daemon.socket, client_wait_s=5,
                    l2_reads="copy") as lm:
        assert_same_as_whole(lm.model(ids), whole(ids), chunked=False)
        assert lm.stats.lent_calls == 0
        assert lm.pool.counts.bytes_copied == lm.pool.counts.l2_hits * model_files.layout.nbytes > 0
