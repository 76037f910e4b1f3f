"""Next-layer prefetch: tokens stay the model loaded whole's, no row that queued work reads is ever written,
the predictors find a known answer, replay scores them, and the counters add up (the side rows' own rules:
tests/test_side_rows.py)."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from moe_l2.cache.prefetch import CooccurrencePredictor, RepeatPredictor, Score, score_predictor
from moe_l2.cache.replay import replay
from moe_l2.cache.trace import TraceWriter, read_traces
from moe_l2.cli import main as moe_l2_main
from moe_l2.client.connection import L2Client
from moe_l2.lm.streamed_lm import StreamedLM
from moe_l2.lm.nextlayer import NextLayer
from moe_l2.client.pool import ExpertPool

from .conftest import (assert_every_tier_exact, assert_resident_exact, budget_for, greedy,
                       PREFETCH_TEXT as TEXT, stats, wait_for)

def assert_counts_add_up(pool: ExpertPool) -> None:
    c = pool.prefetch_counts
    still = sum(len(lp.prefetched()) for lp in pool.layers.values())
    assert c.issued == c.useful + c.wasted + still
    assert c.right <= min(c.guessed, c.picked)


@pytest.mark.parametrize("mode", ["router", "logistic", "cooccurrence"])
def test_tokens_are_the_whole_models_at_every_l0_size(model_dir, model_files, whole, landing, mode):
    model, tokenizer = whole
    expected = greedy(model, tokenizer)
    for slots in (model_files.top_k, model_files.top_k + 2, model_files.n_experts):
        with StreamedLM(model_dir, l0_slots=slots, daemon=False, prefetch=mode) as lm:
            assert lm.next_layer.predictor == mode
            assert greedy(lm.model, lm.tokenizer) == expected, slots
            c = lm.pool.prefetch_counts
            assert c.requests > 0 and c.guessed > 0
            if slots < model_files.n_experts:
                assert c.issued > 0 and c.bytes_read == c.issued * model_files.layout.nbytes
            assert_counts_add_up(lm.pool)
            for layer, lp in lm.pool.layers.items():  # what the worker wrote is the file's bytes
                assert_resident_exact(lm.pool, model_files, layer, lp.prefetched())


def test_tokens_are_the_whole_models_when_prefetches_race_the_forward(model_dir, model_files, whole):
    model, tokenizer = whole
    expected = greedy(model, tokenizer)
    with StreamedLM(model_dir, l0_slots=model_files.top_k + 1, daemon=False, prefetch="auto") as lm:
        assert greedy(lm.model, lm.tokenizer) == expected  # whether a prefetch lands or is cancelled
        assert lm.pool.prefetch_counts.requests > 0
        assert_counts_add_up(lm.pool)


def test_with_a_daemon_prefetch_copies_from_l2_and_stats_show_it(daemon_factory, model_dir, model_files, whole,
                                                                 landing):
    running_daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    assert_every_tier_exact(model_files, running_daemon)  # also leaves every expert loaded in L2
    model, tokenizer = whole
    expected = greedy(model, tokenizer)
    # Copied from L2, not computed there in place: the guesses are copied from L2 into the side rows (in place,
    # those L2 holds are left there: tests/test_side_rows.py).
    with StreamedLM(model_dir, l0_slots=model_files.top_k + 1, socket=running_daemon.socket, client_wait_s=5,
                    prefetch="cooccurrence", shared_l0=False, l2_reads="copy") as lm:
        assert lm.client.attached
        assert greedy(lm.model, lm.tokenizer) == expected
        c = lm.pool.prefetch_counts
        assert c.issued > 0 and c.bytes_copied > 0
        wire = c.wire()
        wait_for(lambda: stats(running_daemon)["models"][0]["prefetch"] == wire, what="prefetch counters")


def test_a_wrong_guess_never_overwrites_rows_that_queued_work_reads(model_files):
    """The adversarial case at an L0 of exactly top_k rows: every row of the last layer is read by a lazy,
    unevaluated computation (the tail) when a prefetch of other experts into that layer lands. The guesses go to
    side rows: the computation later reads the file's bytes, and the demand rows keep their experts."""
    k, last = model_files.top_k, model_files.n_layers - 1
    pool = ExpertPool(model_files, capacity=k, prefetch=True)
    try:
        tail = list(range(k))
        wrong = list(range(k, 2 * k))
        piece = model_files.layout.pieces[0]

        def truth(layer, experts):
            rows = [np.frombuffer(model_files.read_record(layer, e)[piece.offset:piece.offset + piece.nbytes],
                                  dtype=np.uint8) for e in experts]
            return np.stack(rows)

        pool.fetch(last, tail)
        out_last = pool.arrays(last)[piece.key][pool.table(last)[mx.array(tail)]]
        pool.prefetch(last, wrong)
        pool.wait_prefetches()
        assert pool.prefetch_counts.issued == k
        assert (np.asarray(out_last).reshape(k, -1).view(np.uint8) == truth(last, tail)).all()
        assert all(pool.layers[last].holds(e) for e in tail)
        assert_resident_exact(pool, model_files, last, tail)
        assert_resident_exact(pool, model_files, last, wrong)  # whole in their side rows
        assert pool.fetch(last, tail).l0_hits == k  # demanded after all: the guesses were wasted
        assert pool.prefetch_counts.wasted == k and pool.prefetch_counts.useful == 0
        assert_counts_add_up(pool)
    finally:
        pool.close()


