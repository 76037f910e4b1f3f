"""What a replay measured (`moe_l2.cache.replay`): per capacity, each policy's hits, loads and bytes against
Belady's MIN, and each next-layer predictor's; `Tally` sums a replay's per-layer task results into them."""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, fields, replace

from moe_l2.cache.score import Score


def _rate(hits: int, lookups: int) -> float | None:
    return hits / lookups if lookups else None


def gap_closed(hits: float, lru: float, ceiling: float) -> float | None:
    """The share of LRU's distance to MIN a policy covers, from the three's hits (or hit rates) on one stream; None
    where MIN does no better than LRU."""
    return (hits - lru) / (ceiling - lru) if ceiling > lru else None


@dataclass(frozen=True)
class _Lookups:
    """Lookups over the replayed layers, and of them the hits; to_json leads with the hit rate."""

    hits: int
    lookups: int

    @property
    def hit_rate(self) -> float | None:
        return _rate(self.hits, self.lookups)

    def to_json(self) -> dict:
        return {"hit_rate": self.hit_rate, **asdict(self)}


@dataclass(frozen=True)
class PolicyResult(_Lookups):
    """One policy at one capacity, over the replayed layers."""

    loads: int
    preloads: int                     # loads a hint made before its sequence, or a restart (--warm) before all
    per_layer: list[float | None]     # each replayed layer's hit rate, in ReplayResult.layers' order
    records_per_token: float | None   # loads per token over all layers
    switch_hit_rate: float | None = None  # over the tokens after domain switches (the policy under test and LRU)
    misses_vs_min: float | None = None    # loads against Belady's MIN's at the same capacity
    bytes_per_token: float | None = None  # records_per_token times the record's bytes, where known


@dataclass(frozen=True)
class PrefetchResult(_Lookups):
    """The policy under test at one capacity with a next-layer predictor's guesses loaded ahead."""

    loads: int                         # demand loads
    prefetch_loads: int
    useful: int                        # prefetched experts demanded before their eviction
    wasted: int                        # prefetched experts evicted undemanded
    records_per_token: float | None    # demand loads and prefetches per token over all layers
    records_vs_demand: float | None    # against the demand policy's records_per_token
    per_layer: list[float | None]


@dataclass(frozen=True)
class CapacityResult:
    """Every policy (and prefetch predictor) at one capacity."""

    slots: int                             # expert slots per layer
    share: float                           # of the layer's experts
    policies: dict[str, PolicyResult]      # the policy under test first, then the comparisons and "min"
    prefetch: dict[str, PrefetchResult]    # per predictor (--prefetch)
    gap_closed_vs_lru: float | None = None  # the share of LRU's distance to MIN the policy under test covers

    def to_json(self) -> dict:
        return {"slots": self.slots, "share": self.share,
                "policies": {name: r.to_json() for name, r in self.policies.items()},
                "prefetch": {name: r.to_json() for name, r in self.prefetch.items()},
                "gap_closed_vs_lru": self.gap_closed_vs_lru}


@dataclass(frozen=True)
class ReplayResult:
    """What `replay` measured, and the run's settings (to_json: `moe-l2 replay --json`'s object)."""

    traces: list[str]
    model: str
    n_layers: int
    n_experts: int
    top_k: int
    sequences: int                   # scored (with --prefetch: those the predictors did not learn from)
    tokens: int
    order: str
    seed: int
    policy: str
    compare: list[str]               # the other policies run, "min" included
    profile: str | None
    hints: str | None                # None, "prompt" or "oracle"
    hint_stats: dict | None          # hints_sent, confident, predicted_correctly (plan_hints)
    prior: float
    hint_share: float
    hint_prior: float
    hint_lift: float
    layers: list[int]
    switch_window: int               # tokens after a domain switch that switch_hit_rate covers
    domain_switches: int
    capacities: list[CapacityResult]
    prefetch: list[str]              # the predictors scored
    prefetch_k: int | None           # their guesses per token and layer
    trained_on: dict                 # sequences and tokens the predictors, ceilings and --warm learned from
    ceilings: dict[int, list[int]]   # --ceilings: per capacity (slots), each replayed layer's slots
    autopin: bool                    # --autopin: "<policy>+autopin" and "lru+autopin" were run
    prefetch_scores: dict[str, Score]
    processes: int = 1               # clients taking turns token by token
    record_bytes: int | None = None  # one expert's record, for bytes per token
    warm: bool = False               # the policies were restarted after the trained_on sequences

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["capacities"] = [c.to_json() for c in self.capacities]
        out["ceilings"] = {str(slots): rows for slots, rows in self.ceilings.items()}
        out["prefetch_scores"] = {name: score.as_dict() for name, score in self.prefetch_scores.items()}
        return out


