"""Every MoE architecture of the installed mlx-lm streams with the tokens of the model loaded whole
(docs/supported-models.md).

The architectures are found in mlx-lm itself (every ``mlx_lm.models`` module whose model uses a switch
layer, directly or through the module it wraps), and the table below must name each of them: small model
args (written for these tests, after the sizes mlx-lm's own test suite uses) or the reason it cannot run
here. Each model is built with random weights, quantized to 4 bits and saved as mlx_lm.convert does; its
greedy tokens through StreamedLM (an L0 smaller than the experts, so experts are evicted and read again)
must equal those of mlx_lm.load's model. A representative handful runs by default, the rest under -m slow.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import sys

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.models import switch_layers
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.lab.random_models import make_mlx_lm_model
from moe_l2.model import ModelFiles
from moe_l2.model.packer import PackError, pack
from .conftest import budget_for

# Sizes every small model starts from, of which each takes the keys its args class has: a config holds no key
# its architecture ignores, so the experts per token and the expert count are found under the arch's own names.
BASE = dict(
    hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=512, num_experts=8, n_routed_experts=8, num_local_experts=8,
    moe_num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    first_k_dense_replace=0, n_group=1, topk_group=1, n_shared_experts=1, num_shared_experts=1, kv_lora_rank=16,
    q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, shared_expert_intermediate_size=64,
    shared_intermediate_size=64, tie_word_embeddings=False, norm_topk_prob=True, routed_scaling_factor=1.0,
    attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[], partial_rotary_factor=0.5, use_qk_norm=False,
    sliding_window=32, logits_scaling=1.0, attention_multiplier=1.0, embedding_multiplier=1.0,
    residual_multiplier=1.0, layer_norm_epsilon=1e-5, norm_eps=1e-5, layernorm_epsilon=1e-5,
)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]
ROPE_BY_LAYER_TYPE = {"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 10000.0}}
GEMMA4_MOE = dict(enable_moe_block=True, top_k_experts=2, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                  global_head_dim=32)
QWEN3_5 = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
               linear_conv_kernel_dim=3, full_attention_interval=2)
MISTRAL4_ROPE = {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4096}
KIMI_LINEAR = {"num_heads": 2, "head_dim": 32, "kda_layers": [1], "short_conv_kernel_size": 3}


def small(model_type: str, args: str = "ModelArgs", **over) -> dict:
    """BASE's keys that mlx_lm.models.<model_type>.<args> has, and `over`."""
    fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(f"mlx_lm.models.{model_type}"), args))}
    return {**{k: v for k, v in BASE.items() if k in fields}, "model_type": model_type, **over}


def wrapped(model_type: str, text: dict, **over) -> dict:
    """A multimodal wrapper whose language model is `text`."""
    return {"model_type": model_type, "vocab_size": text["vocab_size"], "text_config": text, **over}


