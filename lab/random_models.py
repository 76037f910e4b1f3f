"""Write small, real mlx-lm MoE checkpoints (and GGUF MoE models) with random weights.

The models are built with mlx-lm's own classes (``mlx_lm.models.<arch>``), so
they load with ``mlx_lm.load`` and generate with ``mlx_lm.generate``; only the
weights are random. GGUF models (``make_gguf_model``) are written with the gguf
package's own writer and quantizers. Tests and benchmarks use them in place of
downloaded models, which this project never fetches.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

__all__ = ["ARCHS", "Arch", "make_model", "make_mlx_lm_model", "make_gguf_model"]

# Head size of every generated attention layer; hidden sizes must be multiples of it.
_HEAD_DIM = 32
_DEFAULT_VOCAB = 512
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tokenizer: plain English so that prompts tokenize into
# word pieces rather than single bytes.
_TEXT = """\
The morning was cold and clear, and the river ran fast under the old stone bridge. A small boat
waited at the edge of the water, and the children stood on the bank to watch the fishermen pull in
their nets.
In the town the market opened early. Bakers sold warm bread and sweet cakes, farmers brought apples,
pears, carrots and potatoes, and a man with a red hat played the violin for anyone who would stop
and listen.
People often ask how a machine can learn to write. The answer is simple to state and hard to build:
it reads a great deal of text, it learns which words tend to follow which, and it uses what it
learned to guess the next word, one word at a time.
A mixture of experts is a model that holds many small networks and a router that picks a few of them
for each token. Only the chosen experts do any work, so the model can be very large while each step
stays cheap.
When the memory of a computer cannot hold every expert, the weights must be read from the disk while
the model runs. A good cache keeps the experts that are used most often close at hand and loads the
others when they are needed.
She opened the window and the sound of the city came in: cars and buses, a dog barking, the bell of
a church far away, and the voices of people walking to work with coffee in their hands.
The library was quiet. Rows of books stood on tall wooden shelves, and the light from the high
windows fell across the tables where students read, wrote notes and sometimes fell asleep.
Good software is tested. Every function should do one thing well, every error should say clearly
what went wrong, and every change should leave the code a little easier to read than it was before.
In the evening the wind grew stronger and the first drops of rain began to fall. The fishermen tied
their boats, the market closed, and the lights of the houses came on one by one along the street.
Numbers and names: one, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday,
Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May, June, July,
August, September, October, November, December.
Questions and answers. What time is it? It is half past seven. Where are you going? I am going home.
Why is the sky blue? Because the air scatters blue light more than red light.
"""


@dataclasses.dataclass(frozen=True)
class _Dims:
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_hidden: int
    vocab: int

    @property
    def heads(self) -> int:
        return self.hidden // _HEAD_DIM

    @property
    def kv_heads(self) -> int:
        # Grouped-query attention where the head count allows it, as in the real models.
        return self.heads // 2 if self.heads % 2 == 0 else self.heads


@dataclasses.dataclass(frozen=True)
class Arch:
    """How to build one mlx-lm architecture and how its experts are named.

    switch: path of the stacked expert layer (SwitchGLU) inside a decoder layer.
    experts: path under which the arch's ``sanitize`` stacks per-expert tensors
      (``<experts>.<N>.<proj>.<param>``); None where it stacks none.
    proj_names: stacked projection name -> per-expert name, where they differ.
    per_expert_params: the params that ``sanitize`` stacks back.
    reinit: suffixes of parameters that mlx-lm initialises to zero (real
      checkpoints overwrite them); they get small random values so that routing
      has no ties and bias pieces are not all zero.
    """

    args: Callable[[_Dims], dict]
    switch: str
    experts: Optional[str]
    proj_names: dict = dataclasses.field(default_factory=dict)
    per_expert_params: tuple = ("weight", "scales", "biases")
    reinit: tuple = ()
    min_layers: int = 1


def _qwen3_moe(d: _Dims) -> dict:
    return dict(
        model_type="qwen3_moe",
        hidden_size=d.hidden,
        num_hidden_layers=d.layers,
        intermediate_size=2 * d.moe_hidden,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=_HEAD_DIM,
        num_experts=d.experts,
        num_experts_per_tok=d.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=d.moe_hidden,
        rms_norm_eps=1e-6,
        vocab_size=d.vocab,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        norm_topk_prob=True,
    )


def _mixtral(d: _Dims) -> dict:
    return dict(
        model_type="mixtral",
        vocab_size=d.vocab,
        hidden_size=d.hidden,
        intermediate_size=d.moe_hidden,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        num_local_experts=d.experts,
        num_experts_per_tok=d.top_k,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )


def _deepseek_v3(d: _Dims) -> dict:
    return dict(
        model_type="deepseek_v3",
        vocab_size=d.vocab,
        hidden_size=d.hidden,
        intermediate_size=2 * d.moe_hidden,
        moe_intermediate_size=d.moe_hidden,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.heads,
        n_shared_experts=1,
        n_routed_experts=d.experts,
        routed_scaling_factor=2.5,
        kv_lora_rank=d.hidden,
        q_lora_rank=d.hidden,
        qk_rope_head_dim=_HEAD_DIM // 2,
        v_head_dim=_HEAD_DIM,
        qk_nope_head_dim=_HEAD_DIM,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=d.top_k,
        moe_layer_freq=1,
        # Like the real model, the first layer is dense (when there is more than one).
        first_k_dense_replace=1 if d.layers > 1 else 0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=False,
    )


def _gpt_oss(d: _Dims) -> dict:
    return dict(
        model_type="gpt_oss",
        num_hidden_layers=d.layers,
        num_local_experts=d.experts,
        num_experts_per_tok=d.top_k,
        vocab_size=d.vocab,
        rms_norm_eps=1e-5,
        hidden_size=d.hidden,
        intermediate_size=d.moe_hidden,
        head_dim=_HEAD_DIM,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        sliding_window=128,
        rope_theta=150000,
        # mlx-lm's default list has only 2 * (layers // 2) entries and would drop a last odd layer.
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(d.layers)],
    )


ARCHS: dict[str, Arch] = {
    "qwen3_moe": Arch(
        _qwen3_moe,
        switch="mlp.switch_mlp",
        experts="mlp.experts",
        # mlx-lm's qwen3_moe sanitize stacks only the unquantized ".weight".
        per_expert_params=("weight",),
    ),
    "mixtral": Arch(
        _mixtral,
        switch="block_sparse_moe.switch_mlp",
        experts="block_sparse_moe.experts",
        proj_names={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    ),
    "deepseek_v3": Arch(
        _deepseek_v3,
        switch="mlp.switch_mlp",
        experts="mlp.experts",
        reinit=("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
    ),
    "gpt_oss": Arch(
        _gpt_oss,
        switch="mlp.experts",
        # mlx-lm's gpt_oss sanitize only unpacks the fused HF layout; it stacks no per-expert tensors.
        experts=None,
        reinit=(".bias", ".sinks"),
        # Its attention needs one sliding and one full layer.
        min_layers=2,
    ),
}


@lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # A ByteLevel decoder makes mlx-lm pick its BPE streaming detokenizer.
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(), trainer=trainer)
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size}: the built-in tokenizer text gives {got} tokens at most "
            f"(at least {256 + len(_SPECIAL_TOKENS)} are needed for the byte alphabet)"
        )
    return tok.to_str()


def _save_tokenizer(out: Path, vocab_size: int) -> tuple[int, int]:
    """Write tokenizer.json and its configs; returns (bos_token_id, eos_token_id)."""
    from tokenizers import Tokenizer

    text = _tokenizer_json(vocab_size)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    special = {
        "bos_token": _SPECIAL_TOKENS[0],
        "eos_token": _SPECIAL_TOKENS[0],
        "pad_token": _SPECIAL_TOKENS[0],
        "additional_special_tokens": list(_SPECIAL_TOKENS[1:]),
    }
    # Written by hand rather than by transformers' save_pretrained, whose format
    # differs between major versions; PreTrainedTokenizerFast loads in all of them.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    tok = Tokenizer.from_str(text)
    return tok.token_to_id(special["bos_token"]), tok.token_to_id(special["eos_token"])


def _group_size(bits: int, hidden: int, moe_hidden: int) -> Optional[int]:
    if bits == 16:
        return None
    for gs in (64, 32):
        if hidden % gs == 0 and moe_hidden % gs == 0:
            return gs
    raise ValueError(
        f"--bits {bits} quantizes in groups of 64 or 32: hidden_size ({hidden}) and "
        f"moe_hidden_size ({moe_hidden}) must both be multiples of 32"
    )


def _validate(arch, layers, experts, top_k, hidden_size, moe_hidden_size, bits, per_expert, shards):
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(sorted(ARCHS))}")
    spec = ARCHS[arch]
    if layers < spec.min_layers:
        raise ValueError(f"{arch} needs at least {spec.min_layers} layer(s), got {layers}")
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be between 1 and experts ({experts}), got {top_k}")
    if hidden_size < _HEAD_DIM or hidden_size % _HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {_HEAD_DIM}, got {hidden_size}")
    if moe_hidden_size < 1:
        raise ValueError(f"moe_hidden_size must be >= 1, got {moe_hidden_size}")
    if bits not in (4, 8, 16):
        raise ValueError(f"bits must be 4, 8 or 16, got {bits}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if per_expert:
        if spec.experts is None:
            raise ValueError(f"mlx-lm cannot load {arch} with per-expert tensors (its sanitize does not stack them)")
        if bits != 16 and "scales" not in spec.per_expert_params:
            raise ValueError(
                f"mlx-lm cannot load a quantized {arch} with per-expert tensors "
                f"(its sanitize stacks only {', '.join(spec.per_expert_params)}); use --bits 16"
            )
    return spec, _group_size(bits, hidden_size, moe_hidden_size)


def _quantize(model, config: dict, group_size: int, bits: int) -> None:
    """nn.quantize the model and record it in config as mlx_lm.convert does."""
    import mlx.nn as nn

    params = {"group_size": group_size, "bits": bits, "mode": "affine"}
    recorded = dict(params)
    arch_predicate = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        chosen = arch_predicate(path, module) if arch_predicate is not None else True
        if isinstance(chosen, dict):
            # mlx_lm.convert would fail on a layer its arch wants in a group the dims do not allow.
            if module.weight.shape[-1] % chosen["group_size"]:
                return False
            recorded[path] = chosen
        return chosen

    nn.quantize(model, group_size, bits, mode="affine", class_predicate=predicate)
    config["quantization"] = recorded
    config["quantization_config"] = recorded


def _split_experts(weights: dict, spec: Arch) -> dict:
    """Replace each stacked expert tensor by one tensor per expert, named as sanitize expects."""
    out = {}
    marker = f".{spec.switch}."
    for name, value in weights.items():
        if marker not in name:
            out[name] = value
            continue
        prefix, rest = name.split(marker, 1)
        proj, param = rest.split(".")
        proj = spec.proj_names.get(proj, proj)
        for e in range(value.shape[0]):
            out[f"{prefix}.{spec.experts}.{e}.{proj}.{param}"] = value[e]
    return out


def _shard(names: list[str], weights: dict, shards: int) -> list[list[str]]:
    """Cut the sorted names into `shards` runs of about equal bytes, none empty."""
    if shards > len(names):
        raise ValueError(f"shards ({shards}) exceeds the number of tensors ({len(names)})")
    total = sum(weights[n].nbytes for n in names)
    groups: list[list[str]] = [[]]
    done = 0
    for i, n in enumerate(names):
        left = len(names) - i
        need_new = len(groups) < shards and groups[-1] and (
            done >= total * len(groups) / shards or left == shards - len(groups)
        )
        if need_new:
            groups.append([])
        groups[-1].append(n)
        done += weights[n].nbytes
    return groups


def make_model(
    out_dir,
    arch: str,
    layers: int,
    experts: int,
    top_k: int,
    hidden_size: int,
    moe_hidden_size: int,
    bits: int,
    per_expert: bool = False,
    shards: int = 1,
    seed: int = 0,
    vocab_size: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Path:
    """Write a random-weight mlx-lm checkpoint of `arch` into out_dir (made beside it, then renamed into place:
    out_dir must not exist, or be an empty directory).

    The same arguments give the same bytes; per_expert=True holds the same
    weights as per_expert=False, one tensor per routed expert. Seeds mlx's
    global random generator. Raises ValueError for arguments the arch or
    mlx-lm cannot take.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    say = progress or (lambda _msg: None)
    spec, group_size = _validate(
        arch, layers, experts, top_k, hidden_size, moe_hidden_size, bits, per_expert, shards
    )
    vocab = _DEFAULT_VOCAB if vocab_size is None else vocab_size
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    _tokenizer_json(vocab)  # fail on a bad vocab_size before writing anything

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = spec.args(_Dims(layers, experts, top_k, hidden_size, moe_hidden_size, vocab))
    args = module.ModelArgs.from_dict(config)
    say(f"building {arch}: {layers} layers, {experts} experts (top {top_k}), hidden {hidden_size}/{moe_hidden_size}")
    mx.random.seed(seed)
    model = module.Model(args)
    zeroed = [
        (k, mx.random.normal(v.shape) * 0.02)
        for k, v in tree_flatten(model.parameters())
        if k.endswith(spec.reinit)
    ]
    if zeroed:
        model.update(tree_unflatten(zeroed))
    model.set_dtype(mx.float16)
    if group_size is not None:
        say(f"quantizing to {bits} bits, group size {group_size}")
        _quantize(model, config, group_size, bits)

    weights = dict(tree_flatten(model.parameters()))
    if per_expert:
        weights = _split_experts(weights, spec)
    names = sorted(weights)
    groups = _shard(names, weights, shards)

    out.parent.mkdir(parents=True, exist_ok=True)
    # Written in a directory only this user may enter, then renamed into place (over an empty one): files made by
    # path in `out` itself could meet links another user planted there (docs/security.md, "Files moe-l2 writes").
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        _save_checkpoint(work, model, config, weights, groups, vocab, say)
        work.chmod(0o755)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    say(f"wrote {out}")
    return out


