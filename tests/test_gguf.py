"""GGUF MoE models, written by the gguf package's own writer and quantizers, read as records in MLX's layout:
checked against mx.load and against gguf's dequantization, through the client's pread path and a real daemon."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from moe_l2 import _native
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.random_models import make_gguf_model
from moe_l2.model.gguf import transcode_reference
from moe_l2.model import ModelFiles

from .conftest import assert_every_tier_exact, budget_for

PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "MXFP4": 4}
MX_LOAD = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}  # the GGUF types mx.load reads
CASES = {
    "q4_0": dict(types="Q4_0"),
    "q4_1": dict(types="Q4_1", hidden_size=128),
    "q5_0": dict(types="Q5_0"),
    "q5_1": dict(types="Q5_1"),
    "q8_0": dict(types="Q8_0"),
    "mxfp4": dict(types="MXFP4"),
    "f16": dict(types="F16"),
    "f32": dict(types="F32", expert_bias=True),
    "bf16": dict(types="BF16"),
    "mixed-dense-first": dict(types={"gate": "Q4_0", "up": "Q4_1", "down": "Q8_0"}, dense_layers=1, layers=3,
                              expert_bias=True),
}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(name: str, **extra) -> ModelFiles:
        if name not in made:
            made[name] = make_gguf_model(root / name / "model.gguf", **{"seed": 4, **CASES.get(name, {}), **extra})
        return ModelFiles.open(made[name])

    return get


def _types(case: dict) -> dict:
    t = case["types"]
    return {"gate": t, "up": t, "down": t} if isinstance(t, str) else t


def _piece(files: ModelFiles, record: bytes, key: str) -> bytes:
    p = files.layout.piece(key)
    return record[p.offset:p.offset + p.nbytes]


@pytest.mark.parametrize("name", list(CASES))
def test_layouts_and_records_are_what_mx_load_gives(gguf_model, name):
    files = gguf_model(name)
    case = CASES[name]
    types = _types(case)
    assert files.format == "gguf" and files.layout.format == "gguf"
    assert (files.model_type, files.n_experts, files.top_k) == ("qwen3moe", 8, 2)
    dense = case.get("dense_layers", 0)
    assert files.layer_ids == list(range(dense, case.get("layers", 2)))
    hidden, moe = case.get("hidden_size", 64), 64
    for g, proj in PROJ.items():
        rows, cols = (hidden, moe) if g == "down" else (moe, hidden)
        t = types[g]
        w = files.layout.piece(f"{proj}.weight")
        if t in BITS:
            mode = "mxfp4" if t == "MXFP4" else "affine"
            assert (w.shape, w.dtype) == ((rows, cols * BITS[t] // 32), "uint32")
            s = files.layout.piece(f"{proj}.scales")
            assert (s.shape, s.dtype) == ((rows, cols // 32), "uint8" if mode == "mxfp4" else "float16")
            assert (f"{proj}.biases" in files.layout.keys()) == (mode == "affine")
            assert files.quantization[proj] == {"group_size": 32, "bits": BITS[t], "mode": mode}
        else:
            assert (w.shape, w.dtype) == ((rows, cols), {"F16": "float16", "F32": "float32", "BF16": "bfloat16"}[t])
            assert proj not in files.quantization
    if not set(types.values()) <= MX_LOAD:
        return  # mx.load cannot read these: test_records_dequantize_to_ggufs_own_values checks them
    weights = mx.load(str(files.files[0]))
    for layer, lid in enumerate(files.layer_ids):
        for e in range(files.n_experts):
            record = files.read_record(layer, e)
            for g, proj in PROJ.items():
                name_ = f"blk.{lid}.ffn_{g}_exps"
                if types[g] == "BF16":
                    # mx.load turns BF16 into float16 (rounding small values); the record keeps the exact bfloat16
                    got = mx.array(np.frombuffer(_piece(files, record, f"{proj}.weight"), np.uint16)).view(mx.bfloat16)
                    assert mx.array_equal(got.reshape(weights[f"{name_}.weight"][e].shape).astype(mx.float16),
                                          weights[f"{name_}.weight"][e]).item()
                    continue
                suffixes = ("weight", "scales", "biases") if types[g] in BITS else ("weight",)
                for suffix in suffixes:
                    truth = np.array(weights[f"{name_}.{suffix}"][e]).tobytes()
                    assert _piece(files, record, f"{proj}.{suffix}") == truth, (layer, e, proj, suffix)
                if case.get("expert_bias"):
                    truth = np.array(weights[f"{name_}.bias"][e]).tobytes()
                    assert _piece(files, record, f"{proj}.bias") == truth


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "bf16"])
def test_records_dequantize_to_ggufs_own_values(gguf_model, name):
    files = gguf_model(name)
    qtype = GGMLQuantizationType[CASES[name]["types"]]
    reader = GGUFReader(files.files[0])
    tensors = {t.name: t for t in reader.tensors}
    for layer, lid in enumerate(files.layer_ids):
        for g, proj in PROJ.items():
            t = tensors[f"blk.{lid}.ffn_{g}_exps.weight"]
            values = quants.dequantize(np.ascontiguousarray(t.data), qtype)  # (experts, rows, cols) float32
            for e in (0, files.n_experts - 1):
                record = files.read_record(layer, e)
                w = files.layout.piece(f"{proj}.weight")
                if name == "bf16":
                    got = np.frombuffer(_piece(files, record, f"{proj}.weight"), np.uint16).astype(np.uint32) << 16
                    assert np.array_equal(got.view(np.float32).reshape(w.shape), values[e])
                    continue
                if name == "mxfp4":
                    arrays = [mx.array(np.frombuffer(_piece(files, record, f"{proj}.{k}"), dtype).reshape(
                        files.layout.piece(f"{proj}.{k}").shape)) for k, dtype in
                        (("weight", np.uint32), ("scales", np.uint8))]
                    got = mx.dequantize(*arrays, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
                    assert np.array_equal(np.array(got), values[e])  # e2m1 times a power of two: exact
                    continue
                arrays = [mx.array(np.frombuffer(_piece(files, record, f"{proj}.{k}"), dtype).reshape(
                    files.layout.piece(f"{proj}.{k}").shape)) for k, dtype in
                    (("weight", np.uint32), ("scales", np.float16), ("biases", np.float16))]
                got = np.array(mx.dequantize(*arrays, group_size=32, bits=BITS[qtype.name]).astype(mx.float32))
                # MLX computes q * scale + bias in float16; gguf in float32
                assert np.allclose(got, values[e], rtol=2e-3, atol=2e-3 * np.abs(values[e]).max())


@pytest.mark.parametrize("name", ["mixed-dense-first", "q5_0", "q5_1", "mxfp4", "bf16"])
def test_native_transcode_matches_the_numpy_reference_on_many_threads(gguf_model, name):
    files = gguf_model(name)
    g = files.reader
    for src in g.sources[0]:
        with open(files.files[src.file], "rb") as f:
            f.seek(src.start)
            raw = f.read(src.expert_bytes * files.n_experts)
        rows = src.rows * files.n_experts
        want = transcode_reference(src.type, raw, rows, src.cols)
        buf = _native.Buffer(len(raw))
        buf.view()[:] = raw
        outs = [_native.Buffer(len(w) + 64) for w in want] + [_native.Buffer(64)] * (3 - len(want))
        _native.transcode_gguf([(src.type, rows, src.cols, buf, 0, outs[0], 64, outs[1], 64, outs[2], 64)],
                               threads=3)
        for w, out in zip(want, outs):
            assert bytes(out.view()[64:64 + len(w)]) == w


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"])
def test_native_transcode_matches_the_numpy_reference_on_any_bytes(type_name):
    """Random blocks: scales that are NaNs (with payloads), infinities and subnormals, whose biases overflow. The
    daemon and the client (native) and verify (numpy) must agree on every byte of a damaged file too, or verify
    would report damage where there is none, and a manifest written by verify would refuse the native reads."""
    rows, cols = 64, 64
    block = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "MXFP4": 17}[type_name]
    raw = np.random.default_rng(7).integers(0, 256, rows * cols // 32 * block, dtype=np.uint8).tobytes()
    want = transcode_reference(type_name, raw, rows, cols)
    assert any(np.isnan(np.frombuffer(w, np.float16)).any() for w in want[1:]) or type_name == "MXFP4"
    buf = _native.Buffer(len(raw))
    buf.view()[:] = raw
    outs = [_native.Buffer(len(w)) for w in want] + [_native.Buffer(64)] * (3 - len(want))
    _native.transcode_gguf([(type_name, rows, cols, buf, 0, outs[0], 0, outs[1], 0, outs[2], 0)], threads=1)
    for w, out in zip(want, outs):
        assert bytes(out.view()[:len(w)]) == w


def test_transcode_refuses_what_it_cannot_convert():
    buf = _native.Buffer(4096)
    with pytest.raises(ValueError, match=r"^\[transcode_gguf\] jobs\[0\]: GGUF type Q4_K is not supported "
                                         r"\(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4\)"):
        _native.transcode_gguf([("Q4_K", 1, 256, buf, 0, buf, 0, buf, 0, buf, 0)])
    with pytest.raises(ValueError, match=r"rows hold whole blocks of 32 weights, got 48 columns"):
        _native.transcode_gguf([("Q8_0", 1, 48, buf, 0, buf, 0, buf, 0, buf, 0)])
    with pytest.raises(ValueError, match=r"^\[transcode_gguf\] bytes \[4050, 4122\) are outside buffer"):
        _native.transcode_gguf([("Q4_0", 2, 64, buf, 4050, buf, 0, buf, 0, buf, 0)])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _native.transcode_gguf([], threads=0)


@pytest.mark.parametrize("name", ["mixed-dense-first", "bf16", "q5_1", "mxfp4"])
def test_the_client_pread_path_converts_into_the_pool(gguf_model, name):
    files = gguf_model(name)
    for direct in (False, True):
        pool = ExpertPool(files, capacity=3, read_threads=3, direct=direct)
        try:
            assert not files.direct_default
            for layer in range(files.n_layers):
                for start in range(0, files.n_experts, 3):
                    batch = [(start + i) % files.n_experts for i in range(3)]
                    pool.fetch(layer, batch)
                    for e in batch:
                        assert pool.layers[layer].record(e) == files.read_record(layer, e), (layer, e, direct)
        finally:
            pool.close()


def test_pool_arrays_run_gather_qmm_exactly_like_the_whole_tensor(gguf_model):
    files = gguf_model("q8_0")
    pool = ExpertPool(files, capacity=4)
    try:
        pool.fetch(0, [1, 6])
        arrays = pool.arrays(0)
        x = mx.random.normal((2, 1, 64), key=mx.random.key(0))
        rows = pool.table(0)[mx.array([6, 1])]
        q = files.quantization["gate_proj"]
        got = mx.gather_qmm(x, arrays["gate_proj.weight"], arrays["gate_proj.scales"], arrays["gate_proj.biases"],
                            rhs_indices=rows, transpose=True, group_size=q["group_size"], bits=q["bits"])
        stacked = mx.load(str(files.files[0]))  # the whole tensor as mx.load gives it
        want = mx.gather_qmm(x, stacked["blk.0.ffn_gate_exps.weight"], stacked["blk.0.ffn_gate_exps.scales"],
                             stacked["blk.0.ffn_gate_exps.biases"], rhs_indices=mx.array([6, 1]), transpose=True,
                             group_size=32, bits=8)
        assert mx.array_equal(got, want).item()
    finally:
        pool.close()


def test_the_daemon_converts_once_into_l2(gguf_model, daemon_factory):
    files = gguf_model("mixed-dense-first")
    assert_every_tier_exact(files, daemon_factory([files.path], str(budget_for(files, files.n_experts))))


# The daemon's loader, run alone in a fresh process: every expert of every layer into its slots, then the slots
# compared with the reference conversion and MLX's allocator counters read. The daemon must never touch MLX's
# allocator (on macOS that would start a Metal device), so its conversion scratch is plain host memory.
_DAEMON_SLOT_LOADS = """
import json, sys, time
import mlx.core as mx
from moe_l2.daemon.loader import Loader
from moe_l2 import _native
from moe_l2.daemon.served import ServedModel
from moe_l2.layout import Geometry, new_token, segment_name
from moe_l2.model import ModelFiles

