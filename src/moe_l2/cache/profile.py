"""Domain profiles: what routing traces (or a daemon's online statistics) say about a model's experts.

A profile is one JSON file (``moe-l2 profile --traces FILE... --out P.json``), format ``moe-l2-profile``
version 1::

    {
      "format": "moe-l2-profile", "version": 1,
      "model": "gpt-oss-20b", "n_layers": 24, "n_experts": 32, "top_k": 4,
      "sources": ["gpt-oss-20b.jsonl.gz"],            # traces or "daemon:<socket>" it was built from
      "domains": {                                    # one entry per domain label of the traces
        "math": {"sequences": 23, "tokens": 6539,
                 "counts": [[...n_experts ints...], ...one list per layer]},   # router picks per expert
        ...
      },
      "unlabelled": {"sequences": 0, "tokens": 0, "counts": [[...]]},          # traffic without a domain
      "backbone": [[3, 17], ...],       # per layer: experts hot in every domain (derived, informative)
      "specificity": [0.08, ...],       # per layer: I(domain; expert) / H(expert), 0..1 (derived)
      "predictor": {"kind": "naive-bayes", "alpha": 0.1, "docs": {...}, "counts": {...}} or null,
      "l0_curves": [[...n_experts ints...], ...one list per layer] or absent   # LRU hits at 1..n_experts rows
    }

``l0_curves`` (from traces only: a daemon's counts have no order) are each layer's LRU hit curve over the traces'
lookups, from which a process splits its L0 rows among its layers (src/moe_l2/cache/ceilings.py; the option
``l0_ceilings``); older profiles without them load as before.

The predictor may instead be ``{"kind": "embedding", "encoder": "all-MiniLM-L6-v2", "temperature": 0.05,
"docs": {...}, "centroids": {domain: [384 floats]}}`` (``moe-l2 profile --predictor embedding``; predicting
with it needs the ``embed`` extra, see src/moe_l2/cache/embedding.py).

Counts are the source of truth (they add up across traces and daemons); ``backbone`` and ``specificity`` are
recomputed from them on load and written for people and other tools:

- an expert's *share* at a layer is its count over the layer's picks (so shares sum to 1 per layer);
- *backbone*: experts whose share is at least ``BACKBONE_FACTOR`` times the uniform share ``1/n_experts``
  in every domain with at least ``MIN_DOMAIN_TOKENS`` tokens;
- *specificity*: the mutual information between the domain and the picked expert, divided by the entropy
  of the picked expert; 0 when the domain does not change the layer's routing.

On a ``hint`` the daemon predicts the domain (or takes the one given; a prediction below ``MIN_CONFIDENCE``
changes nothing) and points every layer's store at it (`moe_l2.cache.store.LayerStore.apply_hint`): it pins
the domain's most frequent experts that are specific to it, loads them, and adds the domain's shares to the
eviction policy's scores.
docs/policy-report.md measures each part.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from moe_l2.atomic_file import AtomicFile

from moe_l2.cache.ceilings import check_curves, sequence_curves, split_rows
from moe_l2.cache.embedding import EmbeddingCentroid
from moe_l2.cache.prediction import NaiveBayes, Prediction, PredictorError

FORMAT = "moe-l2-profile"
VERSION = 1
BACKBONE_FACTOR = 1.5
MIN_DOMAIN_TOKENS = 32
# A prediction below this confidence changes nothing: the daemon keeps its current pins.
MIN_CONFIDENCE = 0.35


class ProfileError(ValueError):
    """A profile that cannot be used: names the file and what is wrong."""


# The predictor kinds a profile can hold. Importing the embedding one is cheap: its encoder and the encoder's
# heavy dependencies load only when it trains or predicts.
_PREDICTORS = {NaiveBayes.kind: NaiveBayes, EmbeddingCentroid.kind: EmbeddingCentroid}
KINDS = tuple(_PREDICTORS)


def predictor_class(kind: str):
    """The predictor class of a kind."""
    if kind not in _PREDICTORS:
        raise PredictorError(f"unknown predictor kind {kind!r} (known: {', '.join(KINDS)})")
    return _PREDICTORS[kind]


def train_predictor(examples: Iterable[tuple[str, str]], kind: str = NaiveBayes.kind):
    return predictor_class(kind).train(examples)


def predictor_from_json(data):
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind not in KINDS:
        raise PredictorError(f"unknown predictor kind {kind if kind is not None else data!r} "
                             f"(known: {', '.join(KINDS)})")
    return predictor_class(kind).from_json(data)


def _zeros(n_layers: int, n_experts: int) -> list[list[int]]:
    return [[0] * n_experts for _ in range(n_layers)]


@dataclass
class DomainStats:
    sequences: int = 0
    tokens: int = 0
    counts: list[list[int]] = field(default_factory=list)


@dataclass
class Profile:
    model: str
    n_layers: int
    n_experts: int
    top_k: int
    domains: dict[str, DomainStats] = field(default_factory=dict)
    unlabelled: DomainStats | None = None
    predictor: NaiveBayes | EmbeddingCentroid | None = None
    sources: list[str] = field(default_factory=list)
    path: str = ""
    l0_curves: list[list[int]] | None = None  # per layer: LRU hits at 1..n_experts rows (ceilings.sequence_curves)

    def __post_init__(self) -> None:
        if self.unlabelled is None:
            self.unlabelled = DomainStats(0, 0, _zeros(self.n_layers, self.n_experts))
        self._derive()

    # ---- building -------------------------------------------------------------------------------------

    @classmethod
    def empty(cls, model: str, n_layers: int, n_experts: int, top_k: int) -> "Profile":
        return cls(model, n_layers, n_experts, top_k)

    def stats_for(self, domain: str | None) -> DomainStats:
        if not domain:
            return self.unlabelled
        if domain not in self.domains:
            self.domains[domain] = DomainStats(0, 0, _zeros(self.n_layers, self.n_experts))
        return self.domains[domain]

    def add_sequence(self, experts, domain: str | None) -> None:
        """Count one sequence's routing (experts[t][l] -> ids); call `refresh()` after a batch of these."""
        stats = self.stats_for(domain)
        stats.sequences += 1
        stats.tokens += len(experts)
        counts = stats.counts
        for token in experts:
            for layer, picked in enumerate(token):
                row = counts[layer]
                for e in picked:
                    row[e] += 1

    def add_counts(self, domain: str | None, counts: list[list[int]], tokens: int = 0) -> None:
        stats = self.stats_for(domain)
        stats.tokens += tokens
        for layer, row in enumerate(counts):
            acc = stats.counts[layer]
            for e, n in enumerate(row):
                acc[e] += n

    @classmethod
    def from_traces(cls, traces, *, predictor: bool | str = True) -> "Profile":
        """A profile from a moe_l2.cache.trace.TraceSet (or any iterable of TraceSequence of one model). `predictor`:
        False for none, True for the default (naive Bayes) or a kind of `KINDS`."""
        sequences = list(getattr(traces, "sequences", traces))
        if not sequences:
            raise ProfileError("no sequences to build a profile from")
        first = sequences[0]
        profile = cls(first.model, first.n_layers, first.n_experts, first.top_k,
                      sources=[os.path.basename(p) for p in getattr(traces, "paths", [])])
        for s in sequences:
            profile.add_sequence(s.experts, s.domain)
        profile.l0_curves = sequence_curves(sequences, range(first.n_layers), first.n_experts)
        if predictor:
            examples = [(s.prompt, s.domain) for s in sequences if s.prompt and s.domain]
            if len({d for _, d in examples}) >= 2:
                kind = predictor if isinstance(predictor, str) else NaiveBayes.kind
                profile.predictor = train_predictor(examples, kind)
        profile.refresh()
        return profile

    def refresh(self) -> None:
        self._derive()

    # ---- derived numbers -----------------------------------------------------------------------------

    def _derive(self) -> None:
        L, E = self.n_layers, self.n_experts
        overall = _zeros(L, E)
        for stats in (*self.domains.values(), self.unlabelled):
            for layer in range(L):
                row, acc = stats.counts[layer], overall[layer]
                for e in range(E):
                    acc[e] += row[e]
        self._overall = overall
        big = {d: s for d, s in self.domains.items() if s.tokens >= MIN_DOMAIN_TOKENS and any(map(any, s.counts))}
        self.backbone: list[list[int]] = []
        self.specificity: list[float] = []
        for layer in range(L):
            shares = {d: _shares(s.counts[layer]) for d, s in big.items()}
            if shares:
                self.backbone.append([e for e in range(E)
                                      if all(sh[e] >= BACKBONE_FACTOR / E for sh in shares.values())])
            else:
                self.backbone.append([])
            self.specificity.append(_specificity([s.counts[layer] for s in big.values()]))

    @property
    def domain_names(self) -> list[str]:
        return sorted(self.domains)

    def shares(self, domain: str | None, layer: int) -> list[float]:
        """Share of the layer's picks per expert, for a domain (None: all traffic)."""
        if domain is None:
            return _shares(self._overall[layer])
        if domain not in self.domains:
            raise ProfileError(f"profile {self.path or self.model} has no domain {domain!r}; it knows "
                               f"{', '.join(self.domain_names) or 'none'}")
        return _shares(self.domains[domain].counts[layer])

    def lift(self, domain: str, layer: int) -> list[float]:
        """Per expert: its share of the domain's picks over its share of all other traffic's picks (inf when
        only the domain uses it, 1.0 when it is used alike, 0 when the domain never picks it)."""
        own = self.domains[domain].counts[layer] if domain in self.domains else None
        if own is None:
            raise ProfileError(f"profile {self.path or self.model} has no domain {domain!r}")
        rest = [a - b for a, b in zip(self._overall[layer], own)]
        own_share, rest_share = _shares(own), _shares(rest)
        if not any(rest):
            return [1.0 if x > 0 else 0.0 for x in own_share]
        return [(o / r if r > 0 else (math.inf if o > 0 else 0.0)) for o, r in zip(own_share, rest_share)]

    def top_experts(self, domain: str | None, layer: int, n: int) -> list[int]:
        shares = self.shares(domain, layer)
        ranked = sorted(range(self.n_experts), key=lambda e: (-shares[e], e))
        return [e for e in ranked[:max(0, n)] if shares[e] > 0]

    def l0_ceilings(self, layers: list[int], slots: int) -> dict[int, int]:
        """MoE layer -> its L0 rows: the `slots` per layer that a process' budget gives each of `layers`, split
        among them where the hit curves gain most (each at least top_k, at most n_experts)."""
        if self.l0_curves is None:
            raise ProfileError(f"profile {self.path or self.model} has no L0 hit curves (it was built from a "
                               "daemon's counts, or by an older moe-l2): rebuild it with moe-l2 profile --traces")
        rows = split_rows([self.l0_curves[layer] for layer in layers], slots * len(layers), self.top_k,
                          self.n_experts)
        return dict(zip(layers, rows))

    def predict(self, text: str) -> Prediction:
        if self.predictor is None:
            raise PredictorError(f"profile {self.path or self.model} has no predictor (its traces had no "
                                 "prompts with domain labels); hint with a domain name instead")
        return self.predictor.predict(text)

    # ---- file format -----------------------------------------------------------------------------------

    def to_json(self) -> dict:
        def stats(s: DomainStats) -> dict:
            return {"sequences": s.sequences, "tokens": s.tokens, "counts": s.counts}

        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "n_layers": self.n_layers,
            "n_experts": self.n_experts, "top_k": self.top_k, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime()),
            "sources": self.sources,
            "domains": {d: stats(s) for d, s in sorted(self.domains.items())},
            "unlabelled": stats(self.unlabelled),
            "backbone": self.backbone,
            "specificity": [round(x, 6) for x in self.specificity],
            "predictor": self.predictor.to_json() if self.predictor else None,
            **({"l0_curves": self.l0_curves} if self.l0_curves is not None else {}),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Atomically, under a private name: --out may lie in a directory others can write (atomic_file.py)."""
        with AtomicFile(path) as f:
            f.write((json.dumps(self.to_json(), separators=(",", ":")) + "\n").encode())
        self.path = str(path)

    @classmethod
    def from_json(cls, data, where: str = "profile") -> "Profile":
        def fail(why: str):
            raise ProfileError(f"{where}: {why}")

        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            fail(f"not a moe-l2 profile (no \"format\": \"{FORMAT}\"); make one with moe-l2 profile")
        if data.get("version") != VERSION:
            fail(f"profile version {data.get('version')!r} is not supported; this moe-l2 reads version {VERSION}"
                 " (rebuild it with this release's moe-l2 profile)")
        dims = {}
        for key in ("n_layers", "n_experts", "top_k"):
            v = data.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(f"{key} must be a positive integer, got {v!r}")
            dims[key] = v
        model = data.get("model")
        if not isinstance(model, str):
            fail("model must be a string")
        L, E = dims["n_layers"], dims["n_experts"]

        def stats(obj, name: str) -> DomainStats:
            if not isinstance(obj, Mapping):
                fail(f"{name} must be an object with sequences, tokens and counts")
            seqs, toks, counts = obj.get("sequences", 0), obj.get("tokens", 0), obj.get("counts")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (seqs, toks)):
                fail(f"{name}: sequences and tokens must be non-negative integers")
            if (not isinstance(counts, list) or len(counts) != L
                    or not all(isinstance(row, list) and len(row) == E for row in counts)):
                fail(f"{name}: counts must be {L} lists (layers) of {E} integers (experts)")
            for row in counts:
                for n in row:
                    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                        fail(f"{name}: counts must be non-negative integers, found {n!r}")
            return DomainStats(seqs, toks, [list(r) for r in counts])

        domains = data.get("domains", {})
        if not isinstance(domains, Mapping):
            fail("domains must map a domain name to its counts")
        parsed = {str(d): stats(s, f"domain {d!r}") for d, s in domains.items()}
        unlabelled = stats(data["unlabelled"], "unlabelled") if data.get("unlabelled") is not None else None
        predictor = None
        if data.get("predictor") is not None:
            try:
                predictor = predictor_from_json(data["predictor"])
            except PredictorError as exc:
                fail(str(exc))
        curves = data.get("l0_curves")
        if curves is not None and (why := check_curves(curves, L, E)):
            fail(f"l0_curves {why}")
        sources = data.get("sources", [])
        return cls(model, L, E, dims["top_k"], parsed, unlabelled, predictor,
                   [str(s) for s in sources] if isinstance(sources, list) else [], where, curves)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ProfileError(f"profile {path} is not UTF-8 text (a JSON file from moe-l2 profile)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        profile = cls.from_json(data, str(path))
        profile.path = str(path)
        return profile

    def check_model(self, n_layers: int, n_experts: int, what: str) -> None:
        if (self.n_layers, self.n_experts) != (n_layers, n_experts):
            raise ProfileError(f"profile {self.path or self.model} describes {self.model} with {self.n_layers} "
                               f"layers x {self.n_experts} experts, but {what} has {n_layers} x {n_experts}")


def _shares(row: list[int]) -> list[float]:
    total = sum(row)
    return [n / total for n in row] if total else [0.0] * len(row)


def _entropy(row: Iterable[float]) -> float:
    return -sum(p * math.log(p) for p in row if p > 0)


def _specificity(rows: list[list[int]]) -> float:
    """I(domain; expert) / H(expert) for the per-domain count rows of one layer."""
    if len(rows) < 2:
        return 0.0
    totals = [sum(r) for r in rows]
    grand = sum(totals)
    if not grand:
        return 0.0
    merged = [sum(col) for col in zip(*rows)]
    h = _entropy(n / grand for n in merged)
    if h <= 0:
        return 0.0
    h_cond = sum(t / grand * _entropy(n / t for n in r) for r, t in zip(rows, totals) if t)
    return max(0.0, min(1.0, (h - h_cond) / h))
