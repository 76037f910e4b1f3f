"""ModelFiles reads expert records straight from safetensors files, checked against mx.load."""

import json
import os
import shutil
import struct
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from moe_l2.lab.random_models import make_model
from moe_l2.model import ALIGN, ModelFiles, RecordLayout

DIMS = dict(layers=3, experts=4, top_k=2, hidden_size=64, moe_hidden_size=64)
PER_EXPERT_PROJ = {"mixtral": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}}


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    """make(arch, bits, per_expert, shards, seed) -> a generated model, made once per module."""
    root = tmp_path_factory.mktemp("models")
    made = {}

    def build(arch="mixtral", bits=4, per_expert=False, shards=1, seed=0):
        key = (arch, bits, per_expert, shards, seed)
        if key not in made:
            made[key] = make_model(
                root / "-".join(map(str, key)), arch, bits=bits, per_expert=per_expert, shards=shards, seed=seed, **DIMS
            )
        return made[key]

    return build


def _fresh(tmp_path, arch="mixtral", bits=4, **kw):
    """A model of the test's own, for tests that damage files."""
    return make_model(tmp_path / "m", arch, bits=bits, **{**DIMS, **kw})


def _bytes(a: mx.array) -> bytes:
    # via uint8 so that dtypes numpy lacks (bfloat16) work too
    return np.array(mx.contiguous(a).view(mx.uint8)).tobytes()


def _load_all(path):
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _ground_truth(weights, arch, layer_id, expert, key):
    """The piece's bytes as mx.load gives them, from the stacked or the per-expert tensor."""
    proj, param = key.split(".")
    for name, v in weights.items():
        if not name.startswith(f"model.layers.{layer_id}."):
            continue
        if name.endswith((f".switch_mlp.{key}", f".mlp.experts.{key}")):
            return _bytes(v[expert])
        alias = PER_EXPERT_PROJ.get(arch, {}).get(proj, proj)
        if name.endswith(f".experts.{expert}.{alias}.{param}"):
            return _bytes(v)
    raise AssertionError(f"no tensor for layer {layer_id} expert {expert} {key}")


CASES = [
    ("mixtral", 4, False, 1),
    ("mixtral", 4, True, 1),
    ("mixtral", 8, False, 3),
    ("mixtral", 8, True, 3),
    ("mixtral", 16, False, 2),
    ("mixtral", 16, True, 1),
    ("qwen3_moe", 4, False, 2),
    ("qwen3_moe", 16, True, 3),
    ("deepseek_v3", 4, True, 2),
    ("deepseek_v3", 8, False, 1),
    ("gpt_oss", 8, False, 2),
]


@pytest.mark.parametrize("arch,bits,per_expert,shards", CASES)
def test_records_match_mx_load(make, arch, bits, per_expert, shards):
    path = make(arch, bits, per_expert, shards)
    m = ModelFiles.open(path)
    assert m.model_type == arch
    assert len(m.files) == shards
    assert (m.n_experts, m.top_k) == (4, 2)
    # deepseek_v3's first layer is dense
    assert m.layer_ids == ([1, 2] if arch == "deepseek_v3" else [0, 1, 2])
    assert m.n_layers == len(m.layer_ids)
    keys = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    if bits != 16:
        keys |= {k.replace("weight", s) for k in keys for s in ("scales", "biases")}
    if arch == "gpt_oss":
        keys |= {"gate_proj.bias", "up_proj.bias", "down_proj.bias"}
    assert set(m.layout.keys()) == keys
    weights = _load_all(path)
    for layer, lid in enumerate(m.layer_ids):
        for e in range(m.n_experts):
            rec = m.read_record(layer, e)
            assert len(rec) == m.layout.nbytes
            for p in m.layout.pieces:
                truth = _ground_truth(weights, arch, lid, e, p.key)
                assert rec[p.offset : p.offset + p.nbytes] == truth, (lid, e, p.key)
            ends = [p.offset + p.nbytes for p in m.layout.pieces]
            gaps = [(end, nxt.offset) for end, nxt in zip(ends, m.layout.pieces[1:])] + [(ends[-1], m.layout.nbytes)]
            assert all(rec[a:b] == bytes(b - a) for a, b in gaps), "padding must be zero"


