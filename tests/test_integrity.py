"""Integrity of model data (docs/formats.md, "Checksums"): packed models carry a checksum manifest, `moe-l2 verify
--manifest` writes one for any model, and a record damaged on disk in place (same size, same mtime) is never
published by a real daemon, is refused by the client pool, and is reported by `moe-l2 verify`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from moe_l2 import _native, protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.random_models import make_gguf_model
from moe_l2.model import MANIFEST_NAME, CorruptRecord, ModelFiles
from moe_l2.model.packer import pack

from .conftest import assert_resident_exact, budget_for, corrupt_in_place, stats, wait_for


def moe_l2(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("moe-l2"), *args], capture_output=True, text=True, timeout=timeout)


def record_checksums(files: ModelFiles) -> list[list[int]]:
    """Ground truth: the checksum of every record as read whole from the file."""
    return [[files.layout.checksum(files.read_record(layer, e)) for e in range(files.n_experts)]
            for layer in range(files.n_layers)]


@pytest.fixture(scope="module")
def packed_model(tmp_path_factory, model_dir):
    return pack(model_dir, tmp_path_factory.mktemp("integrity") / "packed", progress=False, moe_l2_only=True).path


@pytest.fixture
def packed_copy(tmp_path, packed_model) -> ModelFiles:
    """A private copy of the packed model (times kept, so its manifest stays current), free to damage."""
    shutil.copytree(packed_model, tmp_path / "packed")
    files = ModelFiles.open(tmp_path / "packed")
    assert files.checksums is not None, files.checksum_problem
    return files


def test_a_packed_model_carries_a_manifest_of_its_records_that_verify_accepts(model_files, packed_model):
    files = ModelFiles.open(packed_model)
    assert files.format == "packed" and files.checksum_problem is None
    expected = record_checksums(model_files)
    assert [list(row) for row in files.checksums.checksums] == expected == record_checksums(files)
    on_disk = json.loads((packed_model / MANIFEST_NAME).read_text())
    assert on_disk["fingerprint"] == files.content_fingerprint and on_disk["layers"] == expected
    result = moe_l2("verify", "--model", str(packed_model), "--no-daemon", "--all")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"checked {files.n_layers * files.n_experts} experts" in result.stdout
    assert f"checksums checked against {packed_model / MANIFEST_NAME}; 0 mismatches" in result.stdout


def test_verify_manifest_writes_then_checks_a_safetensors_model(tmp_path, model_dir):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    files = ModelFiles.open(model)
    assert files.checksums is None and files.checksum_problem is None
    plain = moe_l2("verify", "--model", str(model), "--no-daemon", "--samples", "8")
    assert plain.returncode == 0 and "no checksum manifest (`moe-l2 verify --manifest` writes one)" in plain.stdout

    written = moe_l2("verify", "--model", str(model), "--manifest")
    assert written.returncode == 0, written.stderr
    assert f"wrote {model / MANIFEST_NAME}" in written.stdout
    files = ModelFiles.open(model)
    assert [list(row) for row in files.checksums.checksums] == record_checksums(files)
    # A current manifest: --manifest now checks every record against it.
    checked = moe_l2("verify", "--model", str(model), "--manifest", "--no-daemon")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"checked {files.n_layers * files.n_experts} experts" in checked.stdout and "0 mismatches" in checked.stdout

    corrupt_in_place(files, 2, 5)
    assert ModelFiles.open(model).fingerprint == files.fingerprint  # invisible to the fingerprint
    result = moe_l2("verify", "--model", str(model), "--no-daemon", "--all")
    assert result.returncode == 1
    damaged = files.files[files.extents(2, 5)[0][0]]
    assert ("MISMATCH layer 2 expert 5 (from L3): the model file fails its checksum" in result.stdout
            and f"{damaged} is damaged" in result.stdout)
    assert "1 mismatches (L2 0, L3 1)" in result.stdout


def test_a_stale_or_damaged_manifest_is_reported_with_the_fix(tmp_path, packed_copy):
    model = packed_copy.path
    shard = packed_copy.files[packed_copy.record_span(0, 0)[0]]
    os.utime(shard, ns=(0, os.stat(shard).st_mtime_ns + 10**9))  # the model changed: its fingerprint did
    files = ModelFiles.open(model)
    assert files.checksums is None
    assert "is stale" in files.checksum_problem
    fix = f"run `moe-l2 verify --model {model} --manifest` to write a new one"
    assert fix in files.checksum_problem
    result = moe_l2("verify", "--model", str(model), "--no-daemon", "--samples", "4")
    assert result.returncode == 1 and "is stale" in result.stderr and fix in result.stderr
    assert "no usable checksum manifest; 0 mismatches" in result.stdout

    rewritten = moe_l2("verify", "--model", str(model), "--manifest")
    assert rewritten.returncode == 0, rewritten.stderr
    assert ModelFiles.open(model).checksums.fingerprint == files.content_fingerprint
    assert moe_l2("verify", "--model", str(model), "--no-daemon", "--samples", "4").returncode == 0

    (model / MANIFEST_NAME).write_text('{"format": "moe-l2-checksums-v1", "algorithm": "crc32"')
    damaged = ModelFiles.open(model)
    assert damaged.checksums is None and "is damaged" in damaged.checksum_problem and fix in damaged.checksum_problem
    (model / MANIFEST_NAME).unlink()
    os.mkfifo(model / MANIFEST_NAME)  # opened without blocking, and refused
    assert "moe-l2.checksums.json is a FIFO, not a regular file" in ModelFiles.open(model).checksum_problem


def test_the_daemon_never_publishes_a_corrupt_record(daemon_factory, packed_copy):
    files = packed_copy
    corrupt_in_place(files, 1, 2)
    daemon = daemon_factory([files.path], str(budget_for(files, files.n_experts)))
    for layer in range(files.n_layers):
        request(daemon.socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=layer,
                                                 experts=list(range(files.n_experts))))
    total = files.n_layers * files.n_experts
    wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0
             and stats(daemon)["models"][0]["loads_done"] + stats(daemon)["models"][0]["corrupt_loads"] == total,
             what="loads")
    m = stats(daemon)["models"][0]
    assert (m["loads_done"], m["corrupt_records"], m["corrupt"], m["load_errors"]) == (total - 1, 1, [[1, 2]], 0)
    assert 2 not in m["layers"][1]["experts"] and m["layers"][1]["resident"] == files.n_experts - 1
    damaged = files.files[files.record_span(1, 2)[0]]
    assert "MoE layer 1 expert 2 read from the model file fails its checksum" in daemon.log()
    assert f"{damaged} is damaged" in daemon.log()
    table = moe_l2("stats", "--socket", daemon.socket)
    assert "CORRUPT RECORDS 1 (layer/expert 1/2; refused 1 loads: see the daemon log)" in table.stdout

    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, capacity=4, client=client)
    try:
        slots = client.attachment.slot_indexes[1]
        expert, _, checksum = slots.meta(slots.slot_of(3))
        # The loader's slot checksum and the manifest's are one definition.
        assert (expert, checksum) == (3, files.checksums.expected(1, 3))
        assert pool.fetch(1, [0, 1, 3]).l2_hits == 3
        assert_resident_exact(pool, files, 1, [0, 1, 3])
        # Not in L2, so the client reads the file, which is damaged: refused, never fed to a forward pass.
        with pytest.raises(CorruptRecord, match=r"MoE layer 1 expert 2 read from the model file fails its checksum"):
            pool.fetch(1, [2, 3])
        assert not pool.layers[1].holds(2)
    finally:
        pool.close()
        client.close()
    # Every load tries again (a read can fail once) and is refused again, but the log names the record once.
    request(daemon.socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=1, experts=[2]))
    wait_for(lambda: stats(daemon)["models"][0]["corrupt_loads"] == 2, what="the second refusal")
    m = stats(daemon)["models"][0]
    assert (m["corrupt_records"], m["layers"][1]["resident"]) == (1, files.n_experts - 1)
    assert daemon.log().count("MoE layer 1 expert 2 read from the model file fails") == 1


def test_the_pool_refuses_a_damaged_record_from_the_file_unless_told_not_to(packed_copy):
    files = packed_copy
    corrupt_in_place(files, 0, 4)
    pool = ExpertPool(files, capacity=2)
    try:
        with pytest.raises(CorruptRecord) as caught:
            pool.fetch(0, [3, 4])
        err = caught.value
        assert (err.layer, err.expert, err.files) == (0, 4, [files.files[files.record_span(0, 4)[0]]])
        assert err.expected == files.checksums.expected(0, 4) != err.actual
        # The rows went back: the pool keeps working for the records that are intact.
        assert pool.fetch(0, [3, 5]).l3_reads == 2
        assert_resident_exact(pool, files, 0, [3, 5])
    finally:
        pool.close()
    unchecked = ExpertPool(files, capacity=2, verify="off")
    try:
        assert unchecked.fetch(0, [4]).l3_reads == 1
        assert_resident_exact(unchecked, files, 0, [4])  # the damaged bytes, as the file has them
    finally:
        unchecked.close()
    with pytest.raises(ValueError, match="verify takes one of off, file, all"):
        ExpertPool(files, capacity=2, verify="yes")


def test_verify_all_rereads_a_damaged_l2_copy_from_the_file(daemon_factory, packed_copy):
    """The default trusts L2 (the daemon checked the record before publishing it); verify="all" checks copies
    too, and reads one that fails from the file."""
    files = packed_copy
    daemon = daemon_factory([files.path], str(budget_for(files, files.n_experts)))
    request(daemon.socket, protocol.Prefetch(id=1, model=files.fingerprint, layer=0, experts=[6]))
    wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == 1, what="load")
    client = L2Client(files, daemon.socket, wait_s=5)
    try:
        att = client.attachment
        g = att.geometry
        slot = att.slot_indexes[0].slot_of(6)
        # Damage the slot's bytes behind the seqlock's back (a stray write into shared memory).
        writable = _native.Segment.open(att.data[0].name, readonly=False)
        view = writable.view()
        base = slot * g.slot_stride
        view[base:base + 64] = bytes(b ^ 0xFF for b in view[base:base + 64])
        del view
        writable.close()
        trusting = ExpertPool(files, capacity=1, client=client)
        checking = ExpertPool(files, capacity=1, client=client, verify="all")
        try:
            assert trusting.fetch(0, [6]).l2_hits == 1
            assert trusting.layers[0].record(6) != files.read_record(0, 6)
            counts = checking.fetch(0, [6])
            assert (counts.l2_hits, counts.l3_reads) == (0, 1)
            assert_resident_exact(checking, files, 0, [6])
        finally:
            trusting.close()
            checking.close()
    finally:
        client.close()


def test_verify_manifest_on_a_single_gguf_file(tmp_path):
    path = make_gguf_model(tmp_path / "m.gguf", layers=2, experts=4, types="Q4_1", hidden_size=64,
                           moe_hidden_size=64)
    result = moe_l2("verify", "--model", str(path), "--manifest")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / f"m.gguf.{MANIFEST_NAME}").exists()
    files = ModelFiles.open(path)
    assert [list(row) for row in files.checksums.checksums] == record_checksums(files)
    pool = ExpertPool(files, capacity=4)  # the native conversion checked against the numpy one's checksums
    try:
        for layer in range(files.n_layers):
            assert pool.fetch(layer, range(files.n_experts)).l3_reads == files.n_experts
    finally:
        pool.close()
    # A damaged raw slice: the converted record fails, and the error names the .gguf file.
    src = files.reader.sources[1][0]
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(src.start + 3 * src.expert_bytes)
        original = f.read(64)
        f.seek(src.start + 3 * src.expert_bytes)
        f.write(bytes(b ^ 0x55 for b in original))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    damaged = ModelFiles.open(path)
    assert damaged.checksums is not None
    pool = ExpertPool(damaged, capacity=4)
    try:
        with pytest.raises(CorruptRecord) as caught:
            pool.fetch(1, [3])
        assert (caught.value.layer, caught.value.expert, caught.value.files) == (1, 3, [path])
    finally:
        pool.close()


def test_generate_stops_on_a_damaged_record_with_the_fix(tmp_path, model_dir):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    assert moe_l2("verify", "--model", str(model), "--manifest").returncode == 0
    files = ModelFiles.open(model)
    for expert in range(files.n_experts):  # every expert of the first MoE layer: the first token needs one
        corrupt_in_place(files, 0, expert)
    args = ["generate", "--model", str(model), "--no-daemon", "-p", "hello", "--max-tokens", "2"]
    result = moe_l2(*args)
    assert result.returncode == 1
    assert "fails its checksum" in result.stderr and f"moe-l2 verify --model {model} --all" in result.stderr
    unchecked = moe_l2(*args, "--verify-checksums", "off")
    assert unchecked.returncode == 0, unchecked.stderr