def test_the_streamed_tail_survives_a_wrong_prefetch(model_dir, model_files, landing, monkeypatch):
    """The same at the model: a one-token forward leaves its last layer's output unevaluated, reading every
    row of an L0 of top_k rows; the next forward prefetches wrong guesses into that layer. Evaluated after,
    the tail equals the output of a pool that holds every expert."""
    ids = mx.array([[5]]), mx.array([[9]])
    with StreamedLM(model_dir, l0_slots=model_files.n_experts, daemon=False) as ref:
        ref.model(ids[0], cache=make_prompt_cache(ref.model))
        want = ref.switches[-1]._forward.tail
        mx.eval(want)
    with StreamedLM(model_dir, l0_slots=model_files.top_k, daemon=False, prefetch="cooccurrence") as lm:
        forward = lm.switches[-1]._forward

        def wrong(self, layer, x, chosen):
            # Guess experts the layer does not hold: for the last layer, the ones the unevaluated tail does not read.
            lp = lm.pool.layers[layer + 1]
            return [e for e in range(model_files.n_experts) if not lp.holds(e)][:model_files.top_k]

        monkeypatch.setattr(NextLayer, "guess", wrong)
        cache = make_prompt_cache(lm.model)
        lm.model(ids[0], cache=cache)
        tail = forward.tail
        lm.model(ids[1], cache=cache)
        assert mx.array_equal(tail, want).item()
        assert lm.pool.prefetch_counts.issued > 0


def known_answer_trace(path, *, n_layers=4, n_experts=16, top_k=2, seqs=6, tokens=60, seed=0):
    """Layer l+1's experts are a fixed function of layer l's: e -> (3e + 1) mod n."""
    rng = random.Random(seed)
    with TraceWriter(path, model="toy", n_layers=n_layers, n_experts=n_experts, top_k=top_k) as w:
        for i in range(seqs):
            w.begin(seq=f"s{i}", domain=None, prompt=None)
            for _ in range(tokens):
                layer = rng.sample(range(n_experts), top_k)
                token = [layer]
                for _ in range(n_layers - 1):
                    layer = [(3 * e + 1) % n_experts for e in layer]
                    token.append(layer)
                w.add_token(token)
            w.end()
    return path


def follow_the_previous_token(rng, steps, n_layers, n_experts, top_k):
    """Tokens whose layer 0 is random and whose layer l >= 1 is the previous token's layer l-1, each id + l
    mod n: a token's layers l and l+1 come from different random draws, so nothing in its own earlier layers
    tells its next one; the previous token's layer l does."""
    previous = [rng.sample(range(n_experts), top_k) for _ in range(n_layers)]
    for _ in range(steps):
        token = [rng.sample(range(n_experts), top_k)] + [[(e + layer) % n_experts for e in previous[layer - 1]]
                                                        for layer in range(1, n_layers)]
        yield token
        previous = token


