"""Next-layer predictors: from the experts a token was routed to at MoE layer l, guess layer l+1's.

The client's pool loads the guesses that are not in L0 in the background while layer l computes
(docs/architecture.md, "Next-layer prefetch"); `moe-l2 replay --prefetch` scores the same predictors on
traces. A predictor answers `predict(layer, experts, k)`: up to k guesses for layer+1, best first, and learns
online through `observe(layer, experts, next_experts)`. Numpy only: core code, shared by client and replay.

- `CooccurrencePredictor`: how often expert b was picked at layer l+1 by tokens that picked a at layer l,
  counted online and seedable from traces (`from_traces`). A guess scores sum over the layer-l experts a of
  P(b | a), smoothed towards layer l+1's overall frequency, which is also the cold start.
- `LogisticPredictor`: one logistic model per pair of adjacent layers, over the expert ids of the token's
  context: what it picked at layers l and l-1, and what the previous token picked at l+1 and l. Learned
  online by minibatch gradient descent, seedable from traces. Co-occurrence counts one layer's picks; this
  weighs four sets of them against each other, and on the shared traces it guesses 74% right against 58%.
- `RepeatPredictor`: layer l+1's experts of the previous token (the router-free baseline: routing repeats).

`guess_streams` computes, for `moe-l2 replay --prefetch`, every token's guesses at once per layer, learning
online in blocks of tokens so that no token is guessed by a predictor that has seen it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from moe_l2.cache.score import Score

# The client's prefetch modes (`generate`/`serve --prefetch`, client.nextlayer.NextLayer): off, the next
# layer's router on this layer's input, LogisticPredictor, CooccurrencePredictor, or router where the model
# has one and logistic where it has not.
PREFETCH = ("off", "router", "logistic", "cooccurrence", "auto")
# Pseudo-count of the smoothing towards layer l+1's frequency: how many observations of expert a at layer l
# it takes before P(b | a) outweighs the marginal. Few: adjacent layers' routing is strongly tied.
SMOOTHING = 2.0


class NextLayerPredictor(Protocol):
    def predict(self, layer: int, experts: Sequence[int], k: int) -> list[int]:
        """Up to k guesses for layer+1's experts, best first, from the experts picked at `layer`."""

    def observe(self, layer: int, experts: Sequence[int], next_experts: Sequence[int]) -> None:
        """Learn from one token: it picked `experts` at `layer` and `next_experts` at layer+1."""


def _check(layer: int, n_layers: int) -> None:
    if not 0 <= layer < n_layers - 1:
        raise IndexError(f"layer {layer}: next-layer guesses exist for layers 0..{n_layers - 2} of {n_layers}")


def one_hot(rows: np.ndarray, n_experts: int) -> np.ndarray:
    """(tokens, top_k) expert ids -> (tokens, n_experts) 0/1 float64 matrix."""
    rows = np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)
    out = np.zeros((len(rows), n_experts))
    np.put_along_axis(out, rows, 1.0, axis=1)
    return out


