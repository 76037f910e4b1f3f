"""Run an mlx-lm MoE model with its routed experts streamed through the L0 pool.

The model is built by mlx-lm's own loader (mx.load is lazy: it reads headers only), with the routed-expert
tensors taken out of the weights before the architecture's sanitize sees them, and shape-only stand-ins
(lazy zeros shaped like the stacked switch parameters, from the record layout) put back after it, so that
mlx-lm's own quantization rules and strict loading decide every module. Each SwitchGLU / SwitchMLP is then
swapped for a StreamedSwitch and the stand-ins are dropped unevaluated: no expert byte is read here. This
also loads checkpoints whose per-expert tensors mlx-lm's sanitize would not stack (`moe-l2 pack --moe-l2-only`).

StreamedSwitch runs the same mx.gather_qmm / mx.gather_mm calls as mlx-lm's switch layers, on the pool's
arrays with the router's indices remapped to pool rows, so outputs are bit-identical to the whole model.
Per layer it syncs the router's choice once (the pool must know which experts to fetch). When a batch needs
more distinct experts than L0 holds, it runs in chunks of whole experts, each evaluated before the next one
is fetched, so no queued computation ever reads a row that is being refilled.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP, _gather_sort
from mlx_lm.utils import _get_classes, load_tokenizer
from mlx_lm.utils import load_model as _mlx_lm_load_model

from moe_l2.client.pool import ExpertPool, PoolTooSmall
from moe_l2.model import ModelFiles
from moe_l2.sizes import parse_size

__all__ = ["StreamStats", "StreamedSwitch", "RoutingRecorder", "StreamedLM", "stream_experts",
           "load_model", "l0_slots_for", "peak_rss_bytes", "hit_rates"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# mlx-lm sorts the (token, expert) pairs by expert from this many pairs on (switch_layers.SwitchGLU).
_SORT_FROM = 64


@dataclass
class StreamStats:
    """Where a streamed forward spends its time on the host (seconds, summed over layers)."""

    calls: int = 0          # StreamedSwitch calls (one per MoE layer per forward)
    resident_calls: int = 0  # one-token calls with every expert of the layer in L0: no sync needed
    chunked_calls: int = 0  # calls whose batch needed more distinct experts than L0 holds
    sync_s: float = 0.0     # blocked until the router's choice is on the host (includes queued compute)
    fetch_s: float = 0.0    # in ExpertPool.fetch (L2 copies and preads included)
    copy_s: float = 0.0     # L2 -> L0 copies (part of fetch_s)
    pread_s: float = 0.0    # L3 -> L0 reads (part of fetch_s)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class RoutingRecorder:
    """The experts each token was routed to, per MoE layer, in the order the model processed the tokens."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.tokens: list[list[list[int] | None]] = []
        self._forward_start = 0
        self._last_layer = n_layers

    def record(self, layer: int, chosen: np.ndarray) -> None:
        """chosen: (tokens, top_k) expert ids of one layer of one forward."""
        if layer <= self._last_layer:  # layers run in order: a layer not after the last one starts a forward
            self._forward_start = len(self.tokens)
            self.tokens.extend([None] * self.n_layers for _ in range(len(chosen)))
        self._last_layer = layer
        for entry, row in zip(self.tokens[self._forward_start:], chosen.tolist()):
            entry[layer] = row

    def take(self) -> list[list[list[int]]]:
        """The tokens recorded so far (the recorder starts over)."""
        out, self.tokens = self.tokens, []
        self._last_layer = self.n_layers
        return out


class _Forward:
    """State shared by the StreamedSwitch modules of one model."""

    def __init__(self, pool: ExpertPool, stats: StreamStats):
        self.pool = pool
        self.stats = stats
        self.recorder: RoutingRecorder | None = None
        # The last MoE layer's output may never be evaluated (mlx-lm's prefill drops the last layer's
        # output); it must be, before that layer's rows are refilled. Every other layer's output is
        # evaluated by the next layer's routing sync.
        self.tail: mx.array | None = None


@dataclass(frozen=True)
class _Proj:
    name: str
    quant: tuple[int, int, str] | None  # group_size, bits, mode
    has_bias: bool
    has_global_scale: bool


def _projection(name: str, module: nn.Module) -> _Proj:
    if isinstance(module, QuantizedSwitchLinear):
        return _Proj(name, (module.group_size, module.bits, module.mode), "bias" in module,
                     module.get("global_scale") is not None)
    if isinstance(module, SwitchLinear):
        return _Proj(name, None, "bias" in module, False)
    raise TypeError(f"{name} is a {type(module).__name__}, not a switch linear layer")


