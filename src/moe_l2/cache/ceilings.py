"""Per-layer L0 ceilings: each layer's LRU hit curve from routing traces, and the split of a process' L0 rows
among its layers where the curves gain most (docs/architecture.md, "Client pool (L0)"; docs/decisions.md,
"Per-layer ceilings, off by default").

A layer's *hit curve* is, for every capacity c of 1..n_experts, how many of the layer's lookups an LRU pool of c
rows would have hit. One pass gives every capacity at once (Mattson's stack distances): before each token, an
expert's distance is the number of other experts used more recently than it; the lookup hits every LRU pool with
more rows than that. This is L0's LRU (client/layerpool.py), which makes a token's experts resident together,
evicting the least recently used expert outside them, up to the order among one token's experts (L0 makes its
hits the more recent of them, which is not a stack algorithm's order; it moved the hits of the shared traces by
under 1%): exact where each token picks one expert.

`split_rows` hands out a total of rows by lookahead (as utility-based cache partitioning does): every layer
starts at the floor (a token's top-k), then the layer whose curve gains most hits per row over its next few rows
gets those rows, until none are left. Layers whose curves gain alike end up alike: uniform ceilings are what a
flat profile gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np


def hit_curves(streams: Sequence[Sequence[Sequence[int]]], n_experts: int) -> list[list[int]]:
    """Per layer: hits[c - 1] = the lookups an LRU pool of c rows hits, for c in 1..n_experts. `streams[layer]`
    is the layer's lookups, token by token in the order they ran (each token the experts its router picked)."""
    return [_curve(stream, n_experts) for stream in streams]


def sequence_curves(sequences, layers: Sequence[int], n_experts: int) -> list[list[int]]:
    """hit_curves of traced sequences (cache.trace's: each token's experts per layer) at each of `layers`, the
    sequences' lookups in their order."""
    return hit_curves([[token[layer] for s in sequences for token in s.experts] for layer in layers], n_experts)


def _curve(stream: Sequence[Sequence[int]], n_experts: int) -> list[int]:
    order: list[int] = []  # the experts used so far, the least recently used first
    at_distance = [0] * (n_experts + 1)  # lookups per stack distance; n_experts: never used before
    for picked in stream:
        batch = set(picked)
        used = len(order)
        for expert in batch:
            try:
                at_distance[used - 1 - order.index(expert)] += 1
            except ValueError:
                at_distance[n_experts] += 1
        order = [e for e in order if e not in batch] + sorted(batch)
    return list(accumulate(at_distance[:n_experts]))


def check_curves(curves, n_layers: int, n_experts: int) -> str | None:
    """What is wrong with curves read from a file, or None."""
    if not isinstance(curves, list) or len(curves) != n_layers:
        return f"must be {n_layers} lists (layers) of {n_experts} hit counts (capacities 1..{n_experts})"
    for curve in curves:
        if (not isinstance(curve, list) or len(curve) != n_experts
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in curve)):
            return f"must be {n_layers} lists (layers) of {n_experts} non-negative integers"
        if any(b < a for a, b in zip(curve, curve[1:])):
            return "hit counts must not fall as the capacity grows"
    return None


def split_rows(curves: Sequence[Sequence[int]], total: int, floor: int, most: int) -> list[int]:
    """Rows per layer, each in floor..most, `total` in all (capped at what the layers can hold): the floor each,
    then the rest by lookahead over the curves (hits[c - 1] at c rows). Ties go to the layer holding fewer rows
    (then the lower layer), so curves that gain alike split alike."""
    n = len(curves)
    if not 1 <= floor <= most:
        raise ValueError(f"a layer needs {floor} rows but may hold only {most}")
    if total < floor * n:
        raise ValueError(f"{total} rows cannot give each of {n} layers the {floor} a token needs")
    hits = [np.asarray(c, dtype=np.float64) for c in curves]
    rows = [floor] * n
    left = min(total, most * n) - floor * n
    while left > 0:
        best = None
        for layer in range(n):
            extra = min(most - rows[layer], left)
            if extra <= 0:
                continue
            at = rows[layer]
            # Hits gained per row by k more rows, k = 1..extra; the k of the best rate (the smallest at a tie).
            rates = (hits[layer][at:at + extra] - hits[layer][at - 1]) / np.arange(1, extra + 1)
            k = int(np.argmax(rates))
            key = (-rates[k], rows[layer], layer)
            if best is None or key < best[0]:
                best = (key, layer, k + 1)
        _, layer, k = best
        # A layer no row gains anything takes one row at a time, so that the rest spreads evenly.
        k = 1 if best[0][0] == 0 else k
        rows[layer] += k
        left -= k
    return rows
