"""Hints on a live daemon: predict the domain, preload its top experts, pin them while it is active."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from moe_l2 import protocol
from moe_l2.cache.policy import make_policy
from moe_l2.cache.profile import Profile
from moe_l2.cache.store import LayerStore
from moe_l2.cache.trace import read_traces
from moe_l2.client.connection import request

from .conftest import budget_for, stats, synthetic_trace, wait_for


@pytest.fixture
def toy_profile(tmp_path, model_files) -> Profile:
    """Two domains over the test model's shape: alpha favours experts 0..7, beta 8..15."""
    path = synthetic_trace(tmp_path / "toy.jsonl.gz", n_layers=model_files.n_layers,
                           n_experts=model_files.n_experts, top_k=4, seqs=6, tokens=40)
    profile = Profile.from_traces(read_traces(path))
    profile.save(tmp_path / "toy.json")
    return profile


def test_hint_preloads_and_pins_the_predicted_domain(daemon_factory, model_dir, model_files, toy_profile):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)), "--profile", toy_profile.path)
    fp = model_files.fingerprint
    reply = request(daemon.socket, protocol.Hint(id=1, model=fp, text="what is the integral of this derivative"))
    assert reply.ok, reply
    assert reply.payload["domain"] == "alpha" and reply.payload["applied"]
    assert 0.35 <= reply.payload["confidence"] <= 1
    budget = 2  # 8 slots: a quarter of them
    for layer in range(model_files.n_layers):
        want = [e for e in toy_profile.top_experts("alpha", layer, budget)]
        assert sorted(reply.payload["pinned"][layer]) == sorted(want) and all(e < 8 for e in want)
    wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="preloads")
    m = stats(daemon)["models"][0]
    assert m["active_domain"] == "alpha" and m["profile"] == toy_profile.path
    assert m["domains"] == ["alpha", "beta"]
    for layer, info in enumerate(m["layers"]):
        assert info["domain_pins"] == sorted(reply.payload["pinned"][layer])
        assert set(info["domain_pins"]) <= set(info["experts"])  # resident
        assert info["pinned"] == budget

    # Pinned experts survive a flood of other demand; the rest of the cache still turns over.
    for expert in range(model_files.n_experts):
        request(daemon.socket, protocol.Prefetch(id=2, model=fp, layer=0, experts=[expert]))
        wait_for(lambda: stats(daemon)["models"][0]["layers"][0]["loading"] == 0, what="load")
    layer0 = stats(daemon)["models"][0]["layers"][0]
    assert set(layer0["domain_pins"]) <= set(layer0["experts"]) and layer0["resident"] == 8

    # A switch replaces the domain pins; an empty hint releases them.
    reply = request(daemon.socket, protocol.Hint(id=3, model=fp, domain="beta"))
    assert reply.ok and reply.payload["domain"] == "beta" and reply.payload["confidence"] == 1.0
    wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="preloads")
    m = stats(daemon)["models"][0]
    assert m["active_domain"] == "beta"
    assert all(all(e >= 8 for e in info["domain_pins"]) and len(info["domain_pins"]) == budget
               for info in m["layers"])
    assert request(daemon.socket, protocol.Hint(id=4, model=fp)).ok
    m = stats(daemon)["models"][0]
    assert m["active_domain"] is None and all(info["domain_pins"] == [] for info in m["layers"])
    assert m["hints"] == 3


def test_hint_errors(daemon_factory, running_daemon, model_dir, model_files, toy_profile):
    fp = model_files.fingerprint
    reply = request(running_daemon.socket, protocol.Hint(id=1, model=fp, text="x"))
    assert not reply.ok and reply.ename == "NoProfile" and "--profile" in reply.evalue
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)), "--profile", toy_profile.path)
    reply = request(daemon.socket, protocol.Hint(id=1, model=fp, domain="gamma"))
    assert not reply.ok and reply.ename == "UnknownDomain" and "alpha, beta" in reply.evalue
    reply = request(daemon.socket, protocol.Hint(id=1, model="nope", domain="alpha"))
    assert not reply.ok and reply.ename == "UnknownModel"
    assert daemon.proc.poll() is None


