"""Run an mlx-lm MoE model with its routed experts streamed through the L0 pool.

The model is built by mlx-lm's own loader (mx.load is lazy: it reads headers only), with the routed-expert
tensors taken out of the weights before the architecture's sanitize sees them, and shape-only stand-ins
(lazy zeros shaped like the stacked switch parameters, from the record layout) put back after it, so that
mlx-lm's own quantization rules and strict loading decide every module. Each SwitchGLU / SwitchMLP is then
swapped for a StreamedSwitch (moe_l2.lm.switch) and the stand-ins are dropped unevaluated: no expert byte
is read here. This also loads checkpoints whose per-expert tensors mlx-lm's sanitize would not stack
(`moe-l2 pack --moe-l2-only`). `StreamedLM` puts the model, its tokenizer, the pool and the daemon link
together; `load` gives its model and tokenizer as mlx_lm.load does, and `close` and `stats` reach the rest
through the model.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, load_tokenizer
from mlx_lm.utils import load_model as _mlx_lm_load_model

from moe_l2.cache.trace import read_traces
from moe_l2.client.connection import L2Client
from moe_l2.lm.nextlayer import NextLayer, find_router
from moe_l2.client.options import StreamOptions
from moe_l2.client.pool import ExpertPool
from moe_l2.client.prefetcher import side_rows
from moe_l2.lm.switch import ForwardState, RoutingRecorder, StreamedSwitch, StreamStats
from moe_l2.model import ModelFiles
from moe_l2.model.architecture import decoder_layer, set_module
from moe_l2.model.location import resolve_model
from moe_l2.plan import ModelSizes, plan, read_memory
from moe_l2.sizes import format_size, parse_size
from moe_l2.tiers import source_shares

__all__ = ["load", "close", "stats", "streamed", "ExpertStats", "StreamedLM", "stream_experts", "load_model",
           "pipeline_models", "pipeline_stage", "l0_slots_for", "peak_rss_bytes", "hit_rates"]


def _switch_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]


def _check_layout(path: str, module: nn.Module, files: ModelFiles) -> None:
    """The pool rows must hold exactly what mlx-lm would have put in this module's parameters."""
    params = {k: v for k, v in tree_flatten(module.parameters()) if not k.startswith("activation.")}
    layout = {p.key: p for p in files.layout.pieces}
    problems = []
    for key, value in params.items():
        piece = layout.get(key)
        if piece is None:
            problems.append(f"{key} is not in the expert records")
        elif tuple(value.shape[1:]) != piece.shape or getattr(mx, piece.dtype) != value.dtype:
            problems.append(f"{key}: the model wants {value.dtype} {list(value.shape[1:])} per expert, "
                            f"the checkpoint holds {piece.dtype} {list(piece.shape)}")
    problems += [f"the records hold {key}, which the model does not use" for key in layout.keys() - params.keys()]
    if problems:
        raise ValueError(f"{files.path}: cannot stream {path} from this checkpoint's bytes ({'; '.join(problems)}); "
                         "the checkpoint stores its experts in a form mlx-lm converts at load time: convert "
                         "the model with mlx_lm.convert first")


def _switch_layers(model: nn.Module, files: ModelFiles, layers=None) -> list[tuple[str, nn.Module, int]]:
    """(module path, SwitchGLU / SwitchMLP, MoE layer) for every switch module, in MoE layer order; `layers`:
    the MoE layers the model runs (a pipeline stage's), None for all."""
    layers = range(files.n_layers) if layers is None else sorted(layers)
    found = _switch_modules(model)
    if not found:
        raise ValueError(f"{files.path}: the {files.model_type} model has no SwitchGLU / SwitchMLP to stream")
    layer_of = {lid: i for i, lid in enumerate(files.layer_ids)}
    out: dict[int, tuple[str, nn.Module, int]] = {}
    for path, module in found:
        layer = layer_of.get(decoder_layer(path))
        if layer is None or layer in out:
            raise ValueError(f"{files.path}: {path} matches no single MoE layer of the checkpoint "
                             f"(its expert tensors are in layers {files.layer_ids})")
        out[layer] = (path, module, layer)
    missing = sorted(set(layers) - out.keys())
    if missing:
        raise ValueError(f"{files.path}: the checkpoint has experts for layers "
                         f"{[files.layer_ids[i] for i in missing]}, which the model does not route")
    return [out[i] for i in layers]


