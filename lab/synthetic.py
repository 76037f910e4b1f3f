"""Real MoE geometries as packed model directories of random bytes, for `moe-l2 bench` (docs/architecture.md,
"The bench").

A geometry is what a real checkpoint's routed experts look like on disk: per MoE layer `n_experts` records of
the real shapes, dtypes and byte sizes (gpt-oss's MXFP4 as its checkpoint ships it, 4-bit affine in groups of
64 for the others, as mlx-community's conversions). `build` writes such a model straight to disk, one shard per
MoE layer, every record one page-aligned extent with its pieces at their record offsets: what `moe-l2 pack`
writes (docs/formats.md, "Packed checkpoints"), so `ModelFiles.open` takes it as format "packed". The data is
random bytes written as they are made (no quantization of gigabytes); the non-expert weights are left out,
since a benchmark of expert streaming never reads them. mlx_lm.load cannot load the result. Like every packed
model it has a checksum manifest, so that its records are checked where they are read, as a user's are.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from moe_l2.lab.bench import drop_page_cache
from moe_l2.model import ModelFiles
from moe_l2.model.architecture import switch_layers
from moe_l2.model.checksums import manifest_of, write_manifest
from moe_l2.model.records import PACK_ALIGN, RecordLayout
from moe_l2.model.safetensors import DTYPES
from moe_l2.sizes import format_size

__all__ = ["GEOMETRIES", "ExpertGeometry", "build", "model_dir", "SyntheticError"]

_CODE = {mlx: code for code, (mlx, _) in DTYPES.items()}
_SIZE = {mlx: size for mlx, size in DTYPES.values()}
_CHUNK = 32 << 20  # random bytes made and written at a time


class SyntheticError(ValueError):
    """A geometry that cannot be built here; the message says what to do."""


def _mxfp4(rows: int, cols: int) -> list[tuple[str, tuple[int, ...], str]]:
    # MLX's mxfp4: 8 e2m1 codes per uint32, one e8m0 scale byte per 32 weights; gpt-oss projections have a bias.
    return [("weight", (rows, cols // 8), "uint32"), ("scales", (rows, cols // 32), "uint8"),
            ("bias", (rows,), "bfloat16")]


def _affine4(rows: int, cols: int) -> list[tuple[str, tuple[int, ...], str]]:
    # MLX's 4-bit affine quantization in groups of 64: 8 weights per uint32, a scale and a bias per group.
    return [("weight", (rows, cols // 8), "uint32"), ("scales", (rows, cols // 64), "bfloat16"),
            ("biases", (rows, cols // 64), "bfloat16")]


@dataclass(frozen=True)
class ExpertGeometry:
    """A model's routed experts: the mlx-lm config that builds it and each projection's pieces."""

    name: str
    config: dict  # config.json for every layer the model has; `build` cuts num_hidden_layers
    n_moe_layers: int
    first_dense: int  # leading decoder layers without routed experts
    quantize: object  # (rows, cols) -> [(param, shape, dtype)]
    hidden: int
    moe_hidden: int
    source: str  # where the figures come from

    @property
    def n_experts(self) -> int:
        return self.config.get("num_local_experts") or self.config.get("n_routed_experts") or self.config["num_experts"]

    @property
    def top_k(self) -> int:
        return self.config["num_experts_per_tok"]

    def pieces(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """(key, shape, dtype, nbytes) of one expert's record, as RecordLayout.build takes them."""
        specs = []
        for proj, rows, cols in (("gate_proj", self.moe_hidden, self.hidden), ("up_proj", self.moe_hidden, self.hidden),
                                 ("down_proj", self.hidden, self.moe_hidden)):
            for param, shape, dtype in self.quantize(rows, cols):
                n = _SIZE[dtype]
                for d in shape:
                    n *= d
                specs.append((f"{proj}.{param}", shape, dtype, n))
        return specs

    def layout(self) -> RecordLayout:
        return RecordLayout.build(self.pieces(), "packed")

    def expert_bytes(self, layers: int | None = None) -> int:
        """Bytes of every routed expert's record in the first `layers` MoE layers (all by default)."""
        return (layers or self.n_moe_layers) * self.n_experts * self.layout().nbytes

    def file_bytes(self, layers: int) -> int:
        """About what `build` writes: the page-aligned records and a header page per layer."""
        return layers * (self.n_experts * self.layout().span + 2 * PACK_ALIGN)

    def config_for(self, layers: int) -> dict:
        config = dict(self.config, num_hidden_layers=self.first_dense + layers)
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:self.first_dense + layers]
        return config