def previous_token_trace(path, *, n_layers=4, n_experts=16, top_k=2, seqs=6, tokens=60, seed=0):
    rng = random.Random(seed)
    with TraceWriter(path, model="toy", n_layers=n_layers, n_experts=n_experts, top_k=top_k) as w:
        for i in range(seqs):
            w.begin(seq=f"s{i}", domain=None, prompt=None)
            for token in follow_the_previous_token(rng, tokens, n_layers, n_experts, top_k):
                w.add_token(token)
            w.end()
    return path


def test_cooccurrence_precision_on_a_known_answer(tmp_path):
    traces = read_traces([known_answer_trace(tmp_path / "f.jsonl")])
    train, test = traces.sequences[:3], traces.sequences[3:]
    frozen = CooccurrencePredictor.from_traces(train, traces.n_layers, traces.n_experts)
    score = score_predictor(frozen, test, traces.top_k, learn=False)
    assert score.precision == 1.0 and score.recall == 1.0
    online = score_predictor(CooccurrencePredictor(traces.n_layers, traces.n_experts), traces.sequences, 2)
    assert online.precision > 0.9  # wrong only while it has not yet seen an expert
    # Routing with no relation between layers: no better than chance (2 of 16).
    rng = random.Random(1)
    for s in test:
        s.experts = [[rng.sample(range(traces.n_experts), 2) for _ in range(traces.n_layers)] for _ in s.experts]
    assert score_predictor(frozen, test, 2, learn=False).precision < 0.3
    assert score_predictor(RepeatPredictor(traces.n_layers), test, 2).precision < 0.3


def test_logistic_learns_what_the_token_before_tells_and_cooccurrence_cannot(tmp_path):
    traces = read_traces([previous_token_trace(tmp_path / "p.jsonl", tokens=300)])
    r = replay(traces, slots=[4], compare=(), prefetch=("logistic", "cooccurrence"), train=0.5)
    scores, entry = r.prefetch_scores, r.capacities[0]
    assert scores["logistic"].precision > 0.9
    assert scores["cooccurrence"].precision < 0.3  # chance is 2 of 16
    assert entry.prefetch["logistic"].hit_rate > entry.policies["min"].hit_rate
    # And a layer's function of the layer before, which co-occurrence finds exactly.
    r = replay(read_traces([known_answer_trace(tmp_path / "f.jsonl", tokens=300)]), slots=[4], compare=(),
               prefetch=("logistic",), train=0.5)
    assert r.prefetch_scores["logistic"].precision > 0.9


def guess_precision(model_files, mode: str, tokens: list, *, seed=None, scored_from: int = 0) -> tuple[float, int]:
    """A real pool fetches each token's layers as one-token forwards, NextLayer(mode) guessing each next layer;
    returns the precision of the guesses from token `scored_from` on, scored by the fetches, and how many tokens
    seeded the predictor."""
    pool = ExpertPool(model_files, model_files.top_k + 2, prefetch=True)
    try:
        next_layer = NextLayer(mode, pool, seed=seed)
        for step, token in enumerate(tokens):
            if step == scored_from:
                before = pool.prefetch_counts
            for layer, experts in enumerate(token):
                pool.fetch(layer, experts)
                next_layer.after(layer, None, np.asarray([experts]))
            pool.wait_prefetches()
        c = pool.prefetch_counts.minus(before)
        return c.right / c.guessed, next_layer.seeded_tokens
    finally:
        pool.close()


def test_the_client_learns_the_logistic_answer_across_forwards(model_files):
    """NextLayer lines a one-token forward up with the one before it: guesses scored against the pool's
    fetches become right where only the previous token tells the answer."""
    n, k, layers = model_files.n_experts, model_files.top_k, model_files.n_layers
    tokens = list(follow_the_previous_token(random.Random(3), 400, layers, n, k))
    assert guess_precision(model_files, "logistic", tokens, scored_from=300)[0] > 0.95
    assert guess_precision(model_files, "cooccurrence", tokens, scored_from=300)[0] < 0.5
    # Where the token's own layer tells the next, co-occurrence learns it across forwards too.
    rng = random.Random(4)
    tokens = []
    for _ in range(300):
        token = [rng.sample(range(n), k)]
        for _ in range(layers - 1):
            token.append([(3 * e + 1) % n for e in token[-1]])
        tokens.append(token)
    assert guess_precision(model_files, "cooccurrence", tokens, scored_from=200)[0] > 0.95