def _save_checkpoint(out: Path, model, config: dict, weights: dict, groups, vocab: int, say) -> None:
    """make_model's files: tokenizer, config, safetensors shards and their index."""
    import mlx.core as mx
    from mlx_lm.utils import get_total_parameters, save_config

    bos, eos = _save_tokenizer(out, vocab)
    config["bos_token_id"] = bos
    config["eos_token_id"] = eos
    save_config(config, out / "config.json")

    fmt = "model-{:05d}-of-{:05d}.safetensors" if len(groups) > 1 else "model.safetensors"
    weight_map = {}
    for i, group in enumerate(groups):
        fname = fmt.format(i + 1, len(groups))
        say(f"writing {fname} ({len(group)} tensors)")
        mx.save_safetensors(str(out / fname), {n: weights[n] for n in group}, metadata={"format": "mlx"})
        weight_map.update((n, fname) for n in group)
    # mlx_lm.save_model writes the index for a single file too.
    index = {
        "metadata": {
            "total_size": sum(v.nbytes for v in weights.values()),
            "total_parameters": get_total_parameters(model),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def make_mlx_lm_model(out_dir, config: dict, *, bits: int = 4, group_size: int = 32, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of any mlx-lm architecture, built from `config` (the small model
    args of a test), quantized and saved the way mlx_lm.convert does (``quantize_model``, ``save_model``,
    ``save_config``), with the offline tokenizer. bits=16 leaves it in float16.

    Parameters mlx-lm initialises to zero (router biases, score corrections: real checkpoints overwrite
    them) get small random values, so that routing has no ties."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    config = dict(config)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    zeroed = [(k, mx.random.normal(v.shape) * 0.02) for k, v in tree_flatten(model.parameters())
              if v.size and not mx.any(v).item()]
    if zeroed:
        model.update(tree_unflatten(zeroed))
    model.set_dtype(mx.float16)
    if bits != 16:
        model, config = quantize_model(model, config, group_size, bits)
    out.mkdir(parents=True, exist_ok=True)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or _DEFAULT_VOCAB
    config["bos_token_id"], config["eos_token_id"] = _save_tokenizer(out, vocab)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def make_gguf_model(path, *, arch: str = "qwen3moe", layers: int = 2, experts: int = 8, top_k: int = 2,
                    hidden_size: int = 64, moe_hidden_size: int = 64, types="Q4_0", dense_layers: int = 0,
                    expert_bias: bool = False, split_max_tensors: int = 0, vocab_size: int = 32,
                    seed: int = 0) -> Path:
    """Write a random-weight GGUF (llama.cpp) MoE model with gguf's own writer and quantizers; returns its path.

    types: one GGUF type name for every expert tensor, or {"gate": ..., "up": ..., "down": ...}.
    The first `dense_layers` blocks have a dense FFN (ffn_gate/ffn_up/ffn_down) instead of experts.
    split_max_tensors > 0 writes a split model (name-00001-of-0000N.gguf); the first file is returned.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(types, str):
        types = {"gate": types, "up": types, "down": types}
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name("moe-l2 test model")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(2 * moe_hidden_size)
    writer.add_expert_feed_forward_length(moe_hidden_size)
    writer.add_head_count(max(1, hidden_size // 32))
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_leading_dense_block_count(dense_layers)
    writer.add_layer_norm_rms_eps(1e-6)

    def add(name: str, shape: tuple, type_name: str) -> None:
        data = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        qtype = GGMLQuantizationType[type_name]
        if type_name == "F32":
            writer.add_tensor(name, data)
        elif type_name == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            try:
                raw = quants.quantize(data, qtype)
            except NotImplementedError:  # gguf has no quantizer for it: random blocks (unsupported-type tests)
                raw = rng.integers(0, 256, size=quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)

    add("token_embd.weight", (vocab_size, hidden_size), "F16")
    add("output_norm.weight", (hidden_size,), "F32")
    for b in range(layers):
        add(f"blk.{b}.attn_norm.weight", (hidden_size,), "F32")
        if b < dense_layers:
            add(f"blk.{b}.ffn_gate.weight", (2 * moe_hidden_size, hidden_size), "F16")
            add(f"blk.{b}.ffn_up.weight", (2 * moe_hidden_size, hidden_size), "F16")
            add(f"blk.{b}.ffn_down.weight", (hidden_size, 2 * moe_hidden_size), "F16")
            continue
        add(f"blk.{b}.ffn_gate_inp.weight", (experts, hidden_size), "F32")
        add(f"blk.{b}.ffn_gate_exps.weight", (experts, moe_hidden_size, hidden_size), types["gate"])
        add(f"blk.{b}.ffn_up_exps.weight", (experts, moe_hidden_size, hidden_size), types["up"])
        add(f"blk.{b}.ffn_down_exps.weight", (experts, hidden_size, moe_hidden_size), types["down"])
        if expert_bias:
            add(f"blk.{b}.ffn_gate_exps.bias", (experts, moe_hidden_size), "F32")
            add(f"blk.{b}.ffn_up_exps.bias", (experts, moe_hidden_size), "F32")
            add(f"blk.{b}.ffn_down_exps.bias", (experts, hidden_size), "F32")
    add("output.weight", (vocab_size, hidden_size), "F16")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        first = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
        if first:
            return first[0]
    return path