# From each model's config.json on Hugging Face; the expert dtypes as the checkpoints named in `source` ship them.
GEOMETRIES: dict[str, ExpertGeometry] = {
    "gpt-oss-20b": ExpertGeometry(
        "gpt-oss-20b",
        dict(model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
             vocab_size=201088, rms_norm_eps=1e-5, hidden_size=2880, intermediate_size=2880, head_dim=64,
             num_attention_heads=64, num_key_value_heads=8, sliding_window=128, rope_theta=150000,
             layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(24)],
             quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"}),
        24, 0, _mxfp4, 2880, 2880, "openai/gpt-oss-20b (MXFP4 experts)"),
    "deepseek-v2-lite": ExpertGeometry(
        "deepseek-v2-lite",
        dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
             n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512,
             q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy",
             n_group=1, topk_group=1, num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1,
             max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, attention_bias=False,
             rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
             quantization={"group_size": 64, "bits": 4}),
        26, 1, _affine4, 2048, 1408, "deepseek-ai/DeepSeek-V2-Lite (mlx-community 4-bit, group 64)"),
    "qwen3-30b-a3b": ExpertGeometry(
        "qwen3-30b-a3b",
        dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
             decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768, rms_norm_eps=1e-6,
             vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=40960,
             norm_topk_prob=True, quantization={"group_size": 64, "bits": 4}),
        48, 0, _affine4, 2048, 768, "Qwen/Qwen3-30B-A3B (mlx-community 4-bit, group 64)"),
}


def model_dir(cache: Path, geometry: ExpertGeometry, layers: int) -> Path:
    """Where `build` puts (and finds) the model of these layers."""
    return Path(cache) / f"{geometry.name}-{layers}layers"


def _header(tensors: dict) -> bytes:
    body = json.dumps({"__metadata__": {"moe_l2": "packed-v1", "synthetic": "random bytes"}, **tensors},
                      separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % PACK_ALIGN)  # the data starts on a page
    return len(body).to_bytes(8, "little") + body


def _write_random(f, nbytes: int, rng: random.Random) -> None:
    while nbytes > 0:
        n = min(_CHUNK, nbytes)
        f.write(rng.randbytes(n))
        nbytes -= n


def build(geometry: ExpertGeometry, layers: int, cache: Path, *, seed: int = 0, say=lambda _msg: None) -> Path:
    """The model directory of the geometry's first `layers` MoE layers under `cache`: reused when complete
    (config.json is written last), else written. SyntheticError when the disk has no room for it."""
    if not 1 <= layers <= geometry.n_moe_layers:
        raise SyntheticError(f"{geometry.name} has {geometry.n_moe_layers} MoE layers; --layers must be "
                             f"1..{geometry.n_moe_layers}, not {layers}")
    out = model_dir(cache, geometry, layers)
    if (out / "config.json").exists():
        return _with_manifest(out, say)
    config = geometry.config_for(layers)
    paths = [s.path for s in switch_layers(config)]
    if len(paths) != layers:
        raise SyntheticError(f"mlx-lm builds {len(paths)} switch layers for {geometry.name} cut to {layers}")
    need = geometry.file_bytes(layers)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    free = shutil.disk_usage(partial).free
    if free < need + (1 << 30):
        shutil.rmtree(partial, ignore_errors=True)
        raise SyntheticError(f"{geometry.name} with {layers} MoE layers needs {format_size(need)} at {cache}, and "
                             f"only {format_size(free)} is free (1 GiB is kept spare): free space, pass fewer "
                             "--layers, or point --cache-dir elsewhere")
    say(f"writing {geometry.name}, {layers} MoE layers ({format_size(need)}) to {out}")
    layout = geometry.layout()
    rng = random.Random(seed)
    for i, path in enumerate(paths):
        parent = path.rpartition(".")[0]
        tensors = {}
        for e in range(geometry.n_experts):
            base = e * layout.span
            for p in layout.pieces:
                proj, param = p.key.split(".")
                tensors[f"{parent}.experts.{e}.{proj}.{param}"] = {
                    "dtype": _CODE[p.dtype], "shape": list(p.shape),
                    "data_offsets": [base + p.offset, base + p.offset + p.nbytes]}
        name = partial / f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        with open(name, "wb") as f:
            f.write(_header(tensors))
            _write_random(f, geometry.n_experts * layout.span, rng)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):  # written once, read later: keep it out of the page cache
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    partial.rename(out)
    return _with_manifest(out, say)


def _with_manifest(model: Path, say) -> Path:
    """The model, given the checksum manifest `moe-l2 pack` gives every packed model where it has no current one (one
    built before it had them): without one, no reader checks a record and the bench measures a path no packed model
    takes. Its records are read for it, then dropped from the page cache again, as the build leaves them."""
    files = ModelFiles.open(model)
    if files.checksums is not None:
        return model
    say(f"writing the checksum manifest of {model}")
    try:
        write_manifest(manifest_of(files))
    except OSError as exc:
        say(f"cannot write the checksum manifest of {model} ({exc}): its records go unchecked; give a --cache-dir "
            "this user can write to")
    drop_page_cache(files)
    return model