def test_a_seeded_predictor_is_right_from_the_first_forward(model_files, tmp_path):
    """Seeded from a trace of the routing to come, NextLayer's first guesses are already right, where one
    learning from nothing is not."""
    n, k, layers = model_files.n_experts, model_files.top_k, model_files.n_layers
    seed = read_traces([previous_token_trace(tmp_path / "seed.jsonl", n_layers=layers, n_experts=n, top_k=k,
                                             seqs=2, tokens=600)])
    tokens = list(follow_the_previous_token(random.Random(5), 30, layers, n, k))
    seeded, seeded_tokens = guess_precision(model_files, "logistic", tokens, seed=seed)
    unseeded, no_tokens = guess_precision(model_files, "logistic", tokens)
    assert (seeded_tokens, no_tokens) == (1200, 0)
    assert seeded > 0.9 and unseeded < 0.5, (seeded, unseeded)


def test_generate_seeds_prefetch_from_a_trace_it_wrote(capsys, model_dir, tmp_path):
    trace = tmp_path / "run.jsonl.gz"
    common = ["generate", "--model", str(model_dir), "--prompt", TEXT, "--no-daemon", "--l0-slots", "5",
              "--max-tokens", "6", "--json"]
    assert moe_l2_main([*common, "--trace-out", str(trace)]) == 0
    capsys.readouterr()
    tokens = sum(s.n_tokens for s in read_traces([trace]).sequences)
    assert moe_l2_main([*common, "--prefetch", "logistic", "--prefetch-from", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out)["prefetch"]["predictor"] == \
        f"logistic (seeded from {tokens} tokens, learned online)"
    assert moe_l2_main([*common, "--prefetch-from", str(trace)]) == 2
    assert "give --prefetch too" in capsys.readouterr().err
    other = known_answer_trace(tmp_path / "other.jsonl")  # 4 layers: another model's
    assert moe_l2_main([*common, "--prefetch", "logistic", "--prefetch-from", str(other)]) == 1
    assert "cannot seed prefetch" in capsys.readouterr().err


def test_score_counts_precision_and_recall():
    s = Score()
    s.add([1, 2, 3], [2, 3])
    s.add([4], [5, 6])
    assert (s.guessed, s.picked, s.right) == (4, 4, 2)
    assert s.precision == 0.5 and s.recall == 0.5


def test_replay_prefetch_beats_demand_caching_on_a_known_answer(tmp_path, capsys):
    path = known_answer_trace(tmp_path / "f.jsonl")
    traces = read_traces([path])
    r = replay(traces, slots=[4], compare=("lru",), prefetch=("cooccurrence", "repeat"), train=0.5)
    assert r.trained_on["sequences"] == 3
    scored = sum(s.n_tokens for s in traces.sequences[3:])  # interleave, seed 0: the same split as `replay`'s
    assert r.tokens == scored
    assert r.prefetch_scores["cooccurrence"].precision == 1.0
    entry = r.capacities[0]
    pf, demand = entry.prefetch["cooccurrence"], entry.policies
    # Layers 1..3 are prefetched exactly; layer 0 is demand-cached as before.
    assert pf.hit_rate > demand["min"].hit_rate
    assert pf.wasted == 0 and pf.useful == pf.prefetch_loads
    assert pf.records_vs_demand == pytest.approx(pf.records_per_token / demand[r.policy].records_per_token)
    # The command: a table, and the same numbers in JSON.
    assert moe_l2_main(["replay", "--trace", str(path), "--slots", "4", "--prefetch", "cooccurrence",
                        "--jobs", "1"]) == 0
    assert "next-layer prefetch" in capsys.readouterr().out
    assert moe_l2_main(["replay", "--trace", str(path), "--slots", "4", "--prefetch", "cooccurrence",
                        "--jobs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacities"][0]["prefetch"]["cooccurrence"]["hit_rate"] == pf.hit_rate


@pytest.mark.parametrize("args, words", [
    (["--prefetch", "oracle"], "unknown prefetch predictor"),
    (["--prefetch", "cooccurrence", "--train", "1"], "--train"),
    (["--prefetch", "cooccurrence", "--prefetch-k", "0"], "prefetch-k"),
])
def test_replay_prefetch_errors(tmp_path, capsys, args, words):
    path = known_answer_trace(tmp_path / "f.jsonl", seqs=2, tokens=5)
    assert moe_l2_main(["replay", "--trace", str(path), "--slots", "4", "--jobs", "1", *args]) == 2
    assert words in capsys.readouterr().err


def test_generate_reports_prefetch_in_its_summary(capsys, model_dir, model_files, whole):
    model, tokenizer = whole
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", TEXT, "--no-daemon", "--l0-slots", "5",
                        "--max-tokens", "6", "--prefetch", "cooccurrence", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    p = s["prefetch"]
    assert p["predictor"].startswith("cooccurrence") and p["guessed"] > 0
    assert 0 <= p["precision"] <= 1 and 0 <= p["recall"] <= 1
    assert p["read_bytes"] == p["issued"] * model_files.layout.nbytes > 0 and p["copied_bytes"] == 0  # no daemon
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", TEXT, "--no-daemon", "--l0-slots", "5",
                        "--max-tokens", "6", "--prefetch", "router"]) == 0
    assert "prefetch by router (the next layer's gate): guesses" in capsys.readouterr().out