CASES = {
    "Klear": small("Klear"),
    "afmoe": small("afmoe", layer_types=["full_attention", "sliding_attention"], num_dense_layers=0),
    "bailing_hybrid": small("bailing_hybrid", layer_group_size=2, group_norm_size=1),
    "bailing_moe": small("bailing_moe"),
    "bailing_moe_linear": small("bailing_moe_linear", layer_group_size=2, group_norm_size=1),
    "bailing_moe_v3": small("bailing_moe_v3"),
    "deepseek": small("deepseek"),
    "deepseek_v2": small("deepseek_v2", rope_scaling={"factor": 1.0}),
    "deepseek_v3": small("deepseek_v3"),
    "deepseek_v32": small("deepseek_v32", index_head_dim=32, index_n_heads=2, index_topk=4),
    "deepseek_v41": small("deepseek_v41", o_groups=2, o_lora_rank=32),
    "dots1": small("dots1"),
    "ernie4_5_moe": small("ernie4_5_moe", use_bias=False, moe_k=2),
    "exaone_moe": small("exaone_moe", layer_types=TWO_LAYER_TYPES, is_moe_layer=[True, True]),
    "gemma4": wrapped("gemma4", small("gemma4_text", layer_types=TWO_LAYER_TYPES, **GEMMA4_MOE)),
    "gemma4_text": small("gemma4_text", layer_types=TWO_LAYER_TYPES, **GEMMA4_MOE),
    "glm4_moe": small("glm4_moe", rope_scaling=None),
    "glm4_moe_lite": small("glm4_moe_lite"),
    "glm_moe_dsa": small("glm_moe_dsa", index_head_dim=32, index_n_heads=2, index_topk=4, topk_method="noaux_tc",
                         scoring_func="sigmoid", moe_layer_freq=1, rope_parameters={"rope_theta": 10000.0}),
    "gpt_oss": small("gpt_oss", layer_types=TWO_LAYER_TYPES),
    "granitemoe": small("granitemoe"),
    "granitemoehybrid": small("granitemoehybrid", layer_types=["mamba", "attention"], mamba_n_heads=4,
                              mamba_d_head=32, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
                              mamba_n_groups=1, mamba_conv_bias=False),
    "hunyuan": small("hunyuan", moe_topk=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
                     use_cla=False, cla_share_factor=1,
                     rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}),
    "jamba": small("jamba", num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                   expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2),
    "kimi_k25": wrapped("kimi_k25", small("deepseek_v3")),
    "kimi_k3": wrapped("kimi_k3", small("kimi_k3", "TextArgs", linear_attn_config=KIMI_LINEAR, num_experts_per_token=2)),
    "kimi_linear": small("kimi_linear", linear_attn_config=KIMI_LINEAR,
                         model_max_length=4096),
    "kimi_vl": wrapped("kimi_vl", small("deepseek_v3")),
    "laguna": small("laguna", layer_types=TWO_LAYER_TYPES, mlp_layer_types=["sparse", "sparse"],
                    num_attention_heads_per_layer=[2, 2]),
    "lfm2_moe": small("lfm2_moe", full_attn_idxs=[0], conv_bias=False, conv_L_cache=3, num_dense_layers=0,
                      use_expert_bias=True),
    "llama4": wrapped("llama4", small("llama4", "TextArgs", interleave_moe_layer_step=1, intermediate_size_mlp=64,
                                      attention_chunk_size=8, num_experts_per_tok=1, rope_scaling=None,
                                      num_hidden_layers=4)),
    "longcat_flash": small("longcat_flash", attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=64,
                           moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=2, num_layers=2,
                           mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "longcat_flash_ngram": small("longcat_flash_ngram", attention_method="MLA", zero_expert_type="identity",
                                 ffn_hidden_size=64, moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=2,
                                 num_layers=2, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mellum": small("mellum", layer_types=TWO_LAYER_TYPES, rope_parameters=ROPE_BY_LAYER_TYPE),
    "mimo_v2_flash": small("mimo_v2_flash", hybrid_layer_pattern=[0, 1], moe_layer_freq=[1, 1],
                           add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
                           sliding_window_size=32, topk_method="noaux_tc", scoring_func="sigmoid",
                           swa_rope_theta=10000.0, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                           swa_head_dim=32, swa_v_head_dim=32, v_head_dim=32),
    "minimax": small("minimax", rotary_dim=16),
    "minimax_m3_vl": wrapped("minimax_m3_vl", small("minimax_m3_vl", "TextArgs")),
    "mistral3": wrapped("mistral3", small("mistral4", rope_parameters=MISTRAL4_ROPE)),
    "mistral4": small("mistral4", rope_parameters=MISTRAL4_ROPE),
    "mixtral": small("mixtral"),
    "nemotron_h": small("nemotron_h", num_hidden_layers=3, hybrid_override_pattern=["M", "*", "E"], mamba_num_heads=4, mamba_head_dim=16,
                        mamba_proj_bias=False, ssm_state_size=16, conv_kernel=3, n_groups=1, mlp_bias=False,
                        use_bias=False, use_conv_bias=True, moe_shared_expert_intermediate_size=64),
    "olmoe": small("olmoe"),
    "phimoe": small("phimoe"),
    "phixtral": small("phixtral", num_vocab=512, model_dim=64, num_heads=2, num_layers=2, rotary_dim=16),
    "qwen2_moe": small("qwen2_moe"),
    "qwen3_5": wrapped("qwen3_5", small("qwen3_5", "TextModelArgs", **QWEN3_5)),
    "qwen3_5_moe": wrapped("qwen3_5_moe", small("qwen3_5", "TextModelArgs", **QWEN3_5)),
    "qwen3_moe": small("qwen3_moe"),
    "qwen3_next": small("qwen3_next", linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=3, full_attention_interval=2),
    "qwen3_vl_moe": wrapped("qwen3_vl_moe", small("qwen3_moe")),
    "solar_open": small("solar_open"),
    "step3p5": small("step3p5", num_attention_groups=1, moe_top_k=2, share_expert_dim=64, moe_layers_enum="0,1",
                     layer_types=["full_attention", "full_attention"], rope_theta=[1e4, 1e4]),
}

# Architectures that cannot run here, with the reason (docs/supported-models.md).
CANNOT_RUN = {
    "muse_spark": "its attention runs an mx.fast.metal_kernel, which has no CPU back-end: it runs on Apple "
                  "silicon only (mlx-lm cannot run it here)",
    "prism_hadamard_qwen35": "mlx-lm builds it only from a Hadamard-rotated pack (2-bit weights in groups of 128 "
                             "and a manifest of its packed modules), not from model args and mlx_lm.convert",
}

# Run by default: one of each kind of switch layer, naming and router (the rest: -m slow).
FAST = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "gemma4_text", "hunyuan", "ernie4_5_moe", "nemotron_h")


