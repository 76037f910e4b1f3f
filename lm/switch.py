"""StreamedSwitch: the switch layer of an mlx-lm MoE model, with its expert weights in the L0 pool.

StreamedSwitch runs the same mx.gather_qmm / mx.gather_mm calls as mlx-lm's switch layers, on the pool's
arrays with the router's indices remapped to pool rows, so outputs are bit-identical to the whole model.
Per layer it syncs the router's choice once (the pool must know which experts to fetch). When a batch needs
more distinct experts than L0 holds, it runs in chunks of whole experts, each evaluated before the next one
is fetched, so no queued computation ever reads a row that is being refilled (docs/architecture.md,
"Client pool (L0)"). Experts that the daemon's L2 holds are computed on in its shared memory, without a copy
(ExpertPool.borrow), and the layer is computed again from L0 if the daemon rewrote one meanwhile
(docs/architecture.md, "Zero-copy L2 reads"). It asks the pool only through ExpertPool's and LayerPool's
methods. With a NextLayer
(lm/nextlayer.py) it then has layer l+1's guessed experts prefetched while layer l computes
(docs/architecture.md, "Next-layer prefetch").
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP, _gather_sort

from moe_l2.client.pool import ExpertPool, PoolTooSmall

__all__ = ["StreamStats", "RoutingRecorder", "ForwardState", "StreamedSwitch"]

# mlx-lm sorts the (token, expert) pairs by expert from this many pairs on (switch_layers.SwitchGLU).
_SORT_FROM = 64


def quantized_sorted(pairs: int, n_experts: int, sorted_indices: bool) -> bool:
    """The sorted_indices to give the pool's gather_qmm so that MLX picks the kernel it picks for the whole
    model. MLX's Metal backend takes its batched gather_qmm_rhs kernel only when the indices are sorted, there
    are at least 16 pairs and at least 4 per expert row of the weight array (pairs // rows >= 4); the whole
    model's array has n_experts rows, the pool's fewer, so passing mlx-lm's flag as is would switch the pool to
    that kernel early and change the last bits. Passing it only when the whole model's test holds gives both
    the same kernel (docs/architecture.md, "Exactness"). CPU kernels ignore the flag."""
    return sorted_indices and pairs >= 16 and pairs // n_experts >= 4


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
    lent_calls: int = 0     # calls that computed some experts in place in L2 (client/l2view.py)
    torn_calls: int = 0     # of those, calls computed again because the daemon rewrote a lent slot meanwhile

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


class ForwardState:
    """State shared by the StreamedSwitch modules of one model."""

    def __init__(self, pool: ExpertPool, stats: StreamStats, recorder: RoutingRecorder | None = None,
                 next_layer=None):
        self.pool = pool
        self.stats = stats
        self.recorder = recorder
        self.next_layer = next_layer  # a client.nextlayer.NextLayer, or None: no prefetch
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


@functools.cache
def _gather_mm_fails(dtype: mx.Dtype, device: mx.Device) -> str | None:
    """Why mx.gather_mm cannot run in `dtype` on `device`, or None (MLX's CPU kernels compute float32 only)."""
    try:
        mx.eval(mx.gather_mm(mx.zeros((1, 1, 2), dtype), mx.zeros((1, 2, 2), dtype),
                             rhs_indices=mx.array([0], dtype=mx.uint32)))
    except RuntimeError as exc:
        return str(exc)
    return None


def _projection(name: str, module: nn.Module) -> _Proj:
    if isinstance(module, QuantizedSwitchLinear):
        return _Proj(name, (module.group_size, module.bits, module.mode), "bias" in module,
                     module.get("global_scale") is not None)
    if isinstance(module, SwitchLinear):
        dtype, device = module.weight.dtype, mx.default_device()
        why = _gather_mm_fails(dtype, device)
        if why is not None:
            # mlx-lm fails the same way with the model loaded whole, only later: in the first forward.
            kind, where = str(dtype).rsplit(".", 1)[-1], "CPU" if device.type == mx.cpu else "GPU"
            raise ValueError(f"MLX cannot compute this model's unquantized {kind} experts on the {where} ({why}): "
                             f"quantize it (mlx_lm.convert -q) or run it where MLX computes {kind} (Metal, "
                             "CUDA)")
        return _Proj(name, None, "bias" in module, False)
    raise TypeError(f"{name} is a {type(module).__name__}, not a switch linear layer")


class StreamedSwitch(nn.Module):
    """Drop-in for SwitchGLU / SwitchMLP whose expert weights live in the ExpertPool, not in the module."""

    def __init__(self, original: nn.Module, forward: ForwardState, layer: int):
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
    def _linear(self, arrays: dict, p: _Proj, x: mx.array, idx: mx.array, sorted_indices: bool,
                quant_sorted: bool) -> mx.array:
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
                sorted_indices=quant_sorted,
            )
        else:
            x = mx.gather_mm(x, arrays[f"{p.name}.weight"].swapaxes(-1, -2), rhs_indices=idx,
                             sorted_indices=sorted_indices)
        if p.has_bias:
            x = x + mx.expand_dims(arrays[f"{p.name}.bias"][idx], -2)
        return x

    def _experts(self, arrays: dict, x: mx.array, idx: mx.array, sorted_indices: bool, pairs: int) -> mx.array:
        """The expert MLP on the pool rows `idx`; `pairs` is the whole batch's (token, expert) pair count,
        which decides the quantized kernel (quantized_sorted)."""
        p = self._projs
        qs = quantized_sorted(pairs, self._forward.pool.files.n_experts, sorted_indices)
        if self.glu:
            x_up = self._linear(arrays, p["up_proj"], x, idx, sorted_indices, qs)
            x_gate = self._linear(arrays, p["gate_proj"], x, idx, sorted_indices, qs)
            return self._linear(arrays, p["down_proj"], self.activation(x_up, x_gate), idx, sorted_indices, qs)
        x = self.activation(self._linear(arrays, p["fc1"], x, idx, sorted_indices, qs))
        return self._linear(arrays, p["fc2"], x, idx, sorted_indices, qs)

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
        if fw.next_layer is not None:
            # A prefetch into this layer had the sync (the previous layer's compute) to land; it is done or
            # cancelled before the layer's bookkeeping is read. Waiting for it is stall.
            t0 = time.perf_counter()
            pool.settle(self.layer)
            stats.fetch_s += time.perf_counter() - t0
        if fw.recorder is not None:
            fw.recorder.record(self.layer, chosen.reshape(-1, top_k))

        experts = np.unique(chosen).tolist()
        if self._is_last():
            if fw.tail is not None and not lp.has_room_for(experts):
                mx.eval(fw.tail)  # about to evict rows the previous forward's output may still read
            fw.tail = None
        out = self._lent(x, indices, chosen.reshape(-1, top_k), pool, experts)
        if out is None and lp.fits(experts):
            self._fetch(experts)
            out = self._whole(x, indices, pool)
            if pool.shared_l0:
                mx.eval(out)  # the next layer may take these rows (client/layerpool.py)
        elif out is None:
            stats.chunked_calls += 1
            out = self._chunked(x, indices, chosen.reshape(-1, top_k), pool)
        if self._is_last():
            fw.tail = out
        if fw.next_layer is not None:
            # Guesses land in side rows, which nothing queued reads (docs/architecture.md, "Next-layer prefetch").
            fw.next_layer.after(self.layer, x, chosen.reshape(-1, top_k))
        return out

    @property
    def next_layer(self):
        """The model's next-layer prefetcher (client.nextlayer.NextLayer), or None."""
        return self._forward.next_layer

    def _is_last(self) -> bool:
        return self.layer == self._forward.pool.files.n_layers - 1

    def _fetch(self, experts: list[int]) -> None:
        stats = self._forward.stats
        t0 = time.perf_counter()
        counts = self._forward.pool.fetch(self.layer, experts)
        stats.fetch_s += time.perf_counter() - t0
        stats.copy_s += counts.copy_s
        stats.pread_s += counts.read_s

    def _lent(self, x: mx.array, indices: mx.array, chosen: np.ndarray, pool: ExpertPool,
              experts: list[int]) -> mx.array | None:
        """The layer with the experts L2 holds computed in place on its shared memory and the rest on L0 rows,
        evaluated; None where the pool lends nothing (then nothing was fetched) or the daemon rewrote a lent
        slot during the computation (then the caller computes it again from L0: docs/architecture.md,
        "Zero-copy L2 reads"). Each (token, expert) pair runs through the same kernel as in `_whole`."""
        stats = self._forward.stats
        t0 = time.perf_counter()
        counts, loan = pool.borrow(self.layer, experts)
        stats.fetch_s += time.perf_counter() - t0
        if loan is None:
            return None
        stats.copy_s += counts.copy_s
        stats.pread_s += counts.read_s
        stats.lent_calls += 1
        lp = pool.layers[self.layer]
        slot_of = loan.slot_of()
        n_tokens, top_k = chosen.shape
        flat = chosen.reshape(-1)
        x = mx.expand_dims(x, (-2, -3)).reshape(n_tokens, 1, 1, x.shape[-1])
        in_l2 = np.array([e in slot_of for e in flat.tolist()])
        do_sort = indices.size >= _SORT_FROM
        pieces, outs = [], []
        for arrays, pairs, rows_for in ((pool.arrays(self.layer), np.flatnonzero(~in_l2), lp.rows_for),
                                        (loan.arrays(), np.flatnonzero(in_l2), lambda es: [slot_of[e] for e in es])):
            if not pairs.size:
                continue
            rows = np.array(rows_for(flat[pairs].tolist()), dtype=np.uint32)
            if do_sort:  # sorted_indices promises ascending rows
                by_row = np.argsort(rows, kind="stable")
                pairs, rows = pairs[by_row], rows[by_row]
            pieces.append(pairs)
            outs.append(self._on_pairs(arrays, x, pairs, top_k, rows, do_sort, indices.size))
        out = _in_pair_order(outs, pieces, indices.shape)
        mx.eval(out)
        if loan.torn():
            stats.torn_calls += 1
            return None
        return out

    def _on_pairs(self, arrays: dict, x: mx.array, pairs: np.ndarray, top_k: int, rows: np.ndarray,
                  sorted_indices: bool, n_pairs: int) -> mx.array:
        """The expert MLP for some (token, expert) pairs (flat indices into the router's top_k picks per token)
        on `rows` of `arrays`; x is (tokens, 1, 1, hidden)."""
        return self._experts(arrays, x[mx.array(pairs // top_k)].squeeze(1), mx.array(rows), sorted_indices,
                             n_pairs)

    def _whole(self, x: mx.array, indices: mx.array, pool: ExpertPool) -> mx.array:
        """SwitchGLU.__call__ with the expert ids remapped, on device, to pool rows."""
        arrays = pool.arrays(self.layer)
        idx = pool.table(self.layer)[indices]
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= _SORT_FROM
        inv_order = None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, idx)
        x = self._experts(arrays, x, idx, do_sort, indices.size)
        if do_sort:
            x = mx.unflatten(x[inv_order], 0, indices.shape)
        return x.squeeze(-2)

    def _chunked(self, x: mx.array, indices: mx.array, chosen: np.ndarray, pool: ExpertPool) -> mx.array:
        """The batch in pieces that each fit L0, each evaluated before the next piece's experts are fetched (on
        the arrays the fetch leaves: a fetch may grow the rows)."""
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
                out = self._on_pairs(pool.arrays(self.layer), x, pairs, top_k, rows[by_row], True, indices.size)
                mx.eval(out)
                outs.append(out)
            return _in_pair_order(outs, pieces, indices.shape)
        # Few pairs: unsorted like mlx-lm, in runs of whole tokens.
        for run in _token_runs(chosen, free, pinned):
            part = chosen[run.start:run.stop]
            self._fetch(np.unique(part).tolist())
            idx = np.array(lp.rows_for(part.reshape(-1).tolist()), dtype=np.uint32).reshape(part.shape)
            out = self._experts(pool.arrays(self.layer), x[run.start:run.stop], mx.array(idx), False, indices.size)
            mx.eval(out)
            outs.append(out)
        out = mx.concatenate(outs, axis=0)
        return out.reshape(*indices.shape, *out.shape[-2:]).squeeze(-2)


def _in_pair_order(outs: list[mx.array], pieces: list[np.ndarray], shape) -> mx.array:
    """Outputs computed piece by piece (each for the flat pair indices of its piece) back in the router's pair
    order, shaped like its indices."""
    out = mx.concatenate(outs, axis=0)[mx.array(np.argsort(np.concatenate(pieces)))]
    return mx.unflatten(out, 0, shape).squeeze(-2)


def _groups(experts: list[int], free: int, pinned: frozenset[int]) -> list[list[int]]:
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


def _token_runs(chosen: np.ndarray, free: int, pinned: frozenset[int]) -> list[range]:
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