def _stand_ins(model: nn.Module, files: ModelFiles) -> dict[str, mx.array]:
    """Lazy zeros named and shaped like the stacked switch parameters; never evaluated."""
    return {f"{path}.{p.key}": mx.zeros((files.n_experts, *p.shape), dtype=getattr(mx, p.dtype))
            for path, _, _ in _switch_layers(model, files) for p in files.layout.pieces}


def stream_experts(model: nn.Module, pool: ExpertPool, stats: StreamStats | None = None,
                   recorder: RoutingRecorder | None = None, prefetch: str = "off",
                   prefetch_seed=None) -> list[StreamedSwitch]:
    """Swap every SwitchGLU / SwitchMLP of a (lazily loaded) model for a StreamedSwitch over `pool`.

    prefetch: next-layer prefetch, one of moe_l2.cache.prefetch.PREFETCH (the switches share one NextLayer);
    prefetch_seed: a TraceSet its learned predictors start from (NextLayer `seed`).
    The model must run exactly the pool's layers. The replaced modules' arrays are dropped unevaluated.
    Returns the new modules, MoE layer order."""
    files = pool.files
    found = _switch_layers(model, files, pool.layers.keys())
    next_layer = None
    if prefetch != "off":
        routers = {layer: find_router(model, path, files.n_experts) for path, _, layer in found}
        next_layer = NextLayer(prefetch, pool, routers, prefetch_seed)
    forward = ForwardState(pool, stats if stats is not None else StreamStats(), recorder, next_layer)
    switches = []
    for path, module, layer in found:
        _check_layout(path, module, files)
        switches.append(StreamedSwitch(module, forward, layer))
    for (path, _, _), switch in zip(found, switches):
        set_module(model, path, switch)
    return switches


def load_model(path, files: ModelFiles, *, model_config: dict | None = None,
               group: mx.distributed.Group | None = None) -> tuple[nn.Module, dict, list[int]]:
    """mlx_lm.utils.load_model, lazily and with the routed experts left out (stand-ins that are never read);
    with a `group` of several ranks, only this rank's pipeline stage is kept, as mlx_lm.utils.sharded_load
    does (docs/distributed.md). Returns the model, its config and the MoE layers it runs."""
    expert_names = files.expert_tensor_names()

    def classes(config):
        model_class, args_class = _get_classes(config)

        class WithoutExperts(model_class, StreamedModel):
            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items() if k not in expert_names}
                if hasattr(model_class, "sanitize"):
                    weights = super().sanitize(weights)
                weights.update(_stand_ins(self, files))
                return weights

        WithoutExperts.__name__ = WithoutExperts.__qualname__ = model_class.__name__
        return WithoutExperts, args_class

    model, config = _mlx_lm_load_model(Path(path), lazy=True, model_config=model_config, get_model_classes=classes)
    if group is None or group.size() == 1:
        return model, config, list(range(files.n_layers))
    return model, config, pipeline_stage(model, files, group)


def pipeline_models() -> list[str]:
    """The MoE model types of the installed mlx-lm that implement pipeline parallelism: their module uses
    PipelineMixin and switch layers or a sparse MoE block (a module that wraps one of them, such as
    qwen3_5_moe, is not listed)."""
    import mlx_lm.models

    folder = Path(mlx_lm.models.__path__[0])
    return sorted(f.stem for f in folder.glob("*.py")
                  if "PipelineMixin" in (text := f.read_text(encoding="utf-8"))
                  and ("switch_layers" in text or "SparseMoe" in text))


def pipeline_stage(model: nn.Module, files: ModelFiles, group: mx.distributed.Group) -> list[int]:
    """Cut a lazily loaded model down to this rank's stage with mlx-lm's own split (rank 0 runs the last
    decoder layers); returns the MoE layers the stage runs."""
    inner = getattr(model, "model", None)
    if not hasattr(inner, "pipeline"):
        raise ValueError(f"{files.path}: mlx-lm has no pipeline parallelism for the {files.model_type} model, so "
                         f"it cannot be split over {group.size()} ranks; the MoE models it pipelines: "
                         f"{', '.join(pipeline_models())} (and models built on them). Run this model in one "
                         "process (without mlx.launch)")
    inner.pipeline(group)
    start, end = inner.start_idx, inner.end_idx
    layers = [i for i, decoder in enumerate(files.layer_ids) if start <= decoder < end]
    if not layers:
        raise ValueError(f"{files.path}: rank {group.rank()} runs decoder layers {start}..{end - 1}, which have "
                         f"no routed experts; run on fewer ranks")
    return layers


