"""Autopin: each layer's expert heat, and the hottest experts to pin so that a burst of cold ones cannot flush
them (docs/architecture.md, "Client pool (L0)"; docs/decisions.md, "Autopin, off by default"). The client's L0
pool (client/layerpool.py) and `moe-l2 replay --autopin` use the same `Heat`, so replay's figures are the pool's.

Heat is a count of the lookups (one per expert a lookup) that decays by half every `half_life` lookups of the
layer; it is counted from the experts the router picked, which the pool gets as a host list after the one sync
the streamed forward makes anyway, so counting costs no device sync. Every `every` lookups the hot set is
chosen again: the hottest experts, at most `limit` of them, each with at least `lift` times the heat an expert
would have if the layer's lookups were spread evenly. A flat layer pins nothing, and an expert that cools
below that is released at the next choice.
"""

from __future__ import annotations

import math

AUTOPIN_SHARE = 0.25   # pins take at most this share of a layer's ceiling (and leave top-k rows unpinned)
AUTOPIN_HALF_LIFE = 256
AUTOPIN_EVERY = 16
AUTOPIN_LIFT = 2.0


def pin_limit(ceiling: int, top_k: int, share: float = AUTOPIN_SHARE) -> int:
    """How many experts autopin may hold in a layer of `ceiling` rows: a share of them, leaving at least a
    token's experts to the rest."""
    return max(0, min(int(share * ceiling), ceiling - top_k))


class Heat:
    """One layer's decayed lookups per expert and the hot set chosen from them."""

    def __init__(self, n_experts: int, limit: int, *, half_life: float = AUTOPIN_HALF_LIFE,
                 every: int = AUTOPIN_EVERY, lift: float = AUTOPIN_LIFT):
        if limit < 0 or half_life <= 0 or every < 1 or lift <= 0:
            raise ValueError(f"autopin needs a limit of 0 or more, a half-life above 0, a period of 1 or more "
                             f"and a lift above 0; got {limit}, {half_life}, {every}, {lift}")
        self.n_experts, self.limit, self.every, self.lift = n_experts, limit, every, lift
        self._growth = math.exp(math.log(2) / half_life)  # the weight of a lookup grows instead of all decaying
        self._weight = 1.0
        self._heat = [0.0] * n_experts
        self._total = 0.0
        self._since = 0
        self.hot: frozenset[int] = frozenset()

    def add(self, experts) -> bool:
        """Count one lookup of each expert; True when the hot set was chosen again (read `hot`)."""
        heat, w = self._heat, self._weight
        for expert in experts:
            heat[expert] += w
        self._total += w * len(experts)
        self._weight = w * self._growth
        if self._weight > 1e100:  # rescale before the floats overflow; the ranking is unchanged
            scale = 1.0 / self._weight
            self._heat = [h * scale for h in heat]
            self._total *= scale
            self._weight = 1.0
        self._since += 1
        if self._since < self.every:
            return False
        self._since = 0
        self.hot = self._choose()
        return True

    def _choose(self) -> frozenset[int]:
        if not self.limit or not self._total:
            return frozenset()
        floor = self.lift * self._total / self.n_experts
        ranked = sorted(range(self.n_experts), key=self._heat.__getitem__, reverse=True)[:self.limit]
        return frozenset(e for e in ranked if self._heat[e] >= floor)