class StreamedSwitch(nn.Module):
    """Drop-in for SwitchGLU / SwitchMLP whose expert weights live in the ExpertPool, not in the module."""

    def __init__(self, original: nn.Module, forward: _Forward, layer: int):
        super().__init__()
        if isinstance(original, SwitchGLU):
            self.glu = True
            names = ("gate_proj", "up_proj", "down_proj")
        elif isinstance(original, SwitchMLP):
            self.glu = False
            names = ("fc1", "fc2")
        else:
            raise TypeError(f"cannot stream a {type(original).__name__}")
        self.activation = original.activation
        self.layer = layer
        self._forward = forward
        # Plain attributes (not Module entries): the module has no parameters of its own.
        object.__setattr__(self, "_projs", {n: _projection(n, getattr(original, n)) for n in names})

    # Pure functions of the pool arrays, written exactly like mlx-lm's QuantizedSwitchLinear / SwitchLinear.
    def _linear(self, arrays: dict, p: _Proj, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        if p.quant is not None:
            group_size, bits, mode = p.quant
            x = mx.gather_qmm(
                x,
                arrays[f"{p.name}.weight"],
                arrays[f"{p.name}.scales"],
                arrays.get(f"{p.name}.biases"),
                rhs_indices=idx,
                transpose=True,
                group_size=group_size,
                bits=bits,
                mode=mode,
                global_scale=arrays[f"{p.name}.global_scale"] if p.has_global_scale else None,
                sorted_indices=sorted_indices,
            )
        else:
            x = mx.gather_mm(x, arrays[f"{p.name}.weight"].swapaxes(-1, -2), rhs_indices=idx,
                             sorted_indices=sorted_indices)
        if p.has_bias:
            x = x + mx.expand_dims(arrays[f"{p.name}.bias"][idx], -2)
        return x

    def _experts(self, arrays: dict, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        p = self._projs
        if self.glu:
            x_up = self._linear(arrays, p["up_proj"], x, idx, sorted_indices)
            x_gate = self._linear(arrays, p["gate_proj"], x, idx, sorted_indices)
            return self._linear(arrays, p["down_proj"], self.activation(x_up, x_gate), idx, sorted_indices)
        x = self.activation(self._linear(arrays, p["fc1"], x, idx, sorted_indices))
        return self._linear(arrays, p["fc2"], x, idx, sorted_indices)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        fw = self._forward
        stats = fw.stats
        stats.calls += 1
        pool = fw.pool
        lp = pool.layers[self.layer]
        top_k = indices.shape[-1]
        if indices.size == top_k and lp.holds_all() and fw.recorder is None:
            # One token, every expert of the layer resident (so L0 holds them all and never refills a row):
            # nothing to fetch, so no sync. The router picks top_k distinct experts, all of them L0 hits.
            stats.resident_calls += 1
            pool.count_l0_hits(top_k)
            return self._whole(x, indices, pool)
        t0 = time.perf_counter()
        chosen = np.asarray(indices)  # the one device-to-host sync of this layer
        stats.sync_s += time.perf_counter() - t0
        if fw.recorder is not None:
            fw.recorder.record(self.layer, chosen.reshape(-1, top_k))

        experts = np.unique(chosen).tolist()
        if self._is_last():
            if fw.tail is not None and not lp.has_room_for(experts):
                mx.eval(fw.tail)  # about to evict rows the previous forward's output may still read
            fw.tail = None
        if lp.fits(experts):
            self._fetch(experts)
            out = self._whole(x, indices, pool)
        else:
            stats.chunked_calls += 1
            out = self._chunked(x, indices, chosen.reshape(-1, top_k), pool)
        if self._is_last():
            fw.tail = out
        return out

    def _is_last(self) -> bool:
        return self.layer == self._forward.pool.files.n_layers - 1

    def _fetch(self, experts: list[int]) -> None:
        stats = self._forward.stats
        t0 = time.perf_counter()
        counts = self._forward.pool.fetch(self.layer, experts)
        stats.fetch_s += time.perf_counter() - t0
        stats.copy_s += counts.copy_s
        stats.pread_s += counts.read_s

    def _whole(self, x: mx.array, indices: mx.array, pool: ExpertPool) -> mx.array:
        """SwitchGLU.__call__ with the expert ids remapped, on device, to pool rows."""
        arrays = pool.arrays(self.layer)
        idx = pool.table(self.layer)[indices]
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= _SORT_FROM
        inv_order = None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, idx)
        x = self._experts(arrays, x, idx, do_sort)
        if do_sort:
            x = mx.unflatten(x[inv_order], 0, indices.shape)
        return x.squeeze(-2)

    def _chunked(self, x: mx.array, indices: mx.array, chosen: np.ndarray, pool: ExpertPool) -> mx.array:
        """The batch in pieces that each fit L0, each evaluated before the next piece's experts are fetched."""
        arrays = pool.arrays(self.layer)
        lp = pool.layers[self.layer]
        free, pinned = lp.unpinned_rows, lp.pins()
        n_tokens, top_k = chosen.shape
        x = mx.expand_dims(x, (-2, -3)).reshape(n_tokens, 1, 1, x.shape[-1])
        outs = []
        if indices.size >= _SORT_FROM:
            # Sorted like mlx-lm (pairs grouped by expert), cut between experts: each expert's run of pairs
            # stays whole and every expert is fetched once.
            flat = chosen.reshape(-1)
            order = np.argsort(flat, kind="stable")
            by_expert = flat[order]
            pieces = []
            for group in _groups(np.unique(flat).tolist(), free, pinned):
                self._fetch(group)
                lo, hi = np.searchsorted(by_expert, [group[0], group[-1] + 1])
                rows = np.array(lp.rows_for(by_expert[lo:hi].tolist()), dtype=np.uint32)
                by_row = np.argsort(rows, kind="stable")  # sorted_indices promises ascending pool rows
                pairs = order[lo:hi][by_row]
                pieces.append(pairs)
                out = self._experts(arrays, x[mx.array(pairs // top_k)].squeeze(1), mx.array(rows[by_row]), True)
                mx.eval(out)
                outs.append(out)
            inverse = np.argsort(np.concatenate(pieces))
            out = mx.concatenate(outs, axis=0)[mx.array(inverse)]
            return mx.unflatten(out, 0, indices.shape).squeeze(-2)
        # Few pairs: unsorted like mlx-lm, in runs of whole tokens.
        for run in _token_runs(chosen, free, pinned):
            part = chosen[run.start:run.stop]
            self._fetch(np.unique(part).tolist())
            idx = np.array(lp.rows_for(part.reshape(-1).tolist()), dtype=np.uint32).reshape(part.shape)
            out = self._experts(arrays, x[run.start:run.stop], mx.array(idx), False)
            mx.eval(out)
            outs.append(out)
        out = mx.concatenate(outs, axis=0)
        return out.reshape(*indices.shape, *out.shape[-2:]).squeeze(-2)


def _groups(experts: list[int], free: int, pinned: set[int]) -> list[list[int]]:
    """Runs of the sorted experts, each needing at most `free` rows beside the pinned experts."""
    groups: list[list[int]] = []
    current: list[int] = []
    rows = 0
    for e in experts:
        cost = int(e not in pinned)
        if current and rows + cost > free:
            groups.append(current)
            current, rows = [], 0
        current.append(e)
        rows += cost
    if current:
        groups.append(current)
    return groups


def _token_runs(chosen: np.ndarray, free: int, pinned: set[int]) -> list[range]:
    """Runs of consecutive tokens whose experts need at most `free` rows beside the pinned experts."""
    runs: list[range] = []
    start = 0
    need: set[int] = set()
    for t, row in enumerate(chosen.tolist()):
        mine = set(row) - pinned
        if len(mine) > free:
            raise PoolTooSmall(f"a token needs {len(mine)} experts beside {len(pinned)} pinned ones; "
                               f"the L0 pool holds {free + len(pinned)}")
        if len(need | mine) > free:
            runs.append(range(start, t))
            start, need = t, set()
        need |= mine
    runs.append(range(start, len(chosen)))
    return runs


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


def _switch_layers(model: nn.Module, files: ModelFiles) -> list[tuple[str, nn.Module, int]]:
    """(module path, SwitchGLU / SwitchMLP, MoE layer) for every switch module, in MoE layer order."""
    found = _switch_modules(model)
    if not found:
        raise ValueError(f"{files.path}: the {files.model_type} model has no SwitchGLU / SwitchMLP to stream")
    layer_of = {lid: i for i, lid in enumerate(files.layer_ids)}
    out: dict[int, tuple[str, nn.Module, int]] = {}
    for path, module in found:
        match = _LAYER.search(path)
        layer = layer_of.get(int(match.group(1))) if match else None
        if layer is None or layer in out:
            raise ValueError(f"{files.path}: {path} matches no single MoE layer of the checkpoint "
                             f"(its expert tensors are in layers {files.layer_ids})")
        out[layer] = (path, module, layer)
    missing = sorted(set(range(files.n_layers)) - out.keys())
    if missing:
        raise ValueError(f"{files.path}: the checkpoint has experts for layers "
                         f"{[files.layer_ids[i] for i in missing]}, which the model does not route")
    return [out[i] for i in range(files.n_layers)]


def _stand_ins(model: nn.Module, files: ModelFiles) -> dict[str, mx.array]:
    """Lazy zeros named and shaped like the stacked switch parameters; never evaluated."""
    return {f"{path}.{p.key}": mx.zeros((files.n_experts, *p.shape), dtype=getattr(mx, p.dtype))
            for path, _, _ in _switch_layers(model, files) for p in files.layout.pieces}


def stream_experts(model: nn.Module, pool: ExpertPool, stats: StreamStats | None = None) -> list[StreamedSwitch]:
    """Swap every SwitchGLU / SwitchMLP of a (lazily loaded) model for a StreamedSwitch over `pool`.

    The replaced modules' arrays are dropped unevaluated. Returns the new modules, MoE layer order."""
    files = pool.files
    forward = _Forward(pool, stats if stats is not None else StreamStats())
    found = _switch_layers(model, files)
    switches = []
    for path, module, layer in found:
        _check_layout(path, module, files)
        switches.append(StreamedSwitch(module, forward, layer))
    _replace(model, [(path, s) for (path, _, _), s in zip(found, switches)])
    return switches


def _replace(model: nn.Module, updates: list[tuple[str, nn.Module]]) -> None:
    for path, new in updates:
        parent_path, _, name = path.rpartition(".")
        parent = model
        for part in parent_path.split(".") if parent_path else []:
            parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
        setattr(parent, name, new)


def load_model(path, pool: ExpertPool, *, model_config: dict | None = None,
               stats: StreamStats | None = None) -> tuple[nn.Module, dict, list[StreamedSwitch]]:
    """mlx_lm.utils.load_model, with the routed experts streamed through `pool` and never read here."""
    files = pool.files
    expert_names = files.expert_tensor_names()

    def classes(config):
        model_class, args_class = _get_classes(config)

        class WithoutExperts(model_class):
            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items() if k not in expert_names}
                if hasattr(model_class, "sanitize"):
                    weights = super().sanitize(weights)
                weights.update(_stand_ins(self, files))
                return weights

        WithoutExperts.__name__ = WithoutExperts.__qualname__ = model_class.__name__
        return WithoutExperts, args_class

    model, config = _mlx_lm_load_model(Path(path), lazy=True, model_config=model_config, get_model_classes=classes)
    switches = stream_experts(model, pool, stats)
    mx.eval(model.parameters())
    return model, config, switches


def l0_slots_for(files: ModelFiles, slots: int | None = None, budget: int | str | None = None) -> int:
    """L0 experts per layer: `slots`, or as many as `budget` bytes buy over all layers, or a default
    (a quarter of the experts, at least twice the experts per token). At least top_k: a token needs them all."""
    if slots is not None and budget is not None:
        raise ValueError("give the L0 size as slots or as a budget, not both")
    if budget is not None:
        per_slot = files.n_layers * files.layout.nbytes
        slots = parse_size(budget) // per_slot
        if slots < files.top_k:
            raise ValueError(f"an L0 budget of {budget} buys {slots} experts per layer; a token needs "
                             f"{files.top_k}: give at least {files.top_k * per_slot} bytes")
    elif slots is None:
        slots = max(2 * files.top_k, files.n_experts // 4)
    elif slots < files.top_k:
        raise ValueError(f"L0 needs at least {files.top_k} slots per layer (the experts of one token), got {slots}")
    return min(slots, files.n_experts)


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


class StreamedLM:
    """A streamed model with its tokenizer, pool and daemon link; a context manager that closes them."""

    def __init__(self, path, *, l0_slots: int | None = None, l0_budget: int | str | None = None,
                 socket: str | None = None, daemon: bool = True, client_wait_s: float = 1.0,
                 policy: str = "lru", record: bool = False, model_config: dict | None = None,
                 direct: bool | None = None):
        from moe_l2.client.connection import L2Client

        self.files = ModelFiles.open(path)
        self.stats = StreamStats()
        self.client = L2Client(self.files, socket, wait_s=client_wait_s) if daemon else None
        try:
            self.pool = ExpertPool(self.files, l0_slots_for(self.files, l0_slots, l0_budget), self.client,
                                   policy=policy, direct=direct)
            try:
                self.model, self.config, self.switches = load_model(path, self.pool, model_config=model_config,
                                                                    stats=self.stats)
                self.tokenizer = load_tokenizer(Path(path), eos_token_ids=self.config.get("eos_token_id"))
            except BaseException:
                self.pool.close()
                raise
        except BaseException:
            if self.client is not None:
                self.client.close()
            raise
        self.recorder = RoutingRecorder(self.files.n_layers) if record else None
        self.switches[0]._forward.recorder = self.recorder

    def __enter__(self) -> "StreamedLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()
        if self.client is not None:
            self.client.close()


def hit_rates(counts) -> dict:
    lookups = counts.l0_hits + counts.l2_hits + counts.l3_reads
    rate = (lambda n: n / lookups) if lookups else (lambda n: None)
    return {"lookups": lookups, "l0": rate(counts.l0_hits), "l2": rate(counts.l2_hits), "l3": rate(counts.l3_reads)}