def moe_architectures() -> set[str]:
    """The mlx_lm.models modules whose model uses a switch layer, itself or through a module it builds on."""
    import mlx_lm.models

    uses: dict[str, bool] = {}

    def uses_switch(module, seen) -> bool:
        if module.__name__ in uses:
            return uses[module.__name__]
        seen.add(module.__name__)
        found = False
        for value in vars(module).values():
            other = value if inspect.ismodule(value) else sys.modules.get(getattr(value, "__module__", None) or "")
            if other is switch_layers:
                found = True
            elif (other is not None and other.__name__.startswith("mlx_lm.models.") and other.__name__ not in seen
                  and uses_switch(other, seen)):
                found = True
            if found:
                break
        uses[module.__name__] = found
        return found

    out = set()
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (ImportError, SystemExit):  # an optional dependency mlx-lm's module asks for: not installed here
            continue
        if info.name != "switch_layers" and hasattr(module, "Model") and uses_switch(module, set()):
            out.add(info.name)
    return out


def test_the_table_names_every_moe_architecture_of_mlx_lm():
    found = moe_architectures()
    assert found - CASES.keys() - CANNOT_RUN.keys() == set(), "add small args (CASES) or a reason (CANNOT_RUN)"
    assert (CASES.keys() | CANNOT_RUN.keys()) - found == set(), "the table names modules that are not MoE"
    assert not CASES.keys() & CANNOT_RUN.keys()


def greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=n)]


def switch_paths(model) -> dict[str, int]:
    """The switch layers of a loaded model: module path -> number of experts."""
    return {path: m.up_proj.weight.shape[0] if isinstance(m, SwitchGLU) else m.fc1.weight.shape[0]
            for path, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))}


@pytest.fixture(scope="module", params=[
    pytest.param(arch, marks=() if arch in FAST else pytest.mark.slow) for arch in sorted(CASES)])
def arch_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("archs") / request.param
    make_mlx_lm_model(out, CASES[request.param], bits=4)
    return out


def test_streamed_tokens_equal_the_whole_models(arch_model):
    whole, tokenizer = load(str(arch_model))
    files = ModelFiles.open(arch_model)
    # The expert count is the loaded model's; every MoE layer routes, and the experts per token are the
    # router's: what its switch layers receive.
    assert set(switch_paths(whole).values()) == {files.n_experts}
    ids = tokenizer.encode("The morning was cold and clear, and the river ran fast under the old stone bridge.")
    expected = greedy(whole, tokenizer, ids, 8)
    slots = files.top_k + 1
    assert slots < files.n_experts
    with StreamedLM(arch_model, l0_slots=slots, daemon=False, record=True) as lm:
        assert greedy(lm.model, lm.tokenizer, ids, 8) == expected
        assert lm.pool.counts.l3_reads > files.n_layers * slots  # experts were evicted and read again
        routed = lm.recorder.take()
    assert routed and all(layer is not None for token in routed for layer in token)
    assert max(len(layer) for token in routed for layer in token) == files.top_k


@pytest.mark.parametrize("arch", ["deepseek_v3", "gemma4_text", "hunyuan"])
def test_streamed_through_a_daemon(arch, daemon_factory, tmp_path):
    path = make_mlx_lm_model(tmp_path / arch, CASES[arch], bits=4)
    whole, tokenizer = load(str(path))
    files = ModelFiles.open(path)
    ids = tokenizer.encode("Questions and answers. What time is it? It is half past seven.")
    expected = greedy(whole, tokenizer, ids, 8)
    daemon = daemon_factory([path], str(budget_for(files, files.n_experts // 2)))
    with StreamedLM(path, l0_slots=files.top_k + 1, socket=daemon.socket, client_wait_s=5) as lm:
        assert lm.client.attached
        assert greedy(lm.model, lm.tokenizer, ids, 8) == expected
        assert lm.pool.counts.l2_hits + lm.pool.counts.l3_reads > 0


@pytest.mark.parametrize("arch", ["gemma4_text", "phixtral", "hunyuan"])
def test_a_packed_copy_streams_the_same_tokens(arch, tmp_path):
    # Switch layers outside the once-guessed names (experts.switch_glu, transformer.h.N.moe.switch_mlp) pack too:
    # per-expert tensors go beside the switch layer. mlx-lm loads the copy only where its sanitize stacks them.
    src = make_mlx_lm_model(tmp_path / arch, CASES[arch], bits=4)
    whole, tokenizer = load(str(src))
    ids = tokenizer.encode("In the town the market opened early.")
    expected = greedy(whole, tokenizer, ids, 8)
    loadable = arch == "hunyuan"
    out = pack(src, tmp_path / "packed", moe_l2_only=not loadable, progress=False)
    assert out.format == "packed"
    with StreamedLM(out.path, l0_slots=out.top_k + 1, daemon=False) as lm:
        assert greedy(lm.model, lm.tokenizer, ids, 8) == expected
    if loadable:
        assert greedy(*load(str(out.path)), ids, 8) == expected
    else:
        with pytest.raises(PackError, match="would not load with mlx_lm.load"):
            pack(src, tmp_path / "refused", progress=False)