@pytest.mark.parametrize("arch,bits", [("mixtral", 4), ("mixtral", 16), ("qwen3_moe", 16), ("deepseek_v3", 8)])
def test_stacked_and_per_expert_give_same_records(make, arch, bits):
    stacked = ModelFiles.open(make(arch, bits, False, 1))
    split = ModelFiles.open(make(arch, bits, True, 2))
    assert stacked.layout == split.layout
    assert stacked.layer_ids == split.layer_ids
    for layer in range(stacked.n_layers):
        for e in range(stacked.n_experts):
            assert stacked.read_record(layer, e) == split.read_record(layer, e)
    # different files, so different fingerprints
    assert stacked.fingerprint != split.fingerprint


def test_layout_shape(make):
    m = ModelFiles.open(make("mixtral", 4))
    pieces = m.layout.pieces
    assert [p.key for p in pieces] == sorted(p.key for p in pieces)
    assert all(p.offset % ALIGN == 0 for p in pieces)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(pieces, pieces[1:]))
    assert m.layout.nbytes % ALIGN == 0 and m.layout.nbytes >= pieces[-1].offset + pieces[-1].nbytes
    w = m.layout.piece("gate_proj.weight")
    assert (w.shape, w.dtype, w.nbytes) == ((64, 8), "uint32", 64 * 8 * 4)
    s = m.layout.piece("down_proj.scales")
    assert (s.shape, s.dtype, s.nbytes) == ((64, 1), "float16", 128)
    with pytest.raises(KeyError):
        m.layout.piece("gate_proj.bias")
    desc = m.layout.describe()
    assert json.loads(json.dumps(desc)) == desc
    assert desc[0] == {"key": "down_proj.biases", "offset": 0, "nbytes": 128, "shape": [64, 1], "dtype": "float16"}
    for p in pieces:
        assert getattr(mx, p.dtype).size * int(np.prod(p.shape)) == p.nbytes


def test_layout_build_aligns_pieces():
    layout = RecordLayout.build([("b.weight", (3,), "uint8", 3), ("a.scales", (5,), "float16", 10)])
    assert [(p.key, p.offset) for p in layout.pieces] == [("a.scales", 0), ("b.weight", 64)]
    assert layout.nbytes == 128


def test_extents(make):
    path = make("mixtral", 8, True, 3)
    m = ModelFiles.open(path)
    sizes = [f.stat().st_size for f in m.files]
    for layer in range(m.n_layers):
        for e in range(m.n_experts):
            ext = m.extents(layer, e)
            assert [x[3] for x in ext] == [p.offset for p in m.layout.pieces]
            assert [x[2] for x in ext] == [p.nbytes for p in m.layout.pieces]
            for fi, off, n, _ in ext:
                assert 0 <= fi < len(m.files) and off + n <= sizes[fi]
    # shards cut by tensor name, so the records of some stacked layer span two files
    stacked = ModelFiles.open(make("mixtral", 8, False, 3))
    assert any(len({x[0] for x in stacked.extents(layer, 0)}) > 1 for layer in range(stacked.n_layers))
    for bad in [(-1, 0), (m.n_layers, 0), (0, m.n_experts), (0, -1)]:
        with pytest.raises(IndexError):
            m.extents(*bad)


def test_expert_tensor_names(make):
    path = make("deepseek_v3", 4, True, 1)
    m = ModelFiles.open(path)
    names = set(mx.load(str(path / "model.safetensors")))
    expected = {n for n in names if ".mlp.experts." in n}
    assert len(expected) == 2 * 4 * 9
    assert m.expert_tensor_names() == expected
    assert any(".shared_experts." in n for n in names - expected)
    stacked = ModelFiles.open(make("gpt_oss", 8, False, 2))
    assert len(stacked.expert_tensor_names()) == 3 * 12
    assert all(".mlp.experts." in n for n in stacked.expert_tensor_names())