def test_reports_become_online_statistics_and_a_profile(daemon_factory, model_dir, model_files, toy_profile,
                                                         tmp_path):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)), "--profile", toy_profile.path)
    fp = model_files.fingerprint
    request(daemon.socket, protocol.Report(id=1, model=fp, layers={0: [[], [1, 2]], 2: [[], [3]]}))
    request(daemon.socket, protocol.Hint(id=2, model=fp, domain="beta"))
    # A client tells every pick, L0 hits included (expert 4 here), besides its L2 lookups.
    request(daemon.socket, protocol.Report(id=3, model=fp, layers={1: [[], [9, 10]]}, routed={1: [9, 9, 10, 4]}))
    assert "routing" not in stats(daemon)["models"][0]  # only when asked for: it is large
    routing = request(daemon.socket, protocol.Stats(id=4, routing=True)).payload["models"][0]["routing"]
    assert routing[""][0][1] == 1 and routing[""][2][3] == 1
    assert routing["beta"][1][9] == 2 and routing["beta"][1][10] == 1 and routing["beta"][1][4] == 1
    out = tmp_path / "online.json"
    result = subprocess.run([shutil.which("moe-l2"), "profile", "--from-daemon", "--socket", daemon.socket,
                             "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    online = Profile.load(out)
    assert online.domains["beta"].counts[1][9] == 2 and online.unlabelled.counts[0][1] == 1
    assert online.predictor is None and any(s.startswith("daemon:") for s in online.sources)
    # With --base, the online counts are added to a profile and its predictor is kept.
    result = subprocess.run([shutil.which("moe-l2"), "profile", "--from-daemon", "--socket", daemon.socket,
                             "--base", toy_profile.path,
                             "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    merged = Profile.load(out)
    assert merged.predictor is not None
    assert merged.domains["beta"].counts[1][9] == toy_profile.domains["beta"].counts[1][9] + 2


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not valid JSON"),
    (json.dumps({"format": "something-else"}), "not a moe-l2 profile"),
    (json.dumps({"format": "moe-l2-profile", "version": 99}), "version 99 is not supported"),
])
def test_the_daemon_refuses_a_bad_profile_at_start(tmp_path, model_dir, model_files, content, words):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(model_dir),
                             "--budget", str(budget_for(model_files, 4)), "--runtime-dir", str(tmp_path / "rt"),
                             "--profile", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert words in result.stderr and str(bad) in result.stderr


def test_the_daemon_refuses_a_profile_of_another_model(tmp_path, model_dir, model_files):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", n_layers=2, n_experts=8, seqs=2, tokens=4)
    Profile.from_traces(read_traces(path)).save(tmp_path / "p.json")
    result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(model_dir),
                             "--budget", str(budget_for(model_files, 4)), "--runtime-dir", str(tmp_path / "rt"),
                             "--profile", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "2 layers x 8 experts" in result.stderr


def test_profile_flags_and_toml(tmp_path):
    from moe_l2.daemon.config import ConfigError, build_parser, resolve

    def load(*argv):
        return resolve(build_parser().parse_args(list(argv)))

    one = load("--model", "/a", "--model", "/b", "--budget", "1G", "--profile", "/p.json")
    assert [str(m.profile) for m in one.models] == ["/p.json", "/p.json"]
    each = load("--model", "/a", "--model", "/b", "--budget", "1G", "--profile", "/p", "--profile", "/q")
    assert [str(m.profile) for m in each.models] == ["/p", "/q"]
    assert load("--model", "/a", "--budget", "1G").models[0].profile is None
    assert load("--model", "/a", "--budget", "1G").models[0].policy == "learned"
    with pytest.raises(ConfigError, match="--profile once, or once per --model"):
        load("--model", "/a", "--model", "/b", "--model", "/c", "--budget", "1G", "--profile", "/p", "--profile", "/q")
    toml = tmp_path / "c.toml"
    toml.write_text('[[model]]\npath = "/m"\nbudget = "1GiB"\n')
    with pytest.raises(ConfigError, match="--profile needs a --model"):
        load("--profile", "/p", "--config", str(toml))
    toml.write_text('[[model]]\npath = "/m"\nbudget = "1GiB"\nprofile = "/var/lib/p.json"\n\n'
                    '[[model]]\npath = "/n"\nbudget = "1GiB"\n')
    models = load("--config", str(toml)).models
    assert [m.profile and str(m.profile) for m in models] == ["/var/lib/p.json", None]
    toml.write_text('[[model]]\npath = "/m"\nbudget = "1GiB"\nprofile = 3\n')
    with pytest.raises(ConfigError, match="must be a file name"):
        load("--config", str(toml))


def test_hint_budget_leaves_room_for_demand():
    store = LayerStore(16, 8, make_policy("lru"))
    store.pin([1], "permanent")
    assert store.hint_budget() == 2          # a quarter of 8 slots
    assert store.hint_budget(share=1.0) == 3  # never past the pin limit (4) less the permanent pin
    store.pin([2, 3], "domain")
    assert store.hint_budget(share=1.0) == 3  # domain pins are what a hint replaces: they leave room
    assert store.hint_budget(share=-1.0) == 0


def test_apply_hint_pins_only_experts_the_domain_favours(tmp_path):
    path = synthetic_trace(tmp_path / "t.jsonl.gz", n_layers=1, n_experts=16, top_k=2, seqs=4, tokens=50)
    profile = Profile.from_traces(read_traces(path))
    store = LayerStore(16, 8, make_policy("adaptive", 8))
    pinned = store.apply_hint(profile, "beta", 0)
    assert len(pinned) == 2 and all(e >= 8 for e in pinned) and store.pins("domain") == sorted(pinned)
    store.pin([0], "permanent")
    pinned = store.apply_hint(profile, "alpha", 0, share=1.0)
    assert store.pins("permanent") == [0] and len(pinned) == 3 and 0 not in pinned  # pin limit 4
    assert all(e < 8 for e in pinned) and store.pin_count == 4
    for no_domain in (None, ""):
        assert store.apply_hint(profile, no_domain, 0) == []  # releases the domain pins, keeps the rest
        assert store.pins("domain") == [] and store.pins("permanent") == [0] and store.pin_count == 1
        store.apply_hint(profile, "alpha", 0)


def test_a_client_hint_reaches_the_daemon_without_waiting(daemon_factory, model_dir, model_files, toy_profile):
    from moe_l2.client.connection import L2Client

    daemon = daemon_factory([model_dir], str(budget_for(model_files, 8)), "--profile", toy_profile.path)
    client = L2Client(model_files, daemon.socket, wait_s=5)
    try:
        client.hint("what is the integral of this derivative")  # queued; the IO thread sends it
        wait_for(lambda: stats(daemon)["models"][0]["active_domain"] == "alpha", what="the hint")
        assert stats(daemon)["models"][0]["hints"] == 1
    finally:
        client.close()