class CooccurrencePredictor:
    """Expert-id co-occurrence between adjacent MoE layers, learned online."""

    def __init__(self, n_layers: int, n_experts: int, smoothing: float = SMOOTHING):
        if n_layers < 2:
            raise ValueError("next-layer prediction needs at least two MoE layers")
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.smoothing = smoothing
        # pairs[l][a, b]: tokens that picked a at layer l and b at layer l+1; picks[l][a]: tokens picking a.
        self.pairs = np.zeros((n_layers - 1, n_experts, n_experts))
        self.picks = np.zeros((n_layers, n_experts))

    @classmethod
    def from_traces(cls, sequences: Iterable, n_layers: int, n_experts: int,
                    smoothing: float = SMOOTHING) -> "CooccurrencePredictor":
        """Seeded from trace sequences (`moe_l2.cache.trace.TraceSequence`, or anything with `.experts`
        [token][layer] -> ids)."""
        p = cls(n_layers, n_experts, smoothing)
        for s in sequences:
            if s.experts:
                p.observe_tokens(np.asarray(s.experts, dtype=np.int64))
        return p

    def observe_tokens(self, routed: np.ndarray) -> None:
        """Learn from many tokens at once: routed is (tokens, n_layers, top_k) expert ids."""
        hots = [one_hot(routed[:, layer], self.n_experts) for layer in range(self.n_layers)]
        for layer in range(self.n_layers):
            self.picks[layer] += hots[layer].sum(axis=0)
        for layer in range(self.n_layers - 1):
            self.pairs[layer] += hots[layer].T @ hots[layer + 1]

    def observe_layer(self, layer: int, chosen: np.ndarray, next_chosen: np.ndarray) -> None:
        """Learn from a batch of tokens at one pair of layers: (tokens, top_k) ids at layer and layer+1."""
        _check(layer, self.n_layers)
        a, b = one_hot(chosen, self.n_experts), one_hot(next_chosen, self.n_experts)
        self.pairs[layer] += a.T @ b
        self.picks[layer] += a.sum(axis=0)
        self.picks[layer + 1] += b.sum(axis=0)

    def observe(self, layer: int, experts: Sequence[int], next_experts: Sequence[int]) -> None:
        _check(layer, self.n_layers)
        a = np.asarray(sorted(set(experts)), dtype=np.int64)
        b = np.asarray(sorted(set(next_experts)), dtype=np.int64)
        self.pairs[layer][np.ix_(a, b)] += 1
        self.picks[layer][a] += 1
        self.picks[layer + 1][b] += 1

    def scores(self, layer: int, weights: np.ndarray) -> np.ndarray:
        """Scores of layer+1's experts for tokens whose layer-l picks are the rows of `weights`
        ((tokens, n_experts) 0/1): sum over picked a of (pairs[a, b] + s * f(b)) / (n(a) + s)."""
        nxt = self.picks[layer + 1]
        total = nxt.sum()
        marginal = nxt / total if total else np.full(self.n_experts, 1.0 / self.n_experts)
        seen = self.picks[layer][:, None]
        cond = (self.pairs[layer] + self.smoothing * marginal[None, :]) / (seen + self.smoothing)
        return weights @ cond

    def predict(self, layer: int, experts: Sequence[int], k: int) -> list[int]:
        _check(layer, self.n_layers)
        weights = np.zeros(self.n_experts)
        weights[np.asarray(list(set(experts)), dtype=np.int64)] = 1.0
        return top(self.scores(layer, weights[None, :])[0], k)


# LogisticPredictor's learning: a gradient step of RATE per BATCH tokens observed, and EPOCHS passes over the
# traces it is seeded from. With these, `moe-l2 replay --prefetch logistic` scores 73.8% precision on both
# shared traces (docs/policy-report.md).
RATE = 0.5
BATCH = 32
EPOCHS = 2


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


