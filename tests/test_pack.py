"""moe-l2 pack: packed checkpoints hold the same records as one extent per expert, load in mlx-lm as before,
are written atomically and resumably, and are served by a real daemon and client byte for byte."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from moe_l2 import _native
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.random_models import make_model
from moe_l2.model import MANIFEST_NAME, PACK_ALIGN, PACK_MARKER, ModelFiles
from moe_l2.model import packer
from moe_l2.model.packer import PackError, pack

from .conftest import budget_for, stats, wait_for

DIMS = dict(layers=3, experts=8, top_k=2, hidden_size=64, moe_hidden_size=64)
CASES = {
    "mixtral-4bit": dict(arch="mixtral", bits=4),
    "mixtral-8bit-per-expert-sharded": dict(arch="mixtral", bits=8, per_expert=True, shards=3),
    "mixtral-fp16": dict(arch="mixtral", bits=16),
    "deepseek_v3-4bit-per-expert": dict(arch="deepseek_v3", bits=4, per_expert=True),
    "deepseek_v3-8bit": dict(arch="deepseek_v3", bits=8, shards=2),
    "qwen3_moe-fp16": dict(arch="qwen3_moe", bits=16),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack-src")
    made = {}

    def get(name: str, **extra) -> Path:
        if name not in made:
            made[name] = make_model(root / name, **{"seed": 2, **DIMS, **CASES.get(name, {}), **extra})
        return made[name]

    return get


@pytest.fixture(scope="module")
def packed(sources, tmp_path_factory):
    """pack(name) -> (source ModelFiles, packed ModelFiles), each packed once per module."""
    root = tmp_path_factory.mktemp("pack-out")
    done = {}

    def get(name: str) -> tuple[ModelFiles, ModelFiles]:
        if name not in done:
            # small shards: the experts of several layers and the dense tensors land in several files
            done[name] = (ModelFiles.open(sources(name)),
                          pack(sources(name), root / name, max_shard_bytes=100_000, progress=False))
        return done[name]

    return get


def _shard_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


@pytest.mark.parametrize("name", list(CASES))
def test_packed_records_are_the_source_records_in_one_aligned_extent(packed, name):
    src, out = packed(name)
    assert out.format == "packed" and out.layout.format == "packed" and out.layout.packed
    assert src.format == "safetensors" and not src.layout.packed
    assert out.layout.pieces == src.layout.pieces and out.layout.nbytes == src.layout.nbytes
    assert out.layout != src.layout  # the layout says it is packed
    assert out.fingerprint != src.fingerprint
    assert (out.layer_ids, out.n_experts, out.top_k, out.model_type) == (
        src.layer_ids, src.n_experts, src.top_k, src.model_type)
    assert out.config == src.config
    assert len(out.files) > 2
    for layer in range(src.n_layers):
        for e in range(src.n_experts):
            record = out.read_record(layer, e)
            assert record == src.read_record(layer, e), (layer, e)
            f, start, span = out.record_span(layer, e)
            assert start % PACK_ALIGN == 0 and span % PACK_ALIGN == 0 and span >= out.layout.nbytes
            assert [(x[0], x[1] - start) for x in out.extents(layer, e)] == [(f, p.offset) for p in out.layout.pieces]
            with open(out.files[f], "rb") as fh:
                fh.seek(start)
                extent = fh.read(span)
            # the whole extent is the record, padding zero, up to the page boundary
            assert extent == record + bytes(span - len(record))
    with pytest.raises(ValueError, match="not single extents"):
        src.record_span(0, 0)


def test_every_tensor_is_kept_and_every_shard_is_marked(packed, sources):
    src, out = packed("mixtral-4bit")
    names = {}
    for f in out.files:
        start, header = _shard_header(f)
        assert header["__metadata__"]["moe_l2"] == PACK_MARKER
        assert header["__metadata__"]["moe_l2_source"] == src.fingerprint
        assert header["__metadata__"]["format"] == "mlx"
        names.update((n, f.name) for n in header if n != "__metadata__")
        if any(".experts." in n for n in header):
            assert start % PACK_ALIGN == 0 and f.stat().st_size % PACK_ALIGN == 0
    index = json.loads((out.path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict(sorted(names.items()))
    assert index["metadata"]["moe_l2"]["source_fingerprint"] == src.fingerprint
    before = {}
    for f in src.files:
        before.update(mx.load(str(f)))
    after = {}
    for f in out.files:
        after.update(mx.load(str(f)))
    dense = {n for n in before if n not in src.expert_tensor_names()}
    assert dense <= set(after)
    for n in dense:
        assert mx.array_equal(before[n], after[n]).item(), n
    # mixtral's sanitize stacks experts.N.w1/w2/w3: the per-expert names use them
    assert any(".block_sparse_moe.experts.7.w2.scales" in n for n in after)
    for p in sorted(Path(sources("mixtral-4bit")).iterdir()):
        if not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            assert (out.path / p.name).read_bytes() == p.read_bytes(), p.name
    assert not list(out.path.glob("*.partial"))


@pytest.mark.parametrize("name", ["mixtral-4bit", "deepseek_v3-4bit-per-expert", "qwen3_moe-fp16"])
def test_streamed_lm_loads_the_packed_model_and_gives_the_same_outputs(packed, name):
    from mlx_lm import load

    src, out = packed(name)
    model_a, tok_a = load(str(src.path))
    model_b, tok_b = load(str(out.path))
    if name.endswith("fp16"):  # mlx 0.32's CPU gather_mm computes in float32 only
        model_a.set_dtype(mx.float32)
        model_b.set_dtype(mx.float32)
    tokens = mx.array([tok_a.encode("The river ran fast under the old stone bridge.")])
    assert tok_b.encode("The river ran fast") == tok_a.encode("The river ran fast")
    a, b = model_a(tokens), model_b(tokens)
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("arch,bits", [("qwen3_moe", 4), ("gpt_oss", 8)])
def test_architectures_whose_sanitize_cannot_restack_are_refused_unless_moe_l2_only(sources, tmp_path, arch, bits):
    src = sources(f"{arch}-{bits}", arch=arch, bits=bits)
    with pytest.raises(PackError, match=r"would not load with mlx_lm\.load: mlx-lm's .* sanitize leaves .*--moe-l2-only"):
        pack(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    out = pack(src, tmp_path / "out", moe_l2_only=True, progress=False)
    files = ModelFiles.open(src)
    assert out.format == "packed"
    for layer in range(files.n_layers):
        for e in range(files.n_experts):
            assert out.read_record(layer, e) == files.read_record(layer, e)


def test_a_model_mlx_lm_cannot_build_is_refused(sources, tmp_path):
    # Its experts are known only from the model mlx-lm builds (docs/formats.md, "Which tensors are experts").
    src = tmp_path / "src"
    shutil.copytree(sources("mixtral-4bit"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "moe_l2_unknown_arch"}))
    with pytest.raises(PackError, match="mlx-lm cannot build a moe_l2_unknown_arch model"):
        pack(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_interrupted_pack_looks_incomplete_and_the_next_run_resumes(sources, tmp_path, monkeypatch):
    src = sources("mixtral-4bit")
    out = tmp_path / "out"
    real, real_shard = packer._write_all, packer._write_shard
    state = {"shards": 0, "writes": 0}

    def shard(*args):
        state["shards"] += 1
        state["writes"] = 0
        real_shard(*args)

    def dying(fd, data):
        state["writes"] += 1
        if state["shards"] == 3 and state["writes"] == 2:  # the third shard's first data: two are complete
            real(fd, bytes(data)[: len(data) // 2])
            raise KeyboardInterrupt("power cut")
        real(fd, data)

    monkeypatch.setattr(packer, "_write_shard", shard)
    monkeypatch.setattr(packer, "_write_all", dying)
    with pytest.raises(KeyboardInterrupt):
        pack(src, out, max_shard_bytes=100_000, progress=False)
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" not in names and "model.safetensors.index.json" not in names
    assert not [n for n in names if n.endswith(".partial")]  # the interrupted shard's private file is removed
    complete = [n for n in names if n.endswith(".safetensors")]
    assert len(complete) == 2
    with pytest.raises(ValueError, match="no config.json"):
        ModelFiles.open(out)
    from mlx_lm import load

    with pytest.raises(Exception):
        load(str(out))
    kept = {n: (out / n).stat().st_mtime_ns for n in complete}
    # What a power cut leaves instead: a partial file under its private name, removed by the next run.
    (out / ".config.json.0123456789abcdef.partial").write_bytes(b"{")

    monkeypatch.setattr(packer, "_write_all", real)
    files = pack(src, out, max_shard_bytes=100_000, progress=False)
    assert {n: (out / n).stat().st_mtime_ns for n in complete} == kept  # resumed, not rewritten
    assert not list(out.glob("*.partial"))
    source = ModelFiles.open(src)
    assert all(files.read_record(layer, e) == source.read_record(layer, e)
               for layer in range(source.n_layers) for e in range(source.n_experts))
    # The kept shards' checksums too (taken from the source), in a manifest of the resumed files.
    assert files.checksums.fingerprint == files.content_fingerprint
    assert files.checksums.checksums == tuple(tuple(source.layout.checksum(source.read_record(layer, e))
                                                    for e in range(source.n_experts))
                                              for layer in range(source.n_layers))


# fcntl commands that Linux refuses (EINVAL), as filesystems without F_FULLFSYNC or F_NOCACHE do on macOS.
_REFUSED_FCNTL = 0x7FFF0000


def test_written_files_leave_the_page_cache_and_every_sync_path_writes_the_same_pack(sources, tmp_path,
                                                                                     monkeypatch):
    src = sources("mixtral-4bit")
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(4 << 20))
    packer._copy_atomic(blob, tmp_path / "copy")
    fd = os.open(tmp_path / "copy", os.O_RDONLY)
    try:
        resident = _native.page_cache_bytes(fd)
    finally:
        os.close(fd)
    if hasattr(os, "posix_fadvise"):
        assert resident == 0  # written back by the fsync, then dropped
    assert (tmp_path / "copy").read_bytes() == blob.read_bytes()
    pack(src, tmp_path / "linux", max_shard_bytes=100_000, progress=False, verify="none")

    # The macOS path: no fadvise, F_NOCACHE on the write fd, F_FULLFSYNC, both refused here: the pack is the same.
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", _REFUSED_FCNTL, raising=False)
    monkeypatch.setattr(fcntl, "F_NOCACHE", _REFUSED_FCNTL, raising=False)
    pack(src, tmp_path / "macos", max_shard_bytes=100_000, progress=False, verify="none")
    written = sorted(p.name for p in (tmp_path / "linux").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "macos").iterdir()) and "config.json" in written
    for name in written:
        linux, macos = (tmp_path / "linux" / name).read_bytes(), (tmp_path / "macos" / name).read_bytes()
        if name == MANIFEST_NAME:  # its fingerprint covers the shards' mtimes: the checksums are the same
            linux, macos = json.loads(linux)["layers"], json.loads(macos)["layers"]
        assert linux == macos, name


def test_a_shard_left_by_a_pack_of_another_source_is_rewritten(sources, tmp_path):
    a, b = sources("mixtral-4bit"), sources("mixtral-4bit-seed5", arch="mixtral", bits=4, seed=5)
    out = tmp_path / "out"
    pack(a, out, max_shard_bytes=100_000, progress=False, verify="none")
    (out / "config.json").unlink()  # as if a pack of `a` had stopped just before the end
    (out / "model.safetensors.index.json").unlink()
    files = pack(b, out, max_shard_bytes=100_000, progress=False, verify="full")
    source = ModelFiles.open(b)
    assert all(files.read_record(layer, e) == source.read_record(layer, e)
               for layer in range(source.n_layers) for e in range(source.n_experts))


def test_bad_outputs_and_inputs_are_refused(sources, tmp_path, packed):
    src = sources("mixtral-4bit")
    with pytest.raises(PackError, match="must not be the source model"):
        pack(src, src, progress=False)
    with pytest.raises(PackError, match="must not be the source model"):
        pack(src, src / "packed", progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    with pytest.raises(PackError, match="already holds a model"):
        pack(src, tmp_path / "full", progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(PackError, match="holds files this pack would not write .*notes.txt"):
        pack(src, tmp_path / "other", progress=False)
    _, out = packed("mixtral-4bit")
    with pytest.raises(PackError, match="already packed"):
        pack(out.path, tmp_path / "again", progress=False)
    from moe_l2.lab.random_models import make_gguf_model

    with pytest.raises(PackError, match="GGUF models are served as they are"):
        pack(make_gguf_model(tmp_path / "g" / "m.gguf"), tmp_path / "g-out", progress=False)
    with pytest.raises(PackError, match="no config.json"):
        pack(tmp_path / "other", tmp_path / "x", progress=False)


def test_a_damaged_packed_model_is_refused(packed, tmp_path):
    import shutil

    _, out = packed("mixtral-4bit")
    copy = tmp_path / "copy"
    shutil.copytree(out.path, copy)
    shard = next(f for f in sorted(copy.glob("*.safetensors")) if any(".experts." in n for n in _shard_header(f)[1]))
    data = bytearray(shard.read_bytes())
    start, header = _shard_header(shard)
    # The record's last piece, moved into the padding after it: no longer at its record offset, overlapping nothing.
    name = max((n for n in header if ".experts.3." in n), key=lambda n: header[n]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 64, end + 64]
    body = json.dumps(header, separators=(",", ":")).encode()
    data[8:start] = body + b" " * (start - 8 - len(body))
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="written by moe-l2 pack, but MoE layer .* expert 3: .* not at its record offset"):
        ModelFiles.open(copy)


def test_the_daemon_and_the_client_serve_a_packed_model_byte_for_byte(packed, daemon_factory):
    src, out = packed("mixtral-8bit-per-expert-sharded")
    daemon = daemon_factory([out.path], str(budget_for(out, out.n_experts)))
    client = L2Client(out, daemon.socket, wait_s=5)
    assert client.attached
    pools = [ExpertPool(out, capacity=2, client=client), ExpertPool(out, capacity=2, direct=False)]
    try:
        assert ModelFiles.direct_fds(pools[0].loader.fds) == (sys.platform == "linux")  # packed: direct by default
        assert not ModelFiles.direct_fds(pools[1].loader.fds)
        experts = list(range(out.n_experts))
        for layer in range(out.n_layers):
            for pair in zip(experts[::2], experts[1::2]):
                for pool in pools:
                    assert pool.fetch(layer, list(pair)).l3_reads == 2
                    for e in pair:
                        assert pool.layers[layer].record(e) == src.read_record(layer, e)
        wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == out.n_layers * out.n_experts, what="loads")
        for layer in range(out.n_layers):
            for pair in zip(experts[::2], experts[1::2]):
                assert pools[0].fetch(layer, list(pair)).l2_hits == 2
                for e in pair:
                    assert pools[0].layers[layer].record(e) == src.read_record(layer, e)
        assert stats(daemon)["models"][0]["load_errors"] == 0
    finally:
        for pool in pools:
            pool.close()
        client.close()


def test_pack_and_verify_from_the_command_line(sources, tmp_path):
    src = sources("mixtral-4bit")
    out = tmp_path / "packed"
    result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", "pack", "--model", str(src), "--out", str(out),
                             "--max-shard-size", "64KiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"packed {src} -> {out}" in result.stdout and "one 8.0 KiB extent per expert" in result.stdout
    assert "pack packed" in result.stderr  # the progress bar
    verify = subprocess.run(["moe-l2", "verify", "--model", str(out), "--no-daemon", "--samples", "40"],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "(packed)" in verify.stdout and "0 mismatches" in verify.stdout
    again = subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", "pack", "--model", str(src), "--out", str(out),
                            "--quiet"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "already holds a model" in again.stderr
    bad = subprocess.run([sys.executable, "-P", "-m", "moe_l2.cli", "pack", "--model", str(src), "--out", str(out),
                          "--max-shard-size", "lots"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-shard-size" in bad.stderr


def test_a_packed_model_streams_through_the_mlx_lm_integration_bit_identically(packed):
    from mlx_lm import load

    from moe_l2.lm.streamed_lm import StreamedLM

    src, out = packed("mixtral-4bit")
    whole, tokenizer = load(str(src.path))
    ids = mx.array(tokenizer.encode("The morning was cold and clear, and the river ran fast"))[None]
    with StreamedLM(out.path, l0_slots=out.top_k + 1, daemon=False) as lm:
        assert lm.files.format == "packed"
        assert mx.array_equal(lm.model(ids), whole(ids)).item()
        assert lm.pool.counts.l3_reads > out.n_layers * out.top_k


def test_a_source_file_swapped_for_a_fifo_after_the_check_is_refused_not_read(tmp_path):
    """pack opens the source's files again to copy them: one that became a FIFO since ModelFiles.open checked the
    model would block the pack for good; it is refused with the model's own message."""
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    with pytest.raises(PackError, match="not a regular file"):
        packer._open_source(fifo)