files = ModelFiles.open(sys.argv[1])
geometry = Geometry.for_budget(files.n_layers, files.n_experts, files.layout.nbytes, int(sys.argv[2]))
served = ServedModel(files, geometry, lambda layer, nbytes: _native.Segment.create(
    segment_name("gguftest", 0, layer, new_token()), nbytes, 0o600), epoch=1)
loader = Loader(threads=3)
try:
    for layer in range(files.n_layers):
        served.demand(layer, range(files.n_experts), loader)
    deadline = time.monotonic() + 60  # a bound for a hung load: shutdown() below would drop the queued ones
    while loader.in_flight:
        if time.monotonic() > deadline:
            sys.exit(f"{loader.in_flight} loads still in flight after 60 s")
        time.sleep(0.01)
    loader.shutdown()
    g, same = served.geometry, []
    for layer in range(files.n_layers):
        for e in range(files.n_experts):
            slot = served.slot_indexes[layer].slot_of(e)
            start = slot * g.slot_stride
            same.append(slot >= 0 and bytes(served.data[layer].view()[start:start + files.layout.nbytes])
                        == files.read_record(layer, e))
    print(json.dumps({"same": same, "errors": served.counters.load_errors,
                      "active": mx.get_active_memory(), "peak": mx.get_peak_memory()}))