def l0_slots_for(files: ModelFiles, slots: int | None = None, budget: int | str | None = None,
                 n_layers: int | None = None, shared: bool = False, side: int = 0, beside_l2: bool = False) -> int:
    """L0 experts per layer (shared: in all, rows any of the process' `n_layers` MoE layers takes): `slots`, or
    as many as `budget` bytes buy beside `side` side rows (next-layer prefetch's, laid out as the slots: the
    budget is a hard ceiling on both), or the plan's for this machine's memory (moe_l2.plan), less the side
    rows: beside_l2 (shared, and a daemon answered at load), top_k rows in all and what L2 leaves unused
    (moe_l2.plan.shared_l0_rows); else a quarter of the experts, at least twice the experts per token, fewer when
    memory is short (in all, that many per layer). At least top_k: a token needs them all. Given as `slots`, the
    side rows come on top (ExpertPool.ceiling_bytes counts both)."""
    n_layers = n_layers or files.n_layers
    where = "in all" if shared else "per layer"
    if slots is not None and budget is not None:
        raise ValueError("give the L0 size as slots or as a budget, not both")
    if budget is not None:
        per_slot = files.layout.stride * (1 if shared else n_layers)
        slots = parse_size(budget) // per_slot - side
        if slots < files.top_k:
            beside = f" beside {side} side rows {where} for prefetch" if side else ""
            raise ValueError(f"an L0 budget of {format_size(parse_size(budget))} buys {slots} experts {where}"
                             f"{beside}; a token needs {files.top_k}: give at least "
                             f"{format_size((files.top_k + side) * per_slot)}")
    elif slots is None:
        planned = plan(read_memory(), ModelSizes.of(files), shared_l0=shared and beside_l2).l0_slots
        slots = max(files.top_k, planned * (n_layers if shared and not beside_l2 else 1) - side)
    elif slots < files.top_k:
        raise ValueError(f"L0 needs at least {files.top_k} slots {where} (the experts of one token), got {slots}")
    return min(slots, files.n_experts * (n_layers if shared else 1))


def peak_rss_bytes() -> int:
    """This process' peak resident memory."""
    try:
        # Linux: the peak of this process image. ru_maxrss would also count the parent that forked it.
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class StreamedModel:
    """What a streamed model adds to its mlx-lm class: `with model:` closes its stream (see `close`)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        close(self)


class StreamedLM:
    """A streamed model with its tokenizer, pool and daemon link; a context manager that closes them."""

    def __init__(self, path, options: StreamOptions | None = None, *, model_config: dict | None = None,
                 tokenizer_config: dict | None = None, download: bool = False, record: bool = False,
                 group: mx.distributed.Group | None = None, **fields):
        """options: how the experts are streamed (client/options.py), with `fields` replaced: StreamOptions'
        fields by name (a name that is none is refused with the list).
        download: fetch a Hugging Face repo id that is not in the local cache, as mlx-lm does.
        record: keep the routing of every token (`recorder`, for a trace).
        group: the mlx.distributed group to run a pipeline stage in (several ranks: this rank's layers
        only, docs/distributed.md); None or one rank: the whole model."""
        self.options = options = StreamOptions.of(options, **fields)
        seed = read_traces(options.prefetch_from) if options.prefetch_from is not None else None
        # A directory or a Hugging Face repo id.
        path = resolve_model(path, download)
        self.files = ModelFiles.open(path)
        self.stats = StreamStats()
        self.model, self.config, layers = load_model(path, self.files, model_config=model_config, group=group)
        self.recorder = RoutingRecorder(self.files.n_layers) if record else None
        # A pipeline stage tells its daemon which layers it streams (moe-l2d --layers serves a host's stages).
        stage = layers if len(layers) < self.files.n_layers else None
        self.client = (L2Client(self.files, options.socket, wait_s=options.client_wait_s, layers=stage)
                       if options.daemon else None)
        shared = options.l0_shared
        prefetch = options.prefetch != "off"
        side = side_rows(self.files.top_k) if prefetch else 0
        try:
            # Sized for what answered at load: a daemon that comes later leaves this L0 as it was.
            slots = l0_slots_for(self.files, options.l0_slots, options.l0_budget, len(layers), shared, side,
                                 beside_l2=self.client is not None and self.client.attached)
            self.pool = ExpertPool(self.files, options.l0_capacity(self.files, layers, slots),
                                   self.client, policy=options.policy, direct=options.direct,
                                   verify=options.verify, layers=layers, lend=options.lend, shared_l0=shared,
                                   load_through_s=options.load_through_s, grow=options.l0_grow, prefetch=prefetch,
                                   autopin=options.l0_autopin, fill_l2=options.fill_l2)
            try:
                self.switches = stream_experts(self.model, self.pool, self.stats, self.recorder, options.prefetch,
                                               seed)
                mx.eval(self.model.parameters())
                self.tokenizer = load_tokenizer(Path(path), tokenizer_config,
                                                eos_token_ids=self.config.get("eos_token_id"))
            except BaseException:
                self.pool.close()
                raise
        except BaseException:
            if self.client is not None:
                self.client.close()
            raise
        self.closed = False
        # Plain attribute (not an array, list or dict): mlx's Module keeps it out of parameters() and children.
        self.model._streamed_lm = self

    @property
    def next_layer(self) -> NextLayer | None:
        """The next-layer prefetcher, or None when prefetch is off."""
        return self.switches[0].next_layer

    def __enter__(self) -> "StreamedLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the prefetch worker, close the model files and the daemon link (its thread); once."""
        if self.closed:
            return
        self.closed = True
        self.pool.close()
        if self.client is not None:
            self.client.close()


