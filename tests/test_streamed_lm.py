"""Streamed mlx-lm models against ground truth: the same checkpoint loaded whole by mlx-lm."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from moe_l2.lm.streamed_lm import StreamedLM, l0_slots_for
from moe_l2.lm.switch import StreamedSwitch, quantized_sorted
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles

from .conftest import assert_same_as_whole, budget_for, made_and_loaded_whole, stats, wait_for

DIMS = dict(layers=3, experts=16, top_k=4, hidden_size=128, moe_hidden_size=64, seed=5)
ARCHS = {
    "qwen3_moe": dict(arch="qwen3_moe", bits=4),
    "mixtral-per-expert-8bit": dict(arch="mixtral", bits=8, per_expert=True),
    "deepseek_v3": dict(arch="deepseek_v3", bits=4),  # shared experts, a dense first layer
    "gpt_oss": dict(arch="gpt_oss", bits=4),  # expert biases, its own activation
}
TEXT = ("The cache keeps the experts that the router picks most often close to the model, and reads "
        "the others from the file when a token asks for them. ")


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_case(request, tmp_path_factory):
    return made_and_loaded_whole(tmp_path_factory, "archs", request.param, **DIMS, **ARCHS[request.param])


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * (1 + n // 8))
    assert len(ids) >= n
    return ids[:n]


def greedy(model, tokenizer, ids, max_tokens, **kwargs) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens, **kwargs)]


def test_streamed_logits_are_bit_identical(arch_case):
    path, whole, tokenizer = arch_case
    files = ModelFiles.open(path)
    for slots in (files.n_experts, files.top_k + 1):
        with StreamedLM(path, l0_slots=slots, daemon=False) as lm:
            # 1 and 12 tokens: mlx-lm's unsorted kernels; 40 tokens x top 4: its sorted ones.
            for n in (1, 12, 40):
                ids = mx.array(prompt_ids(tokenizer, n))[None]
                assert_same_as_whole(lm.model(ids), whole(ids), chunked=slots < files.n_experts)
            if slots < files.n_experts:
                assert lm.stats.chunked_calls > 0  # batches needed more experts than L0 holds
            assert not any(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in lm.model.named_modules())


def test_greedy_generation_matches_the_whole_model_with_a_tiny_evicting_l0(arch_case):
    path, whole, tokenizer = arch_case
    ids = prompt_ids(tokenizer, 100)
    expected = greedy(whole, tokenizer, ids, 16, prefill_step_size=32)
    with StreamedLM(path, l0_slots=ModelFiles.open(path).top_k + 1, daemon=False) as lm:
        assert greedy(lm.model, lm.tokenizer, ids, 16, prefill_step_size=32) == expected
        files = lm.files
        assert lm.pool.counts.l3_reads > 2 * files.n_layers * files.n_experts  # evicted and re-read all along


def test_with_every_expert_resident_decode_skips_the_routing_sync(model_dir, model_files):
    whole, tokenizer = load(str(model_dir))
    ids = prompt_ids(tokenizer, 20)
    expected = greedy(whole, tokenizer, ids, 12)
    with StreamedLM(model_dir, l0_slots=model_files.n_experts, daemon=False) as lm:
        for layer in range(model_files.n_layers):
            lm.pool.fetch(layer, list(range(model_files.n_experts)))
        hits = lm.pool.counts.l0_hits
        assert greedy(lm.model, lm.tokenizer, ids, 12) == expected
        # mlx-lm prefills all but the last prompt token in one forward, which syncs (it may need many
        # experts); the one-token forwards (the last prompt token, then each generated token) do not.
        assert lm.stats.resident_calls == 13 * model_files.n_layers
        assert lm.stats.calls == lm.stats.resident_calls + model_files.n_layers
        assert lm.pool.counts.l0_hits - hits >= 13 * model_files.n_layers * model_files.top_k
        assert lm.pool.counts.l3_reads == model_files.n_layers * model_files.n_experts  # the initial fill only


@pytest.fixture(scope="module")
def switch_mlp_model(tmp_path_factory, model_dir):
    """nemotron_h (SwitchMLP experts with ReLU2, a Mamba layer): not one of make-model's archs yet, so built
    here the way make-model builds its checkpoints, with model_dir's tokenizer."""
    import shutil

    from mlx.utils import tree_unflatten
    from mlx_lm.models import nemotron_h

    out = tmp_path_factory.mktemp("switch-mlp") / "nemotron_h"
    out.mkdir()
    config = dict(model_type="nemotron_h", vocab_size=512, hidden_size=128, intermediate_size=256,
                  max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  attention_bias=False, mamba_num_heads=4, mamba_head_dim=32, mamba_proj_bias=False,
                  ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                  use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "E", "*", "E"],
                  moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1,
                  n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, norm_topk_prob=True,
                  routed_scaling_factor=1.0, quantization={"group_size": 64, "bits": 4},
                  eos_token_id=json.loads((model_dir / "config.json").read_text())["eos_token_id"])
    mx.random.seed(0)
    model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(config))
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.02) for k, v in tree_flatten(model.parameters())
                                 if k.endswith("gate.weight")]))  # zeros would route every token alike
    model.set_dtype(mx.float16)
    nn.quantize(model, 64, 4, class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(model_dir / name, out / name)
    return out


def test_switch_mlp_models_stream_too(switch_mlp_model):
    whole, tokenizer = load(str(switch_mlp_model))
    ids = prompt_ids(tokenizer, 24)
    expected = greedy(whole, tokenizer, ids, 8)
    with StreamedLM(switch_mlp_model, l0_slots=5, daemon=False) as lm:
        assert [s.glu for s in lm.switches] == [False, False]
        ids_2d = mx.array(ids)[None]
        assert_same_as_whole(lm.model(ids_2d), whole(ids_2d), chunked=True)
        assert greedy(lm.model, lm.tokenizer, ids, 8) == expected
        assert lm.stats.chunked_calls > 0


def test_a_pack_that_only_moe_l2_can_load_streams_exactly(model_dir, model_files, tmp_path):
    """mlx-lm's qwen3_moe sanitize stacks only unquantized per-expert weights, so mlx_lm.load refuses this
    packed 4-bit checkpoint; the streamed loader never hands expert tensors to sanitize and loads it."""
    from moe_l2.model.packer import pack

    packed = pack(model_dir, tmp_path / "packed", moe_l2_only=True, progress=False)
    assert packed.format == "packed"
    with pytest.raises(ValueError, match="parameters not in model"):
        load(str(packed.path))
    whole, tokenizer = load(str(model_dir))
    ids = prompt_ids(tokenizer, 70)
    expected = greedy(whole, tokenizer, ids, 12)
    with StreamedLM(packed.path, l0_slots=model_files.top_k + 1, daemon=False) as lm:
        batch = mx.array(ids)[None]
        assert_same_as_whole(lm.model(batch), whole(batch), chunked=True)
        assert greedy(lm.model, lm.tokenizer, ids, 12) == expected


def test_expert_tensors_are_never_loaded(model_dir, model_files):
    with StreamedLM(model_dir, l0_slots=4, daemon=False) as lm:
        names = {k for k, _ in tree_flatten(lm.model.parameters())}
        assert len(lm.switches) == model_files.n_layers
        assert all(isinstance(s, StreamedSwitch) and not tree_flatten(s.parameters()) for s in lm.switches)
    checkpoint = set()
    for f in model_files.files:
        checkpoint |= set(mx.load(str(f)))  # lazy: names and shapes only
    assert names == checkpoint - model_files.expert_tensor_names()


def test_forwards_evaluated_late_still_read_their_own_experts(model_dir, model_files):
    """A graph built, not evaluated, then another forward evicting its rows: the pool must not serve it
    rows refilled under it."""
    whole, tokenizer = load(str(model_dir))
    a = mx.array(prompt_ids(tokenizer, 30))[None]
    b = mx.array(prompt_ids(tokenizer, 45)[15:])[None]
    with StreamedLM(model_dir, l0_slots=model_files.top_k, daemon=False) as lm:
        out_a = lm.model(a)
        out_b = lm.model(b)
        mx.eval(out_a, out_b)
        assert_same_as_whole(out_a, whole(a), chunked=True)
        assert_same_as_whole(out_b, whole(b), chunked=True)


def test_pinned_experts_leave_fewer_rows_and_outputs_stay_exact(model_dir, model_files):
    whole, tokenizer = load(str(model_dir))
    ids = prompt_ids(tokenizer, 70)
    expected = greedy(whole, tokenizer, ids, 12)
    with StreamedLM(model_dir, l0_slots=model_files.top_k + 2, daemon=False) as lm:
        for layer in range(model_files.n_layers):
            lm.pool.pin(layer, [0, 1])
        assert greedy(lm.model, lm.tokenizer, ids, 12) == expected
        assert lm.stats.chunked_calls > 0
        for layer in range(model_files.n_layers):
            assert lm.pool.layers[layer].pins() == {0, 1}
            assert lm.pool.layers[layer].holds(0) and lm.pool.layers[layer].holds(1)


def test_cold_then_warm_daemon_gives_the_same_tokens(running_daemon, model_dir, model_files):
    whole, tokenizer = load(str(model_dir))
    ids = prompt_ids(tokenizer, 50)
    expected = greedy(whole, tokenizer, ids, 16)
    runs = []
    for _ in range(2):
        with StreamedLM(model_dir, l0_slots=model_files.top_k + 1, socket=running_daemon.socket,
                        client_wait_s=5) as lm:
            assert lm.client.attached
            assert greedy(lm.model, lm.tokenizer, ids, 16) == expected
            runs.append(lm.pool.counts)
        wait_for(lambda: stats(running_daemon)["daemon"]["loads_in_flight"] == 0, what="loads")
    assert runs[0].l3_reads > 0
    assert runs[1].l2_hits > 0


def test_daemon_killed_mid_generation(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    whole, tokenizer = load(str(model_dir))
    ids = prompt_ids(tokenizer, 40)
    expected = greedy(whole, tokenizer, ids, 30)
    try:
        with StreamedLM(model_dir, l0_slots=model_files.top_k + 1, socket=daemon.socket, client_wait_s=5) as lm:
            assert greedy(lm.model, lm.tokenizer, ids, 30) == expected  # warms L2
        wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="loads")
        with StreamedLM(model_dir, l0_slots=model_files.top_k + 1, socket=daemon.socket, client_wait_s=5) as lm:
            got = []
            for response in stream_generate(lm.model, lm.tokenizer, mx.array(ids), max_tokens=30):
                got.append(response.token)
                if len(got) == 10:
                    assert lm.pool.counts.l2_hits > 0
                    reads = lm.pool.counts.l3_reads
                    daemon.kill9()
                    wait_for(lambda: not lm.client.attached, what="the client to notice")
            assert got == expected
            assert lm.pool.counts.l3_reads > reads  # served from the file after the daemon died
    finally:
        daemon.unlink_leftovers()  # a SIGKILLed daemon leaves its segments


class RouterSpy(nn.Module):
    """Wraps a whole model's switch layer to see what the router picked (the computation is the real one)."""

    def __init__(self, inner, layer, log):
        super().__init__()
        self.inner = inner
        self.layer = layer
        self.log = log

    def __call__(self, x, indices):
        self.log.append((self.layer, np.array(indices).reshape(-1, indices.shape[-1])))
        return self.inner(x, indices)


def test_recorded_routing_is_the_routers_choice(model_dir, model_files):
    whole, tokenizer = load(str(model_dir))
    log = []
    for i, layer in enumerate(model_files.layer_ids):
        block = whole.model.layers[layer].mlp
        block.switch_mlp = RouterSpy(block.switch_mlp, i, log)
    ids = prompt_ids(tokenizer, 20)
    expected_tokens = greedy(whole, tokenizer, ids, 8)
    expected = []
    for layer, chosen in log:
        if layer == 0:
            expected.extend([None] * model_files.n_layers for _ in range(len(chosen)))
        for entry, row in zip(expected[-len(chosen):], chosen.tolist()):
            entry[layer] = row
    with StreamedLM(model_dir, l0_slots=model_files.top_k, daemon=False, record=True) as lm:
        assert greedy(lm.model, lm.tokenizer, ids, 8) == expected_tokens
        assert lm.recorder.take() == expected
    assert len(expected) == len(ids) + len(expected_tokens)


def test_l0_size_from_slots_or_budget(model_files):
    per_slot = model_files.n_layers * model_files.layout.stride
    assert l0_slots_for(model_files, slots=6) == 6
    assert l0_slots_for(model_files, slots=1000) == model_files.n_experts
    assert l0_slots_for(model_files, budget=str(5 * per_slot + 1)) == 5
    assert l0_slots_for(model_files) == max(2 * model_files.top_k, model_files.n_experts // 4)
    with pytest.raises(ValueError, match="at least 4 slots"):
        l0_slots_for(model_files, slots=3)
    with pytest.raises(ValueError, match="a token needs 4"):
        l0_slots_for(model_files, budget=str(3 * per_slot))
    with pytest.raises(ValueError, match="not both"):
        l0_slots_for(model_files, slots=4, budget="1G")


MEMORY_PROBE = r"""
import json, sys
import psutil
from moe_l2.lm.streamed_lm import StreamedLM, peak_rss_bytes
from moe_l2.lm.generation import encode_prompt, generate_streamed
from mlx_lm import load
import mlx.core as mx
from mlx_lm.generate import stream_generate

path, mode = sys.argv[1], sys.argv[2]
# The baseline is taken with the default device up: on a Mac, Metal's start-up (device, queues, the kernel
# library) alone is tens of MiB, which would otherwise count against the working-set allowance below.
mx.eval(mx.ones((16, 16)) @ mx.ones((16, 16)))
mx.synchronize()
base = psutil.Process().memory_info().rss
text = "Tell me everything about caches, experts and memory. " * 4
if mode == "streamed":
    with StreamedLM(path, l0_slots=8, daemon=False) as lm:
        r = generate_streamed(lm, encode_prompt(lm.tokenizer, text, False), 16)
        extra = {"pool_bytes": lm.pool.nbytes, "l3_reads": r.counts.l3_reads, "tokens": r.tokens}
else:
    model, tokenizer = load(path)
    ids = encode_prompt(tokenizer, text, False)
    extra = {"tokens": [x.token for x in stream_generate(model, tokenizer, mx.array(ids), max_tokens=16)]}
print(json.dumps({"base": base, "peak": peak_rss_bytes(), **extra}))
"""


@pytest.fixture(scope="module")
def big_experts_model(tmp_path_factory):
    """Experts ~225 MB, everything else ~1 MB; narrow, so that the CPU computes it quickly."""
    out = tmp_path_factory.mktemp("memory") / "qwen3-many-experts"
    make_model(out, arch="qwen3_moe", layers=4, experts=1024, top_k=2, hidden_size=128, moe_hidden_size=256,
               bits=4, seed=2)
    return ModelFiles.open(out)


def probe(path, mode) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", MEMORY_PROBE, str(path), mode], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_is_non_expert_weights_plus_l0_not_the_model(big_experts_model):
    files = big_experts_model
    expert_bytes = files.n_layers * files.n_experts * files.layout.nbytes
    other_bytes = sum(f.stat().st_size for f in files.files) - expert_bytes
    streamed = probe(files.path, "streamed")
    whole = probe(files.path, "whole")
    assert streamed["tokens"] == whole["tokens"]
    assert streamed["l3_reads"] > 4 * 8 * files.n_layers  # experts flowed through the 8-slot L0
    grown = streamed["peak"] - streamed["base"]
    working_set = 32 << 20  # activations, MLX's buffer cache, the tokenizer
    assert grown < other_bytes + streamed["pool_bytes"] + working_set, (grown, other_bytes, streamed["pool_bytes"])
    assert expert_bytes > 5 * (other_bytes + streamed["pool_bytes"] + working_set)  # the bound means something
    assert whole["peak"] - whole["base"] > expert_bytes  # and the probe sees a model loaded whole


def _metal_gather_qmm_kernel(pairs: int, weight_rows: int, sorted_indices: bool) -> str:
    """MLX 0.32's Metal dispatch of a one-row-per-pair gather_qmm (GatherQMM::eval_gpu): the batched rhs kernel
    needs sorted indices, 16 pairs and 4 pairs per row of the weight array; otherwise the vector kernel."""
    return "rhs" if sorted_indices and pairs >= 16 and pairs // weight_rows >= 4 else "qmv"


def test_the_pool_asks_for_the_quantized_kernel_the_whole_model_gets():
    for n_experts in (8, 32, 128):
        for capacity in sorted({1, 2, n_experts // 4, n_experts // 2, n_experts - 1, n_experts}):
            for pairs in range(1, 10 * n_experts):
                do_sort = pairs >= 64
                whole = _metal_gather_qmm_kernel(pairs, n_experts, do_sort)
                pool = _metal_gather_qmm_kernel(pairs, capacity, quantized_sorted(pairs, n_experts, do_sort))
                assert pool == whole, (n_experts, capacity, pairs)
    # mlx-lm's own flag on the pool's smaller array would pick another kernel: the reason for quantized_sorted.
    assert _metal_gather_qmm_kernel(64, 8, True) != _metal_gather_qmm_kernel(64, 32, True)


def _fp16_gather_mm_error() -> str | None:
    try:
        mx.eval(mx.gather_mm(mx.zeros((1, 1, 2), mx.float16), mx.zeros((1, 2, 2), mx.float16),
                             rhs_indices=mx.array([0], dtype=mx.uint32)))
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.skipif(_fp16_gather_mm_error() is None, reason="MLX computes float16 experts on this device")
def test_experts_mlx_cannot_compute_here_are_refused_at_load_saying_what_to_do(tmp_path):
    """Where MLX's gather_mm has no kernel for the experts' dtype (its CPU kernels: float32 only), mlx-lm fails in
    the first forward; StreamedLM refuses at load, saying why and what to do."""
    model = make_model(tmp_path / "fp16", arch="qwen3_moe", **{**DIMS, "layers": 2}, bits=16)
    whole, tokenizer = load(str(model))
    with pytest.raises(RuntimeError, match="float32"):
        greedy(whole, tokenizer, [1, 2, 3], 1)
    with pytest.raises(ValueError, match=r"unquantized float16 experts on the [CG]PU .*quantize it \(mlx_lm.convert "
                                         r"-q\) or run it where MLX computes float16"):
        StreamedLM(model, daemon=False)
