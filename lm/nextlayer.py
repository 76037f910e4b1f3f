"""NextLayer: the streamed forward's next-layer prefetch (docs/architecture.md, "Next-layer prefetch").

After MoE layer l has fetched its experts and queued its computation, StreamedSwitch hands NextLayer the
layer's input and the router's picks; NextLayer guesses layer l+1's experts and asks the pool to load the
ones not in L0 in the background while layer l computes. Three predictors:

- `router`: layer l+1's own router applied to layer l's input (the hidden state a layer later differs
  little): its top experts, summed over the batch's tokens. Needs the router module beside the switch
  (`find_router`); one small matmul and a sync of its result, which waits for nothing queued after it.
- `logistic`: `moe_l2.cache.prefetch.LogisticPredictor` over the expert ids of this token at layers l and
  l-1 and of the token before it at l+1 and l, learned online from this model's routing. The token before is
  the previous forward's row at the same place (decode steps of one batch) or its last row (one-token decode
  after a prefill); for other shapes its blocks stay unknown.
- `cooccurrence`: `moe_l2.cache.prefetch.CooccurrencePredictor`, learned online from this model's routing.

How many guesses: top_k per layer (what the router picks per token; more guesses lose precision fast on the
shared traces, docs/policy-report.md), loaded into the pool's side rows (client/prefetcher.py), which neither
demand nor queued work reads, so a wrong guess evicts nothing. No wrap-around: the last layer prefetches nothing
for the next token's layer 0.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moe_l2.cache.prefetch import PREFETCH, CooccurrencePredictor, LogisticPredictor, top


def find_router(model: nn.Module, switch_path: str, n_experts: int) -> tuple[str, object] | None:
    """The router beside a switch module: a sibling whose 2-D weight has one row per expert (qwen3_moe's
    `mlp.gate`, gpt_oss's `mlp.router`, deepseek's `MoEGate`). Returns (path, x -> logits) or None."""
    parent_path = switch_path.rsplit(".", 1)[0]
    parent = dict(model.named_modules()).get(parent_path)
    if parent is None:
        return None
    for name, child in parent.children().items():
        if not isinstance(child, nn.Module) or f"{parent_path}.{name}" == switch_path:
            continue
        weight = child.get("weight")
        if not isinstance(weight, mx.array) or weight.ndim != 2 or weight.shape[0] != n_experts:
            continue
        if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            return f"{parent_path}.{name}", child
        if mx.issubdtype(weight.dtype, mx.floating):
            return f"{parent_path}.{name}", (lambda x, w=weight: x @ w.T)
    return None


def _seed_sequences(traces, files) -> list:
    """The sequences of a trace of this model's routing; a trace of another geometry is refused."""
    if (traces.n_layers, traces.n_experts) != (files.n_layers, files.n_experts):
        raise ValueError(f"{traces.paths[0]}: a trace of {traces.n_layers} MoE layers x {traces.n_experts} experts "
                         f"cannot seed prefetch for {files.path} ({files.n_layers} x {files.n_experts}): give one "
                         "this model wrote (moe-l2 generate --trace-out)")
    return traces.sequences