def test_router_prefetch_is_refused_where_no_router_is_found(model_dir, model_files):
    with StreamedLM(model_dir, l0_slots=5, daemon=False) as lm:
        with pytest.raises(ValueError, match="no router"):
            NextLayer("router", lm.pool, dict.fromkeys(range(model_files.n_layers)))
        assert NextLayer("auto", lm.pool, dict.fromkeys(range(model_files.n_layers))).predictor == "logistic"


def test_l2_client_sends_prefetch_increments(model_files, running_daemon, capsys):
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    totals = {"issued": 0, "useful": 0, "wasted": 0, "guessed": 0, "picked": 0, "right": 0, "worker_us": 0,
              "wait_us": 0}
    client.count_prefetch(lambda: dict(totals))
    try:
        for step in (1, 2):
            totals.update(issued=3 * step, useful=2 * step, guessed=4 * step, picked=4 * step, right=3 * step)
            client.report(0, [], [1], [1])
            wait_for(lambda: stats(running_daemon)["models"][0]["prefetch"]["issued"] == 3 * step,
                     what="prefetch counters")
        assert stats(running_daemon)["models"][0]["prefetch"]["right"] == 6
        assert moe_l2_main(["stats", "--socket", running_daemon.socket]) == 0
        assert "prefetch (clients): guesses 75.0% precise, 75.0% recall; 6 loaded ahead, 4 used" in \
            capsys.readouterr().out
    finally:
        client.close()


def test_a_pipeline_stage_prefetches_only_its_own_layers(model_files):
    """A stage's pool holds some layers (docs/distributed.md): its last layer asks for no prefetch of the next
    layer, which another rank runs; a layer before it does."""
    assert model_files.n_layers >= 3
    pool = ExpertPool(model_files, model_files.top_k, layers=[0, 1], prefetch=True)
    try:
        next_layer = NextLayer("cooccurrence", pool)
        chosen = np.array([list(range(model_files.top_k))])
        next_layer.after(1, mx.zeros((1, 8)), chosen)
        assert pool.prefetch_counts.requests == 0
        next_layer.after(0, mx.zeros((1, 8)), chosen)
        pool.wait_prefetches()
        assert pool.prefetch_counts.requests == 1 and pool.prefetch_counts.errors == 0
        assert pool.layers[1].prefetched()
    finally:
        pool.close()