def test_fingerprint(tmp_path):
    path = _fresh(tmp_path, shards=2)
    fp = ModelFiles.open(path).fingerprint
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert ModelFiles.open(path).fingerprint == fp

    shard = path / "model-00002-of-00002.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    touched = ModelFiles.open(path).fingerprint
    assert touched != fp
    assert ModelFiles.open(path).fingerprint == touched

    # a rewritten shard (same size) with its mtime put back is still caught if its header differs
    data = bytearray(shard.read_bytes())
    hlen = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + hlen]
    data[8 : 8 + hlen] = header.replace(b'"format":"mlx"', b'"format":"MLX"')
    assert data[8 : 8 + hlen] != header
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert ModelFiles.open(path).fingerprint not in (fp, touched)

    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = 1.0
    (path / "config.json").write_text(json.dumps(config))
    assert ModelFiles.open(path).fingerprint not in (fp, touched)


def test_fingerprint_covers_the_real_path(tmp_path):
    a = _fresh(tmp_path)
    b = tmp_path / "copy"
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
        st = f.stat()
        os.utime(b / f.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    # Same names, sizes and mtimes elsewhere: another user's copy is another model (docs/security.md).
    assert ModelFiles.open(a).fingerprint != ModelFiles.open(b).fingerprint
    link = tmp_path / "link"
    link.symlink_to(a)
    assert ModelFiles.open(link).fingerprint == ModelFiles.open(a).fingerprint


@pytest.mark.parametrize("where", ["last byte", "data", "header", "length"])
def test_truncated_file(tmp_path, where):
    path = _fresh(tmp_path, shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    hlen = struct.unpack("<Q", data[:8])[0]
    keep = {"last byte": len(data) - 1, "data": len(data) - 100, "header": 8 + hlen // 2, "length": 4}[where]
    shard.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: truncated"):
        ModelFiles.open(path)


def test_missing_config(tmp_path):
    path = _fresh(tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        ModelFiles.open(path)


def test_missing_shard(tmp_path):
    path = _fresh(tmp_path, shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors, which is missing"):
        ModelFiles.open(path)


def test_no_index_single_file_and_no_files(tmp_path):
    path = _fresh(tmp_path)
    fp = ModelFiles.open(path)
    (path / "model.safetensors.index.json").unlink()
    m = ModelFiles.open(path)
    assert m.layout == fp.layout and m.read_record(2, 3) == fp.read_record(2, 3)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model"):
        ModelFiles.open(path)


def test_index_disagrees_with_files(tmp_path):
    path = _fresh(tmp_path, shards=2)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="which does not hold it"):
        ModelFiles.open(path)


def test_not_safetensors(tmp_path):
    path = _fresh(tmp_path)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 20) + b"this is not json....")
    with pytest.raises(ValueError, match="not a safetensors file"):
        ModelFiles.open(path)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        ModelFiles.open(path)


def _write(path, tensors, config):
    """A hand-written checkpoint of these tensors, plus the token embedding every checkpoint has."""
    tensors = {"model.embed_tokens.weight": mx.zeros((config["vocab_size"], config["hidden_size"])), **tensors}
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _qwen2_moe(experts: int, top_k: int, layers: int = 2) -> dict:
    """A config mlx-lm builds a tiny qwen2_moe from: hidden size 8, expert hidden size 4."""
    return {"model_type": "qwen2_moe", "hidden_size": 8, "num_hidden_layers": layers, "intermediate_size": 8,
            "num_attention_heads": 2, "num_experts_per_tok": top_k, "num_experts": experts,
            "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4, "rms_norm_eps": 1e-5, "vocab_size": 16}


def test_non_moe_model(tmp_path):
    tensors = {
        "model.embed_tokens.weight": mx.zeros((16, 8)),
        "model.layers.0.mlp.gate_proj.weight": mx.zeros((8, 8)),
        "model.layers.0.mlp.down_proj.weight": mx.zeros((8, 8)),
    }
    config = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "intermediate_size": 8,
              "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 16}
    path = _write(tmp_path / "dense", tensors, config)
    with pytest.raises(ValueError, match="llama model has no routed experts .* not a MoE model"):
        ModelFiles.open(path)


def test_hand_written_per_expert_bfloat16(tmp_path):
    # an HF-style per-expert checkpoint (Qwen naming) in bfloat16, plus shared experts that are not routed
    ws = {}
    for layer in (0, 1):
        ws[f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight"] = mx.ones((4, 8))
        for e in range(3):
            for proj, shape in (("gate_proj", (4, 8)), ("up_proj", (4, 8)), ("down_proj", (8, 4))):
                ws[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = mx.random.normal(shape).astype(mx.bfloat16)
    path = _write(tmp_path / "hf", ws, _qwen2_moe(3, 1))
    m = ModelFiles.open(path)
    assert m.layout == RecordLayout.build(
        [("down_proj.weight", (8, 4), "bfloat16", 64), ("gate_proj.weight", (4, 8), "bfloat16", 64),
         ("up_proj.weight", (4, 8), "bfloat16", 64)]
    )
    assert [p.offset for p in m.layout.pieces] == [0, 64, 128] and m.layout.nbytes == 192
    p = m.layout.piece("up_proj.weight")
    truth = _bytes(ws["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert m.read_record(1, 2)[p.offset : p.offset + p.nbytes] == truth


def test_expert_count_and_experts_per_token_come_from_the_model_mlx_lm_builds(tmp_path):
    path = _fresh(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_experts_per_tok"] = 3
    (path / "config.json").write_text(json.dumps(config))
    assert (ModelFiles.open(path).n_experts, ModelFiles.open(path).top_k) == (4, 3)
    config["num_local_experts"] = 8  # refused before mlx-lm builds anything (src/moe_l2/model/bounds.py)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_local_experts is 8, but the files' tensors hold 4 experts at most"):
        ModelFiles.open(path)
    del config["num_local_experts"]  # mixtral's default: 8 experts, as mlx-lm's model for config.json has
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has 8 experts"):
        ModelFiles.open(path)
    config["model_type"] = "no_such_arch"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlx-lm cannot build a no_such_arch model"):
        ModelFiles.open(path)


def test_expert_tensors_must_cover_every_switch_layer(tmp_path):
    ws = {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": mx.zeros((4, 8)) for e in range(4)}
    ws["model.layers.1.input_layernorm.weight"] = mx.zeros((8,))  # layer 1 is in the files, without experts
    path = _write(tmp_path / "half", ws, _qwen2_moe(4, 2, layers=2))
    with pytest.raises(ValueError, match=r"no routed-expert tensors for 1 of the 2 switch layers .* "
                                         r"model\.layers\.1\.mlp\.switch_mlp\.gate_proj\.weight"):
        ModelFiles.open(path)


def test_per_expert_missing_expert(tmp_path):
    ws = {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": mx.zeros((4, 8)) for e in (0, 1, 3)}
    path = _write(tmp_path / "gap", ws, _qwen2_moe(4, 2, layers=1))
    with pytest.raises(ValueError, match="has experts"):
        ModelFiles.open(path)


def test_layers_must_share_one_layout(tmp_path):
    ws = {
        "model.layers.0.mlp.switch_mlp.gate_proj.weight": mx.zeros((4, 16, 8), dtype=mx.float16),
        "model.layers.1.mlp.switch_mlp.gate_proj.weight": mx.zeros((4, 32, 8), dtype=mx.float16),
    }
    path = _write(tmp_path / "mixed", ws, _qwen2_moe(4, 2))
    with pytest.raises(ValueError, match="one record layout is needed"):
        ModelFiles.open(path)


def test_stacked_and_per_expert_of_one_key_conflict(tmp_path):
    ws = {"model.layers.0.mlp.switch_mlp.gate_proj.weight": mx.zeros((2, 4, 8))}
    ws.update({f"model.layers.0.mlp.experts.{e}.gate_proj.weight": mx.zeros((4, 8)) for e in (0, 1)})
    path = _write(tmp_path / "both", ws, _qwen2_moe(2, 1, layers=1))
    with pytest.raises(ValueError, match="twice"):
        ModelFiles.open(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        ModelFiles.open(tmp_path / "nothing")


def test_the_child_processes_answer_is_kept_and_read_back_at_the_next_start(model_dir, tmp_path, monkeypatch):
    """A daemon start builds the model in a child process once per config, MLX and mlx-lm version and source of
    architecture.py; later starts read the answer kept under the user's cache dir."""
    import platformdirs

    from moe_l2.model import architecture

    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / app))
    monkeypatch.setattr(architecture, "_IN_CHILD", True)
    config = json.loads((model_dir / "config.json").read_text())
    truth = architecture._switch_layers_here(config)
    assert architecture.switch_layers(config) == truth  # built in the child, and kept
    kept = architecture.kept_answer(config)
    assert kept.parent == tmp_path / "moe-l2" / "switch-layers" and kept.is_file()
    # Read back, not built again: what the file says comes back.
    kept.write_text(json.dumps([dict(s.__dict__, top_k=s.top_k + 1) for s in truth]))
    assert [s.top_k for s in architecture.switch_layers(config)] == [s.top_k + 1 for s in truth]
    # An unreadable file is built again and kept anew; another config has another file.
    kept.write_text("{not json")
    assert architecture.switch_layers(config) == truth and architecture._parse(kept.read_text()) == truth
    assert architecture.kept_answer({**config, "num_hidden_layers": 1}) != kept
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no temporary file left


def test_a_process_that_builds_in_child_processes_asks_mlx_for_no_memory(model_dir, model_files, tmp_path):
    """The daemon learns a model's experts from a child process (docs/architecture.md, "Native module"): the
    same layout, and MLX's allocator (Metal's on macOS) never used in the daemon's own process."""
    code = ("import json, sys\nimport mlx.core as mx\nfrom moe_l2.model import ModelFiles\n"
            "from moe_l2.model.architecture import build_in_child_processes\nbuild_in_child_processes()\n"
            "f = ModelFiles.open(sys.argv[1])\n"
            "print(json.dumps([f.fingerprint, f.n_experts, f.top_k, mx.get_peak_memory(), mx.get_active_memory()]))")
    # An empty cache dir (Linux; platformdirs ignores XDG on macOS), so that the child really builds the model.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-P", "-c", code, str(model_dir)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert list((tmp_path / "cache").rglob("*.json")) or sys.platform == "darwin"  # built in the child, and kept
    fingerprint, n_experts, top_k, peak, active = json.loads(out.stdout)
    assert (fingerprint, n_experts, top_k) == (model_files.fingerprint, model_files.n_experts, model_files.top_k)
    assert peak == active == 0
    # A model mlx-lm cannot build: the child's reason reaches the caller.
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    out = subprocess.run([sys.executable, "-P", "-c", code, str(bad)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "mlx-lm cannot build a no_such_arch model" in out.stderr


def test_a_fifo_swapped_in_after_the_check_is_refused_by_fstat(tmp_path, monkeypatch):
    """open_regular opens without blocking and trusts fstat on what it opened, not a stat before (no window
    in which a FIFO planted after the stat makes the open or a read wait)."""
    from moe_l2.model import bounds

    regular = os.stat(__file__)
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="config.json is a FIFO, not a regular file"):
        bounds.open_regular(fifo)
    monkeypatch.setattr(bounds.os, "stat", lambda path: regular)  # the stat saw a regular file
    with pytest.raises(ValueError, match="config.json is a FIFO, not a regular file"):
        bounds.open_regular(fifo)
    fd = bounds.open_regular(__file__)
    try:
        import fcntl

        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        os.close(fd)


def test_json_headers_and_tensor_extents_are_bounded(tmp_path):
    path = _fresh(tmp_path)
    config = (path / "config.json").read_text()
    nested = json.dumps({**json.loads(config), "extra": json.loads("[" * 40 + "]" * 40)})
    (path / "config.json").write_text(nested)
    with pytest.raises(ValueError, match=r"config\.json: not an mlx-lm config\.json \(JSON nested more than 32 deep\)"):
        ModelFiles.open(path)
    (path / "config.json").write_text(config)

    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps(index)[:-1] + ', "deep": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}")
    with pytest.raises(ValueError, match=r"index\.json: not a safetensors index \(JSON nested more than 32 deep\)"):
        ModelFiles.open(path)
    name = next(iter(index["weight_map"]))
    index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], name: "../model.safetensors"}}))
    with pytest.raises(ValueError, match=r"names shard '\.\./model\.safetensors', which is not a file name in"):
        ModelFiles.open(path)
    index_path.write_text(json.dumps(index))

    shard = path / "model.safetensors"
    data = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    first, second = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])[:2]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    start = header[first]["data_offsets"][0]
    header[second]["data_offsets"] = [start, start + size]  # the second tensor's bytes are the first's
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(hlen)
    assert len(raw) == hlen
    shard.write_bytes(data[:8] + raw + data[8 + hlen:])
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensors '{first}' and '{second}' overlap|"
                                         rf"model\.safetensors: tensors '{second}' and '{first}' overlap"):
        ModelFiles.open(path)


def test_the_shape_only_build_stops_past_the_modules_the_files_have_tensors_for(model_dir, model_files, tmp_path,
                                                                                monkeypatch):
    """A count config.json names that the key checks do not know (here num_hidden_layers, given straight to the
    build) is stopped by the module ceiling, in this process and in the daemon's child, before it costs memory."""
    import platformdirs

    from moe_l2.model import architecture

    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / app))
    config = json.loads((model_dir / "config.json").read_text())
    tensors = sum(len(h) - ("__metadata__" in h) for h in
                  (json.loads(f.read_bytes()[8:8 + struct.unpack("<Q", f.read_bytes()[:8])[0]])
                   for f in model_files.files))
    assert len(architecture.switch_layers(config, tensors)) == model_files.n_layers
    huge = {**config, "num_hidden_layers": 10**6}
    limit = architecture._MODULES_PER_TENSOR * tensors + architecture._MODULES_AT_LEAST
    for in_child in (False, True):
        monkeypatch.setattr(architecture, "_IN_CHILD", in_child)
        with pytest.raises(ValueError, match=rf"^config\.json makes mlx-lm build more than {limit} modules"):
            architecture.switch_layers(huge, tensors)