class NextLayer:
    """Per model: which predictor guesses layer l+1, and the prefetch requests to the pool."""

    def __init__(self, mode: str, pool, routers: dict | None = None, seed=None):
        """mode: one of PREFETCH but off; routers: MoE layer -> the (path, callable) of `find_router` or None,
        for the pool's layers (`router` needs one for every layer but the pool's first; `auto` falls back to
        logistic). seed: a TraceSet of this model's routing (`moe-l2 generate --trace-out`) that the learned
        predictors start from, instead of from nothing."""
        if mode not in PREFETCH or mode == "off":
            raise ValueError(f"prefetch mode must be one of {', '.join(PREFETCH[1:])}, not {mode!r}")
        files = pool.files
        self.pool = pool
        self.n_layers = files.n_layers
        self.k = files.top_k
        found = bool(routers) and all(r is not None for layer, r in routers.items() if layer != min(routers))
        if mode == "router" and not found:
            raise ValueError(f"{files.path}: no router module found beside the switch layers; use --prefetch "
                             "logistic (or auto)")
        self.predictor = "router" if mode == "router" or (mode == "auto" and found) else \
            "logistic" if mode == "auto" else mode
        self.routers = routers if self.predictor == "router" else None
        learned = self.n_layers > 1 and self.predictor != "router"
        sequences = _seed_sequences(seed, files) if seed is not None else []
        self.seeded_tokens = sum(len(s.experts) for s in sequences) if learned else 0
        self.cooccurrence = (CooccurrencePredictor.from_traces(sequences, self.n_layers, files.n_experts)
                             if learned and self.predictor == "cooccurrence" else None)
        self.logistic = (LogisticPredictor.from_traces(sequences, self.n_layers, files.n_experts)
                         if learned and self.predictor == "logistic" else None)
        # The learned predictors': this forward's picks per layer, the previous forward's, and the last logistic
        # guess's features (learned from when the next layer's picks arrive).
        self._now: dict[int, np.ndarray] = {}
        self._before: dict[int, np.ndarray] = {}
        self._features: tuple[int, np.ndarray] | None = None

    def describe(self) -> str:
        if self.predictor == "router":
            path = next(r[0] for r in self.routers.values() if r is not None)
            return f"router (the next layer's {path.split('.')[-1]})"
        seeded = f"seeded from {self.seeded_tokens} tokens, " if self.seeded_tokens else ""
        return f"{self.predictor} ({seeded}learned online)"

    def after(self, layer: int, x: mx.array, chosen: np.ndarray) -> None:
        """Layer `layer` fetched its experts for tokens routed to `chosen` ((tokens, top_k)) and queued its
        computation on `x`; learn, then prefetch layer+1's guesses."""
        if self.cooccurrence is not None or self.logistic is not None:
            self._learn(layer, chosen)
        if layer + 1 not in self.pool.layers:  # the last layer, or a pipeline stage's last one
            return
        self.pool.prefetch(layer + 1, self.guess(layer, x, chosen))

    def guess(self, layer: int, x: mx.array, chosen: np.ndarray) -> list[int]:
        if self.routers is not None:
            logits = self.routers[layer + 1][1](x)
            probs = np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1)).reshape(-1, logits.shape[-1])
            return top(probs.sum(axis=0), self.k)
        if self.logistic is not None:
            rows = len(chosen)
            features = self.logistic.context(chosen, self._now.get(layer - 1),
                                             self._earlier(layer + 1, rows), self._earlier(layer, rows))
            self._features = (layer, features)
            return self.logistic.predict(layer, features, self.k)
        return self.cooccurrence.predict(layer, np.unique(chosen).tolist(), self.k)

    def _learn(self, layer: int, chosen: np.ndarray) -> None:
        """Keep the picks of this forward (a layer no later than the last one seen starts a new forward) and
        learn from this forward's layer before: its picks (co-occurrence) or its guess's features (logistic)."""
        if self._now and layer <= max(self._now):
            self._before, self._now = self._now, {}
        below = self._now.get(layer - 1)
        self._now[layer] = chosen
        features, self._features = self._features, None
        if below is None or len(below) != len(chosen):
            return
        if self.cooccurrence is not None:
            self.cooccurrence.observe_layer(layer - 1, below, chosen)
        elif features is not None and features[0] == layer - 1:
            self.logistic.learn(layer - 1, features[1], chosen)

    def _earlier(self, layer: int, rows: int) -> np.ndarray | None:
        """The previous tokens' picks at `layer` for a batch of `rows` tokens, where the previous forward
        lines up: the same rows, or one row after several (decode after a prefill)."""
        picks = self._before.get(layer)
        if picks is None or (len(picks) != rows and rows != 1):
            return None
        return picks[-rows:]
