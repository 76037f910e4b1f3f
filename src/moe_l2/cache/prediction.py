"""Name the domain of a prompt from its text alone.

The default backend is a multinomial naive Bayes classifier over word unigrams and bigrams: no dependency,
trained in milliseconds from the prompts of labelled traces, stored inside the profile (per-domain feature
counts), predicting in well under a millisecond. Its confidence is the posterior probability of the named
domain, computed from the log-likelihoods divided by a temperature (the average number of features of a
prompt, so that long prompts do not make it overconfident).

An embedding backend (sentence embeddings + nearest centroid, kind "embedding") is optional, behind the
``embed`` extra: see `moe_l2.cache.embedding`, which shares `Prediction` and `PredictorError` from here. The
kinds a profile can hold, and which class reads each, are listed in `moe_l2.cache.profile` (`KINDS`,
`train_predictor`, `predictor_from_json`), the one module that imports both backends.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
MAX_FEATURES = 20000
MIN_DOC_FREQ = 2


def features(text: str) -> list[str]:
    """Lower-cased words and adjacent word pairs."""
    words = _WORD.findall(text.lower())
    return words + [f"{a} {b}" for a, b in zip(words, words[1:])]


@dataclass(frozen=True)
class Prediction:
    domain: str | None
    confidence: float
    scores: dict[str, float] = field(default_factory=dict)  # posterior per domain

    def to_json(self) -> dict:
        return {"domain": self.domain, "confidence": self.confidence, "scores": self.scores}


class PredictorError(ValueError):
    pass


class NaiveBayes:
    """Multinomial naive Bayes with Laplace smoothing; the counts are the whole model (mergeable)."""

    kind = "naive-bayes"

    def __init__(self, counts: Mapping[str, Mapping[str, int]] | None = None,
                 docs: Mapping[str, int] | None = None, alpha: float = 0.1):
        self.counts: dict[str, dict[str, int]] = {d: dict(c) for d, c in (counts or {}).items()}
        self.docs: dict[str, int] = dict(docs or {})
        self.alpha = alpha
        self._prepare()

    @classmethod
    def train(cls, examples: Iterable[tuple[str, str]], *, max_features: int = MAX_FEATURES,
              min_doc_freq: int = MIN_DOC_FREQ, alpha: float = 0.1) -> "NaiveBayes":
        """examples: (text, domain) pairs. Keeps the features seen in at least `min_doc_freq` prompts (the
        most frequent `max_features` of them), so that a profile does not carry every rare word."""
        per_doc: list[tuple[str, Counter]] = [(d, Counter(features(t))) for t, d in examples if t and d]
        doc_freq = Counter(f for _, c in per_doc for f in c)
        kept = {f for f, n in doc_freq.most_common(max_features) if n >= min_doc_freq}
        counts: dict[str, Counter] = {}
        docs: Counter = Counter()
        for domain, c in per_doc:
            docs[domain] += 1
            bucket = counts.setdefault(domain, Counter())
            for f, n in c.items():
                if f in kept:
                    bucket[f] += n
        return cls(counts, docs, alpha)

    def add(self, text: str, domain: str) -> None:
        """Online update: one more labelled prompt (features outside the vocabulary are ignored)."""
        bucket = self.counts.setdefault(domain, {})
        for f in features(text):
            if f in self._vocab or not self._vocab:
                bucket[f] = bucket.get(f, 0) + 1
        self.docs[domain] = self.docs.get(domain, 0) + 1
        self._prepare()

    def _prepare(self) -> None:
        self._vocab = {f for c in self.counts.values() for f in c}
        v = max(1, len(self._vocab))
        n_docs = sum(self.docs.values())
        self._domains = sorted(self.counts)
        self._log_prior = {d: math.log((self.docs.get(d, 0) + 1) / (n_docs + len(self.counts)))
                           for d in self._domains}
        self._total = {d: sum(c.values()) + self.alpha * v for d, c in self.counts.items()}
        # Per feature, its log-probability under each domain (domains in sorted order), so that a prediction
        # is one vector addition per distinct feature of the prompt.
        log_total = [math.log(self._total[d]) for d in self._domains]
        self._logp = {f: [math.log(self.counts[d].get(f, 0) + self.alpha) - lt
                          for d, lt in zip(self._domains, log_total)] for f in self._vocab}

    @property
    def domains(self) -> list[str]:
        return sorted(self.counts)

    def predict(self, text: str) -> Prediction:
        if not self.counts:
            raise PredictorError("the predictor has no training data (the profile's traces had no prompts)")
        found = Counter(f for f in features(text or "") if f in self._vocab)
        if not found:
            # Nothing known in the text: fall back on the priors, with the confidence they deserve.
            loglik = dict(self._log_prior)
            temperature = 1.0
        else:
            sums = [self._log_prior[d] for d in self._domains]
            logp = self._logp
            for f, n in found.items():
                for i, x in enumerate(logp[f]):
                    sums[i] += n * x
            loglik = dict(zip(self._domains, sums))
            temperature = max(1.0, math.sqrt(sum(found.values())))
        top = max(loglik.values())
        weights = {d: math.exp((v - top) / temperature) for d, v in loglik.items()}
        norm = sum(weights.values())
        posterior = {d: w / norm for d, w in sorted(weights.items())}
        best = max(posterior, key=posterior.get)
        return Prediction(best, posterior[best], posterior)

    def to_json(self) -> dict:
        return {"kind": self.kind, "alpha": self.alpha, "docs": self.docs, "counts": self.counts}

    @classmethod
    def from_json(cls, data: Mapping) -> "NaiveBayes":
        if not isinstance(data, Mapping) or data.get("kind") != cls.kind:
            raise PredictorError(f"unknown predictor kind {data.get('kind') if isinstance(data, Mapping) else data!r}")
        counts, docs = data.get("counts", {}), data.get("docs", {})
        if not isinstance(counts, Mapping) or not all(
                isinstance(c, Mapping) and all(isinstance(n, int) and n >= 0 for n in c.values())
                for c in counts.values()):
            raise PredictorError("predictor counts must map domain -> feature -> non-negative integer")
        if not isinstance(docs, Mapping) or not all(isinstance(n, int) and n >= 0 for n in docs.values()):
            raise PredictorError("predictor docs must map domain -> non-negative integer")
        alpha = data.get("alpha", 0.1)
        if not isinstance(alpha, (int, float)) or alpha <= 0:
            raise PredictorError("predictor alpha must be a positive number")
        return cls(counts, docs, float(alpha))


def cross_validate(examples: list[tuple[str, str]], folds: int = 5, *, group=None, seed: int = 0,
                   train=NaiveBayes.train) -> dict:
    """Accuracy of `train` on held-out prompts: examples are split into `folds` folds (whole groups at a
    time when `group(i)` names each example's group), each fold predicted by a model trained on the rest."""
    import random

    n = len(examples)
    if n < 2:
        raise PredictorError("cross-validation needs at least two labelled prompts")
    keys = [group(i) if group else i for i in range(n)]
    unique = sorted(set(keys), key=str)
    random.Random(seed).shuffle(unique)
    fold_of_key = {k: i % folds for i, k in enumerate(unique)}
    correct = 0
    per_domain: dict[str, list[int]] = {}
    confusion: dict[str, Counter] = {}
    confident = [0, 0]  # predictions with confidence >= 0.5: [count, correct]
    for fold in range(folds):
        train_set = [examples[i] for i in range(n) if fold_of_key[keys[i]] != fold]
        test_idx = [i for i in range(n) if fold_of_key[keys[i]] == fold]
        if not test_idx or not train_set:
            continue
        model = train(train_set)
        for i in test_idx:
            text, truth = examples[i]
            p = model.predict(text)
            ok = p.domain == truth
            correct += ok
            per_domain.setdefault(truth, [0, 0])
            per_domain[truth][0] += 1
            per_domain[truth][1] += ok
            confusion.setdefault(truth, Counter())[p.domain] += 1
            if p.confidence >= 0.5:
                confident[0] += 1
                confident[1] += ok
    majority = Counter(d for _, d in examples).most_common(1)[0][1] / n
    return {
        "examples": n, "folds": folds, "accuracy": correct / n, "majority_baseline": majority,
        "per_domain": {d: {"n": v[0], "accuracy": v[1] / v[0]} for d, v in sorted(per_domain.items())},
        "confident_share": confident[0] / n,
        "confident_accuracy": confident[1] / confident[0] if confident[0] else None,
        "confusion": {d: dict(c) for d, c in sorted(confusion.items())},
    }