class LogisticPredictor:
    """P(expert b at layer l+1 | the token's context), a logistic model per pair of adjacent layers.

    The context is four one-hot blocks of n_experts and a bias: the expert ids the token picked at layer l and
    at l-1, and those the token before it picked at l+1 and at l (`context`); a block not known (layer 0 has
    no l-1, the first token no token before it) is zeros. Weights are float32, (n_layers - 1) x (4 n_experts
    + 1) x n_experts: 24 MB for 94 layers of 128 experts."""

    def __init__(self, n_layers: int, n_experts: int, rate: float = RATE, batch: int = BATCH):
        if n_layers < 2:
            raise ValueError("next-layer prediction needs at least two MoE layers")
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.rate = rate
        self.batch = batch
        self.weights = np.zeros((n_layers - 1, 4 * n_experts + 1, n_experts), dtype=np.float32)
        self._pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_layers - 1)]

    @classmethod
    def from_traces(cls, sequences: Iterable, n_layers: int, n_experts: int,
                    epochs: int = EPOCHS) -> "LogisticPredictor":
        """Seeded from trace sequences (anything with `.experts` [token][layer] -> ids): each layer's bias
        starts at the log-odds of layer l+1's frequency, then `epochs` passes of minibatch descent."""
        p = cls(n_layers, n_experts)
        routed = [np.asarray(s.experts, dtype=np.int64) for s in sequences if s.experts]
        if not routed:
            return p
        for layer in range(n_layers - 1):
            xs = np.vstack([p.stream_context(r, layer) for r in routed])
            ys = np.vstack([one_hot(r[:, layer + 1], n_experts) for r in routed]).astype(np.float32)
            share = ys.mean(axis=0).clip(1e-3, 1 - 1e-3)
            p.weights[layer, -1] = np.log(share / (1 - share))
            for _ in range(epochs):
                p._descend(layer, xs, ys)
        return p

    def context(self, now: np.ndarray, below: np.ndarray | None = None, before_next: np.ndarray | None = None,
                before: np.ndarray | None = None) -> np.ndarray:
        """(tokens, 4 n_experts + 1) features from (tokens, top_k) ids: `now` picked at layer l, `below` at
        l-1, and the previous tokens' picks `before_next` at l+1 and `before` at l; None for an unknown block."""
        blocks = [one_hot(now, self.n_experts)]
        for ids in (below, before_next, before):
            blocks.append(np.zeros_like(blocks[0]) if ids is None else one_hot(ids, self.n_experts))
        blocks.append(np.ones((len(now), 1)))
        return np.hstack(blocks).astype(np.float32)

    def stream_context(self, routed: np.ndarray, layer: int, previous: np.ndarray | None = None) -> np.ndarray:
        """Features for guessing layer+1 of consecutive tokens routed ((tokens, n_layers, top_k)); `previous`
        is the (n_layers, top_k) picks of the token before routed[0], None if there was none."""
        _check(layer, self.n_layers)
        before = routed[:-1] if previous is None else np.concatenate([previous[None], routed[:-1]])
        features = self.context(routed[:, layer], routed[:, layer - 1] if layer else None)
        e = self.n_experts
        after = features[len(routed) - len(before):]  # the tokens that have one before them
        after[:, 2 * e:3 * e] = one_hot(before[:, layer + 1], e)
        after[:, 3 * e:4 * e] = one_hot(before[:, layer], e)
        return features

    def probabilities(self, layer: int, features: np.ndarray) -> np.ndarray:
        """(tokens, n_experts): each of layer+1's experts' probability of being picked, per token."""
        _check(layer, self.n_layers)
        return sigmoid(features @ self.weights[layer])

    def predict(self, layer: int, features: np.ndarray, k: int) -> list[int]:
        """Up to k guesses for layer+1, best first: the experts most probable summed over the tokens."""
        return top(self.probabilities(layer, features).sum(axis=0), k)

    def learn(self, layer: int, features: np.ndarray, next_experts: np.ndarray) -> None:
        """The tokens of `features` picked next_experts ((tokens, top_k)) at layer+1; a step is taken per
        `batch` tokens, so that one-token decode steps learn as a prefill's batch does."""
        _check(layer, self.n_layers)
        pending = self._pending[layer]
        pending.append((features, one_hot(next_experts, self.n_experts).astype(np.float32)))
        if sum(len(x) for x, _ in pending) >= self.batch:
            xs, ys = np.vstack([x for x, _ in pending]), np.vstack([y for _, y in pending])
            pending.clear()
            self._descend(layer, xs, ys)

    def _descend(self, layer: int, xs: np.ndarray, ys: np.ndarray) -> None:
        w = self.weights[layer]
        for start in range(0, len(xs), self.batch):
            x, y = xs[start:start + self.batch], ys[start:start + self.batch]
            w -= (self.rate / len(x)) * (x.T @ (sigmoid(x @ w) - y))