def test_a_record_the_file_no_longer_holds_is_named_with_its_file(tmp_path):
    """A model cut short after it was opened: the plain read and the pool's native read both raise
    UnreadableRecord naming the record(s) past the file's end now, the file and `moe-l2 verify`."""
    from moe_l2.client.pool import ExpertPool
    from moe_l2.model import UnreadableRecord

    path = _fresh(tmp_path)
    files = ModelFiles.open(path)
    ends = {e: max(offset + n for _, offset, n in files.reader.file_ranges(2, e)) for e in range(files.n_experts)}
    last = max(ends, key=ends.get)
    os.truncate(files.files[0], ends[last] - 1)
    with pytest.raises(UnreadableRecord, match=rf"MoE layer 2 expert {last} cannot be read from .*model\.safetensors "
                                               r"\(unexpected end of file .*`moe-l2 verify --model "):
        files.read_record(2, last)
    pool = ExpertPool(files, capacity=files.n_experts, client=None)
    try:
        others = [e for e in range(files.n_experts) if ends[e] < ends[last]]
        pool.fetch(2, others)  # what the file still holds is read
        assert pool.layers[2].record(others[0]) == files.read_record(2, others[0])
        with pytest.raises(UnreadableRecord, match=rf"MoE layer 2 expert {last} cannot be read from"):
            pool.fetch(2, [last])
    finally:
        pool.close()