finally:
    served.close()
"""


@pytest.mark.parametrize("name", ["mixed-dense-first", "mxfp4"])
def test_the_daemon_converts_into_slots_without_mlx_memory(gguf_model, name):
    files = gguf_model(name)
    result = subprocess.run([sys.executable, "-P", "-c", _DAEMON_SLOT_LOADS, str(files.path),
                             str(budget_for(files, files.n_experts))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["errors"] == 0 and got["same"] == [True] * (files.n_layers * files.n_experts)
    assert (got["active"], got["peak"]) == (0, 0)


def test_verify_checks_gguf_models(gguf_model):
    files = gguf_model("q4_1")
    result = subprocess.run(["moe-l2", "verify", "--model", str(files.path), "--no-daemon", "--samples", "30"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(gguf)" in result.stdout and "0 mismatches" in result.stdout


@pytest.mark.parametrize("type_name", ["Q4_K", "Q2_K", "Q6_K", "IQ4_NL"])
def test_unsupported_types_are_named(tmp_path, type_name):
    path = make_gguf_model(tmp_path / "m.gguf", types={"gate": "Q4_0", "up": type_name, "down": "Q4_0"},
                           hidden_size=256, moe_hidden_size=256)
    with pytest.raises(ValueError, match=rf"blk\.0\.ffn_up_exps\.weight is {type_name}, which moe-l2 cannot "
                                         r"convert to MLX's layout exactly \(supported: F32, F16, BF16, Q4_0"):
        ModelFiles.open(path)


def test_split_models_and_directories(tmp_path, gguf_model):
    whole = gguf_model("mixed-dense-first")
    first = make_gguf_model(tmp_path / "split" / "model.gguf", split_max_tensors=7, seed=4,
                            **{k: v for k, v in CASES["mixed-dense-first"].items()})
    assert first.name == "model-00001-of-00004.gguf"
    (first.parent / "config.json").write_text("{}")  # shipped beside some GGUF files: still a GGUF directory
    for path in (first, first.parent):
        split = ModelFiles.open(path)
        assert len(split.files) == 4 and split.layout == whole.layout
        assert {s.file for layer in split.reader.sources for s in layer} != {0}  # experts in several files
        for layer in range(split.n_layers):
            for e in range(split.n_experts):
                assert split.read_record(layer, e) == whole.read_record(layer, e)
    pool = ExpertPool(split, capacity=2)
    try:
        pool.fetch(1, [3, 4])
        assert pool.layers[1].record(4) == whole.read_record(1, 4)
    finally:
        pool.close()
    (first.parent / "model-00003-of-00004.gguf").unlink()
    with pytest.raises(ValueError, match="split GGUF model lacks model-00003-of-00004.gguf"):
        ModelFiles.open(first)


def test_malformed_models_get_clear_errors(tmp_path, gguf_model):
    from gguf import GGUFWriter

    def write(name: str, build) -> str:
        path = tmp_path / name
        w = GGUFWriter(path, "qwen3moe")
        build(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    x = np.zeros((4, 8, 32), np.float32)
    no_count = write("a.gguf", lambda w: (w.add_expert_used_count(2), w.add_tensor("blk.0.ffn_up_exps.weight", x)))
    with pytest.raises(ValueError, match="names no qwen3moe.expert_count"):
        ModelFiles.open(no_count)
    dense = write("b.gguf", lambda w: (w.add_expert_count(4), w.add_expert_used_count(2),
                                       w.add_tensor("blk.0.ffn_up.weight", x[0])))
    with pytest.raises(ValueError, match="no routed-expert tensors .* not a MoE model"):
        ModelFiles.open(dense)
    fused = write("c.gguf", lambda w: (w.add_expert_count(4), w.add_expert_used_count(2),
                                       w.add_tensor("blk.0.ffn_gate_up_exps.weight", x)))
    with pytest.raises(ValueError, match="ffn_gate_up_exps are not supported"):
        ModelFiles.open(fused)
    wrong = write("d.gguf", lambda w: (w.add_expert_count(8), w.add_expert_used_count(2),
                                       w.add_tensor("blk.0.ffn_up_exps.weight", x)))
    with pytest.raises(ValueError, match=r"has shape \[4, 8, 32\], but the metadata says 8 experts"):
        ModelFiles.open(wrong)
    mixed = write("e.gguf", lambda w: (w.add_expert_count(4), w.add_expert_used_count(2),
                                       w.add_tensor("blk.0.ffn_up_exps.weight", x),
                                       w.add_tensor("blk.1.ffn_up_exps.weight", x.astype(np.float16))))
    with pytest.raises(ValueError, match="MoE layer 1 has expert tensors .* unlike layer 0"):
        ModelFiles.open(mixed)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        ModelFiles.open(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="GGUF records are converted"):
        gguf_model("q4_0").extents(0, 0)
    with pytest.raises(ValueError, match="not single extents"):
        gguf_model("q4_0").record_span(0, 0)


def test_damaged_headers_are_refused_before_they_are_parsed_far(tmp_path):
    """GGUF headers are bounded (docs/formats.md, "What a model's files may hold"): counts, arrays of arrays,
    tensors that overlap or lie past the end, each refused with the reason, never a traceback or a hang."""
    from gguf import GGUFWriter

    path = make_gguf_model(tmp_path / "good" / "model.gguf")
    good = path.read_bytes()

    def damaged(name: str, data: bytes):
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    many = damaged("many.gguf", good[:8] + struct.pack("<QQ", 1 << 40, 3) + good[24:])
    with pytest.raises(ValueError, match=r"its header counts 1099511627776 tensors"):
        ModelFiles.open(many)
    reader = GGUFReader(path)
    up, down = (next(t for t in reader.tensors if t.name == f"blk.0.ffn_{p}_exps.weight") for p in ("up", "down"))
    at = up.field.offset + sum(int(p.nbytes) for p in up.field.parts[:5])  # its offset field
    overlapping = bytearray(good)
    overlapping[at:at + 8] = struct.pack("<Q", int(down.data_offset - reader.data_offset))
    with pytest.raises(ValueError, match=r"tensors 'blk\.0\.ffn_(up|down)_exps\.weight' and 'blk\.0\.ffn_(up|down)_"
                                         r"exps\.weight' overlap"):
        ModelFiles.open(damaged("overlap.gguf", bytes(overlapping)))
    past = bytearray(good)
    past[at:at + 8] = struct.pack("<Q", len(good) - int(reader.data_offset))
    with pytest.raises(ValueError, match=r"truncated file \(tensor 'blk\.0\.ffn_up_exps\.weight' ends at byte"):
        ModelFiles.open(damaged("past.gguf", bytes(past)))

    nested = tmp_path / "nested.gguf"
    w = GGUFWriter(nested, "qwen3moe")
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_array("qwen3moe.nested", [[1, 2], [3]])
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((4, 8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="an array of 2 arrays, which llama.cpp would not read either"):
        ModelFiles.open(nested)


def test_fingerprint_follows_the_file(tmp_path):
    path = make_gguf_model(tmp_path / "m.gguf")
    fp = ModelFiles.open(path).fingerprint
    assert ModelFiles.open(path).fingerprint == fp == ModelFiles.open(tmp_path).fingerprint
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert ModelFiles.open(path).fingerprint != fp


def test_long_metadata_arrays_are_skipped_not_parsed(tmp_path):
    from gguf import GGUFWriter

    from moe_l2.model.gguf import _reader_class

    path = tmp_path / "vocab.gguf"
    w = GGUFWriter(path, "qwen3moe")
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_rope_dimension_sections([1, 2, 3, 4])
    w.add_token_list([f"token-{i}" * (i % 5) for i in range(5000)])
    w.add_token_scores([0.5] * 5000)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((4, 8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lean, full = _reader_class()(path), GGUFReader(path)
    assert lean.data_offset == full.data_offset and list(lean.fields) == list(full.fields)
    assert [(t.name, t.data_offset, t.n_bytes) for t in lean.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in full.tensors]
    files = ModelFiles.open(path)
    assert files.config["qwen3moe.rope.dimension_sections"] == [1, 2, 3, 4]
    assert "tokenizer.ggml.tokens" not in files.config
    assert files.read_record(0, 3) == np.ones((8, 32), np.float32).tobytes()