class RepeatPredictor:
    """Layer l+1's experts of the previous token: routing that repeats from token to token."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self._last: list[list[int]] = [[] for _ in range(n_layers)]

    def predict(self, layer: int, experts: Sequence[int], k: int) -> list[int]:
        _check(layer, self.n_layers)
        return self._last[layer + 1][:k]

    def observe(self, layer: int, experts: Sequence[int], next_experts: Sequence[int]) -> None:
        _check(layer, self.n_layers)
        self._last[layer + 1] = list(next_experts)


# Replay's router-free predictors: the logistic model and co-occurrence (each seeded, then learning online),
# layer l+1's overall frequency alone (co-occurrence's cold start, as a baseline) and the previous token's
# experts.
REPLAY_PREDICTORS = ("logistic", "cooccurrence", "frequency", "repeat")
# Tokens guessed at once by guess_streams before the predictor learns them.
BLOCK = 256


def guess_streams(name: str, trained_on: Sequence, routed: np.ndarray, n_experts: int, k: int,
                  block: int = BLOCK) -> list[list[tuple[int, ...]] | None]:
    """Per MoE layer, every token's k guesses for it made at the layer before (None for layer 0: nothing
    precedes it); routed is (tokens, n_layers, top_k), consecutive tokens. The logistic and co-occurrence
    predictors are seeded from the `trained_on` trace sequences, then guess a block of tokens from what they
    learned before the block and learn the block; `frequency` guesses layer l+1's most frequent experts so far
    (seeded likewise); `repeat` the previous token's."""
    if name not in REPLAY_PREDICTORS:
        raise ValueError(f"unknown prefetch predictor {name!r}; choose from {', '.join(REPLAY_PREDICTORS)}")
    n_tokens, n_layers, _ = routed.shape
    out: list[list[tuple[int, ...]] | None] = [None] + [[] for _ in range(n_layers - 1)]
    if name == "repeat":
        for layer in range(1, n_layers):
            previous = [()] + [tuple(row[:k]) for row in routed[:-1, layer].tolist()]
            out[layer] = previous
        return out
    if name == "logistic":
        predictor = LogisticPredictor.from_traces(trained_on, n_layers, n_experts)
    else:
        predictor = CooccurrencePredictor.from_traces(trained_on, n_layers, n_experts)
    for start in range(0, n_tokens, block):
        chunk = routed[start:start + block]
        for layer in range(n_layers - 1):
            if name == "logistic":
                features = predictor.stream_context(chunk, layer, routed[start - 1] if start else None)
                scores = predictor.probabilities(layer, features)
                predictor.learn(layer, features, chunk[:, layer + 1])
            elif name == "frequency":
                scores = np.broadcast_to(predictor.picks[layer + 1], (len(chunk), n_experts))
            else:
                scores = predictor.scores(layer, one_hot(chunk[:, layer], n_experts))
            order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            out[layer + 1].extend(tuple(row) for row in order.tolist())
        if name != "logistic":
            predictor.observe_tokens(chunk)
    return out


def top(scores: np.ndarray, k: int) -> list[int]:
    """The k best-scoring ids, best first (ties: the lower id)."""
    k = min(k, len(scores))
    if k <= 0:
        return []
    order = np.argsort(-scores, kind="stable")
    return order[:k].tolist()


def score_predictor(predictor: NextLayerPredictor, sequences: Iterable, k: int, *, learn: bool = True) -> Score:
    """Precision and recall of k guesses per token and layer pair over trace sequences, in order; with
    `learn` the predictor observes each token after it was scored (online: it never scores what it learned)."""
    score = Score()
    for s in sequences:
        for token in s.experts:
            for layer in range(len(token) - 1):
                score.add(predictor.predict(layer, token[layer], k), token[layer + 1])
                if learn:
                    predictor.observe(layer, token[layer], token[layer + 1])
    return score