@dataclass(frozen=True)
class ExpertStats:
    """Where a streamed model's expert lookups got their bytes so far (each expert a layer's batch needs is one
    lookup): lookups == l0_hits + l2_hits + daemon_reads + disk_reads (TierCounts.by_source)."""

    lookups: int
    l0_hits: int        # in this process' rows
    l2_hits: int        # held in moe-l2d's shared memory when looked up
    daemon_reads: int   # read from the model files by moe-l2d while the lookup waited (load-through)
    disk_reads: int     # read from the model files by this process
    l2_lent: int        # of l2_hits and daemon_reads, computed on in place in L2, not copied
    bytes_read: int     # from the model files
    bytes_copied: int   # from L2
    torn_layers: int    # layers computed again because the daemon replaced an expert they computed on
    daemon: str | None  # the address of the moe-l2d this process is attached to now; None: none


def load(path_or_repo_id, *, tokenizer_config: dict | None = None, model_config: dict | None = None,
         **options) -> tuple[nn.Module, object]:
    """(model, tokenizer) as mlx_lm.load gives them, with the routed experts streamed: the model runs unchanged
    under mlx_lm.generate, stream_generate and batch_generate, and gives the tokens of the model loaded whole.

    path_or_repo_id: a model directory or a Hugging Face repo id (downloaded when not in the local cache).
    options: StreamOptions' fields (client/options.py; by default moe-l2d at the default socket where one
    answers, else the model files, said once). Close the stream with `close(model)` or `with model:`;
    `stats(model)` counts where its experts came from."""
    lm = StreamedLM(path_or_repo_id, StreamOptions.of(**options), model_config=model_config,
                    tokenizer_config=tokenizer_config, download=True)
    return lm.model, lm.tokenizer


def streamed(model) -> StreamedLM:
    """The StreamedLM behind a model that `load` (or StreamedLM) gave."""
    lm = getattr(model, "_streamed_lm", None)
    if not isinstance(lm, StreamedLM):
        raise TypeError(f"{type(model).__name__} has no streamed experts: give a model that moe_l2.load returned")
    return lm


def close(model) -> None:
    """Close a loaded model's stream: its prefetch worker, model files and daemon link. The model cannot run
    afterwards; closing again does nothing."""
    streamed(model).close()


def stats(model) -> ExpertStats:
    """Where the model's expert lookups were served from so far."""
    lm = streamed(model)
    c = lm.pool.counts
    client = lm.client
    tiers = c.by_source()
    return ExpertStats(lookups=sum(tiers.values()), l0_hits=tiers["l0"], l2_hits=tiers["l2"],
                       daemon_reads=tiers["daemon_disk"], disk_reads=tiers["own_disk"], l2_lent=c.l2_lent,
                       bytes_read=c.bytes_read, bytes_copied=c.bytes_copied, torn_layers=lm.stats.torn_calls,
                       daemon=client.address if client is not None and client.attached else None)


def hit_rates(counts) -> dict:
    """Each source's share of the lookups (TierCounts.by_source: l0, l2, daemon_disk, own_disk), and `disk`."""
    return source_shares(counts.by_source())