@dataclass
class Tally:
    """A replay's task results, summed per capacity and policy over the replayed layers."""

    tasks: list               # the replay.Task of each result
    results: list[dict]
    names: list[str]          # the policies and variants reported
    policy: str               # the one under test
    layers: list[int]
    streams: dict             # per layer, the token batches
    prefetch: tuple[str, ...]
    n_tokens: int
    starts: list[int]         # domain switches (_domain_starts)
    switch_window: int
    record_bytes: int | None

    def __post_init__(self) -> None:
        self.by_key = {(t.point or t.slots, r["policy"], r["layer"]): r for t, r in zip(self.tasks, self.results)}

    def _layers(self, n_slots: int, name: str) -> list[dict]:
        return [self.by_key[(n_slots, name, layer)] for layer in self.layers]

    def capacity(self, n_slots: int, n_experts: int) -> CapacityResult:
        policies = {name: self._policy(self._layers(n_slots, name)) for name in self.names}
        floor = policies["min"].loads if "min" in policies else 0
        for name, r in policies.items():
            policies[name] = replace(r, misses_vs_min=r.loads / floor if floor else None,
                                     bytes_per_token=None if self.record_bytes is None or r.records_per_token is None
                                     else r.records_per_token * self.record_bytes)
        demand = policies[self.policy].records_per_token
        ahead = {name: self._prefetch(self._layers(n_slots, f"prefetch:{name}"), demand) for name in self.prefetch}
        p, base, ceiling = (policies[n].hit_rate if n in policies else None for n in (self.policy, "lru", "min"))
        gap = None
        if None not in (p, base, ceiling) and self.policy != "lru":
            gap = gap_closed(p, base, ceiling)
        return CapacityResult(n_slots, n_slots / n_experts, policies, ahead, gap)

    def _policy(self, rs: list[dict]) -> PolicyResult:
        loads = sum(r["loads"] for r in rs)
        return PolicyResult(
            hits=sum(r["hits"] for r in rs), lookups=sum(r["lookups"] for r in rs), loads=loads,
            preloads=sum(r["preloads"] for r in rs), per_layer=[_rate(r["hits"], r["lookups"]) for r in rs],
            records_per_token=loads / self.n_tokens if self.n_tokens else None,
            switch_hit_rate=self._switch_hit_rate(rs) if rs[0]["per_token"] is not None else None)

    def _switch_hit_rate(self, rs: list[dict]) -> float | None:
        """The hit rate of the first switch_window tokens after each domain switch."""
        total = array("l", [0]) * self.n_tokens
        for r in rs:
            per = array("H")
            per.frombytes(r["per_token"])
            for i, h in enumerate(per):
                total[i] += h
        hits = lookups = 0
        for start in self.starts:
            for i in range(start, min(start + self.switch_window, self.n_tokens)):
                hits += total[i]
                lookups += sum(len(self.streams[layer][i]) for layer in self.layers)
        return _rate(hits, lookups)

    def _prefetch(self, rs: list[dict], demand: float | None) -> PrefetchResult:
        loaded = sum(r["loads"] + r["prefetch_loads"] for r in rs)
        per_token = loaded / self.n_tokens if self.n_tokens else None
        return PrefetchResult(
            hits=sum(r["hits"] for r in rs), lookups=sum(r["lookups"] for r in rs),
            loads=sum(r["loads"] for r in rs), prefetch_loads=sum(r["prefetch_loads"] for r in rs),
            useful=sum(r["useful"] for r in rs), wasted=sum(r["wasted"] for r in rs),
            records_per_token=per_token, records_vs_demand=per_token / demand if demand else None,
            per_layer=[_rate(r["hits"], r["lookups"]) for r in rs])
