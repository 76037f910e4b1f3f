"""Profiles: built from traces, written and read back, derived numbers, clear errors for bad files."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_l2.cli import profile as profile_cmd
from moe_l2.cache.profile import Profile, ProfileError
from moe_l2.cache.trace import read_traces

from .conftest import synthetic_trace



def build(tmp_path, **kw) -> Profile:
    return Profile.from_traces(read_traces(synthetic_trace(tmp_path / "t.jsonl.gz", **kw)))


def test_round_trip_keeps_counts_derived_numbers_and_predictions(tmp_path):
    profile = build(tmp_path, n_experts=16, seqs=6, tokens=30)
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.to_json() | {"created": 0} == profile.to_json() | {"created": 0}
    assert again.domain_names == ["alpha", "beta"]
    assert again.domains["alpha"].sequences == 3 and again.domains["alpha"].tokens == 90
    for text in ("the derivative of an integral", "the plaintiff sued over the contract", "zzz"):
        assert again.predict(text) == profile.predict(text)
    # Every pick is counted once: top_k picks per token and layer.
    assert sum(map(sum, again.domains["beta"].counts)) == 90 * 2 * 2


def test_specificity_and_backbone(tmp_path):
    profile = build(tmp_path, n_experts=16, seqs=6, tokens=60)
    # The two domains route to disjoint halves: the domain explains much of the expert's entropy.
    assert all(0.15 < s <= 1 for s in profile.specificity), profile.specificity  # at most log 2 / log 16
    assert profile.backbone == [[], []]  # nothing is hot in both halves
    assert profile.top_experts("alpha", 0, 3) and all(e < 8 for e in profile.top_experts("alpha", 0, 3))
    # One routing for every domain: no specificity, and the hot experts are the backbone.
    same = Profile.empty("m", 1, 4, 1)
    same.add_counts("a", [[50, 50, 1, 1]], tokens=102)
    same.add_counts("b", [[50, 50, 1, 1]], tokens=102)
    same.refresh()
    assert same.specificity == [0.0] and same.backbone == [[0, 1]]
    shares = same.shares(None, 0)
    assert abs(sum(shares) - 1) < 1e-9 and shares[0] == shares[1]


def test_unknown_domain_and_missing_predictor(tmp_path):
    profile = Profile.empty("m", 1, 4, 1)
    with pytest.raises(ProfileError, match="no domain 'x'"):
        profile.shares("x", 0)
    with pytest.raises(ValueError, match="no predictor"):
        profile.predict("hello")


def good_json(tmp_path) -> dict:
    return build(tmp_path, seqs=2, tokens=4).to_json()


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(format="x"), "not a moe-l2 profile"),
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d.update(n_layers=0), "n_layers must be a positive integer"),
    (lambda d: d["domains"]["alpha"].update(counts=[[1, 2]]), "counts must be 2 lists (layers) of 8 integers"),
    (lambda d: d["domains"]["alpha"]["counts"][0].__setitem__(0, -1), "non-negative integers, found -1"),
    (lambda d: d["domains"]["alpha"].update(tokens="many"), "non-negative integers"),
    (lambda d: d.update(domains=[1]), "domains must map"),
    (lambda d: d.update(predictor={"kind": "magic"}), "unknown predictor kind 'magic'"),
    (lambda d: d["predictor"].update(counts={"alpha": {"x": -2}}), "predictor counts"),
])
def test_bad_profiles_get_clear_errors(tmp_path, change, words):
    data = good_json(tmp_path)
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        Profile.load(path)
    assert words in str(info.value) and str(path) in str(info.value)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "absent.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProfileError, match="not UTF-8"):
        Profile.load(tmp_path / "bin.json")
    (tmp_path / "cut.json").write_text('{"format": "moe-l2-profile", ')
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.load(tmp_path / "cut.json")


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    return profile_cmd.run(parser.parse_args(list(argv)))


def test_profile_command(tmp_path, capsys):
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", n_experts=16, seqs=4, tokens=20)
    out = tmp_path / "p.json"
    assert run_cli("--traces", str(trace), "--out", str(out)) == 0
    text = capsys.readouterr().out
    assert "2 domains" in text and "specificity per layer" in text and f"wrote {out}" in text
    assert Profile.load(out).predictor is not None
    assert run_cli("--show", str(out), "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "moe-l2-profile" and data["version"] == 1 and len(data["specificity"]) == 2
    assert run_cli("--traces", str(trace), "--out", str(out), "--no-predictor") == 0
    assert Profile.load(out).predictor is None


def test_profile_command_errors(tmp_path, capsys):
    assert run_cli("--traces", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path / "p.json")) == 1
    assert "cannot read trace" in capsys.readouterr().err
    trace = synthetic_trace(tmp_path / "t.jsonl.gz", seqs=2, tokens=3)
    assert run_cli("--traces", str(trace)) == 2
    assert "--out P.json is required" in capsys.readouterr().err
    assert run_cli("--traces", str(trace), "--out", str(tmp_path / "no" / "dir" / "p.json")) == 1
    assert "cannot write" in capsys.readouterr().err
    assert run_cli("--from-daemon", "--socket", "ipc:///nonexistent/sock", "--timeout", "0.3",
                   "--out", str(tmp_path / "p.json")) == 1
    assert "no moe-l2d at ipc:///nonexistent/sock" in capsys.readouterr().err
