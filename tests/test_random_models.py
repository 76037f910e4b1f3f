"""The random-weight checkpoint generator writes models that mlx-lm itself loads and runs."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from moe_l2.cli import main as moe_l2_main
from moe_l2.lab.random_models import ARCHS, make_model

DIMS = dict(layers=3, experts=4, top_k=2, hidden_size=64, moe_hidden_size=64)
PROMPT = "The morning was"


def _make(path, arch="mixtral", bits=4, **kw):
    return make_model(path, arch, bits=bits, **{**DIMS, **kw})


def _load(path):
    model, tok, config = mlx_lm.load(str(path), return_config=True)
    # mlx's CPU gather_mm takes float32 only, so fp16 experts cannot run on CPU as written.
    if mx.default_device() == mx.cpu and "quantization" not in config:
        model.set_dtype(mx.float32)
    return model, tok


def _greedy(path, n=6):
    model, tok = _load(path)
    ids = mx.array(tok.encode(PROMPT))[None]
    logits = model(ids)
    text = mlx_lm.generate(model, tok, PROMPT, max_tokens=n)
    return text, logits


def _weights(path):
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize("arch,bits", [(a, 4) for a in ARCHS] + [("mixtral", 8), ("qwen3_moe", 16)])
def test_loads_and_generates_with_mlx_lm(tmp_path, arch, bits):
    path = _make(tmp_path / "m", arch, bits)
    model, tok = _load(path)
    assert model.model_type == arch
    text = mlx_lm.generate(model, tok, PROMPT, max_tokens=5)
    assert isinstance(text, str) and text
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == len(tok.get_vocab()) == 512
    assert config["eos_token_id"] in tok.eos_token_ids


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = _make(tmp_path / "a", seed=3)
    b = _make(tmp_path / "b", seed=3)
    c = _make(tmp_path / "c", seed=4)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_weights_have_realistic_scale(tmp_path):
    path = _make(tmp_path / "m", "deepseek_v3", 16)
    w = _weights(path)
    for name, v in w.items():
        # mlx-lm's zero-initialised router and bias parameters get random values too.
        assert mx.any(v != 0).item(), name
    gate = w["model.layers.1.mlp.switch_mlp.gate_proj.weight"].astype(mx.float32)
    assert 0.05 < mx.abs(gate).max().item() <= 1 / 64**0.5 + 1e-3


def test_quantization_config_as_mlx_lm_convert_writes_it(tmp_path):
    qwen = json.loads((_make(tmp_path / "q", "qwen3_moe", 4) / "config.json").read_text())
    expected = {"group_size": 64, "bits": 4, "mode": "affine"}
    # qwen3_moe's quant_predicate keeps its routers at 8 bits, recorded per path.
    expected.update({f"model.layers.{i}.mlp.gate": {"group_size": 64, "bits": 8} for i in range(3)})
    assert qwen["quantization"] == expected
    assert qwen["quantization_config"] == expected
    assert list(qwen) == sorted(qwen)

    path = _make(tmp_path / "m", "mixtral", 8, hidden_size=96, moe_hidden_size=32)
    mixtral = json.loads((path / "config.json").read_text())
    assert mixtral["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    w = _weights(path)
    assert w["model.layers.0.block_sparse_moe.switch_mlp.down_proj.scales"].shape == (4, 96, 1)
    assert w["model.layers.0.block_sparse_moe.switch_mlp.gate_proj.weight"].dtype == mx.uint32
    assert _greedy(path)[0]


def test_fp16_checkpoint(tmp_path):
    path = _make(tmp_path / "m", "qwen3_moe", 16)
    config = json.loads((path / "config.json").read_text())
    assert "quantization" not in config
    assert {v.dtype for v in _weights(path).values()} == {mx.float16}


@pytest.mark.parametrize(
    "arch,bits,expert_names",
    [
        ("mixtral", 4, ["block_sparse_moe.experts.{e}.w1.scales", "block_sparse_moe.experts.{e}.w2.weight"]),
        ("qwen3_moe", 16, ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.down_proj.weight"]),
        ("deepseek_v3", 8, ["mlp.experts.{e}.up_proj.biases", "mlp.experts.{e}.gate_proj.weight"]),
    ],
)
def test_per_expert_matches_stacked(tmp_path, arch, bits, expert_names):
    stacked = _make(tmp_path / "s", arch, bits, seed=7)
    split = _make(tmp_path / "p", arch, bits, seed=7, per_expert=True, shards=2)
    ws, wp = _weights(stacked), _weights(split)
    assert not any(".switch_mlp." in n for n in wp)
    layer = 1
    for e in range(DIMS["experts"]):
        for n in expert_names:
            assert f"model.layers.{layer}.{n.format(e=e)}" in wp
    # per-expert tensors are the stacked ones, sliced
    model, _ = mlx_lm.load(str(split))
    loaded = dict(tree_flatten(model.parameters()))
    for name, v in ws.items():
        assert mx.array_equal(loaded[name], v), name
    text_s, logits_s = _greedy(stacked)
    text_p, logits_p = _greedy(split)
    assert text_s == text_p
    assert mx.array_equal(logits_s, logits_p)


def test_shards(tmp_path):
    path = _make(tmp_path / "m", "mixtral", 4, shards=3)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    per_file = {f: set(mx.load(str(path / f))) for f in files}
    assert all(per_file.values())
    assert index["weight_map"] == {n: f for f, names in per_file.items() for n in names}
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in _weights(path).values())
    single = _make(tmp_path / "one", "mixtral", 4)
    assert _greedy(path)[0] == _greedy(single)[0]


def test_chat_template_and_tokenizer_files(tmp_path):
    path = _make(tmp_path / "m", "mixtral", 4, vocab_size=300)
    _, tok = mlx_lm.load(str(path))
    assert len(tok.get_vocab()) == 300
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("the river ran fast")) == "the river ran fast"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        assert (path / name).is_file()


def test_progress_messages(tmp_path):
    said = []
    _make(tmp_path / "m", progress=said.append, shards=2)
    assert any("quantizing" in s for s in said)
    assert sum("writing" in s for s in said) == 2


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(experts=0), "experts"),
        (dict(layers=0), "layer"),
        (dict(arch="gpt_oss", layers=1), "at least 2"),
        (dict(hidden_size=80), "multiple of 32"),
        (dict(moe_hidden_size=48), "multiples of 32"),
        (dict(bits=3), "bits"),
        (dict(arch="llama"), "unknown arch"),
        (dict(arch="gpt_oss", per_expert=True), "per-expert"),
        (dict(arch="qwen3_moe", per_expert=True), "--bits 16"),
        (dict(shards=0), "shards"),
        (dict(shards=10_000), "shards"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(vocab_size=100_000), "vocab_size"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _make(tmp_path / "m", **kw)
    assert not (tmp_path / "m" / "config.json").exists()


def test_refuses_non_empty_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        _make(tmp_path / "m")


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["make-model", "--arch", "mixtral", "--num-layers", "2", "--experts", "4", "--top-k", "2", "--hidden-size", "64",
            "--moe-hidden-size", "64", "--bits", "8", "--out", str(out), "--per-expert", "--shards", "2",
            "--seed", "1"]
    assert moe_l2_main(argv) == 0
    assert (out / "model-00002-of-00002.safetensors").is_file()
    assert "wrote" in capsys.readouterr().err

    bad = argv[:]
    bad[bad.index("--top-k") + 1] = "9"
    bad[bad.index("--out") + 1] = str(tmp_path / "bad")
    assert moe_l2_main(bad) == 2
    assert "top_k must be between 1 and experts (4), got 9" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        moe_l2_main(argv[:-2] + ["--bits", "5"])
    assert "invalid choice" in capsys.readouterr().err
