"""`moe-l2 generate` and `moe-l2 demo`, checked against the model loaded whole by mlx-lm."""

from __future__ import annotations

import gzip
import io
import json
import re
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2.cli import main as moe_l2_main
from moe_l2.client.connection import wait_idle
from moe_l2.lm.generation import encode_prompt
from moe_l2.cli.demo import COLUMN_WIDTH, DEMO_NAME, LABEL_WIDTH, RUNS, ensure_demo_model, render_gains, render_verdict
from moe_l2.client.lookup import TierCounts
from moe_l2.cli.generate import render
from moe_l2.cli.stats import model_rates
from moe_l2.cli.stats import render as render_stats
from moe_l2.cache.trace import read_traces
from moe_l2.model import ModelFiles
from moe_l2.sizes import format_pct, format_size

from .conftest import budget_for, free_port, scrape, stats, wait_for


PROMPT = "Which experts does the router pick for this sentence?"


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, PROMPT)
    return [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=12)]


def by_source(s: dict) -> dict:
    """A generate --json object's lookups as the daemon's stats count them (protocol.TIER_COUNTERS)."""
    return {"l0": s["l0_hits"], "l2": s["l2_hits"], "daemon_disk": s["daemon_reads"], "own_disk": s["l3_reads"]}


def run_json(capsys, *args) -> dict:
    assert moe_l2_main(["generate", *args, "--max-tokens", "12", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_run_gives_the_whole_models_tokens_and_consistent_counts(capsys, model_dir, model_files, expected):
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--no-daemon", "--l0-slots", "5")
    assert s["tokens"] == expected
    assert s["daemon"] is None and s["l0_slots"] == 5 and s["l2_hits"] == 0
    assert s["l0_hits"] + s["l2_hits"] + s["l3_reads"] == s["expert_lookups"] > 0
    assert s["l0_hit_rate"] + s["l2_hit_rate"] + s["daemon_read_rate"] + s["l3_rate"] == pytest.approx(1.0)
    assert s["disk_rate"] == s["l3_rate"] and s["daemon_reads"] == 0
    assert s["read_bytes"] == s["l3_reads"] * model_files.layout.nbytes
    assert s["prompt_tps"] > 0 and s["generation_tps"] > 0
    assert s["peak_rss_bytes"] > s["l0_bytes"] > 0


def test_text_mode_streams_the_text_then_one_summary(capsys, model_dir, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    s = run_json(capsys, "--model", str(model_dir), "--prompt-file", str(prompt_file), "--no-daemon")
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--no-daemon", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(s["text"])
    summary = out[len(s["text"]):].strip().splitlines()
    assert summary[0].startswith(f"prompt {s['prompt_tokens']} tokens") and "decode 12 tokens" in summary[0]
    assert summary[1].startswith("experts: ") and "from disk" in summary[1]
    assert "no daemon" in summary[2]
    assert summary[3].startswith("peak memory: RSS")


def test_trace_out_records_every_processed_token(capsys, model_dir, model_files, tmp_path):
    trace = tmp_path / "routing.jsonl.gz"
    for _ in range(2):  # appends
        s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--no-daemon", "--trace-out",
                     str(trace), "--trace-domain", "questions")
    lines = gzip.open(trace, "rt").read().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["experts"] == second["experts"]  # greedy: the same routing twice
    assert (first["n_layers"], first["n_experts"], first["top_k"]) == (model_files.n_layers, model_files.n_experts,
                                                                       model_files.top_k)
    assert first["domain"] == "questions" and first["prompt"] == PROMPT and first["seq"] != second["seq"]
    assert len(first["experts"]) == s["prompt_tokens"] + len(s["tokens"]) == s["prompt_tokens"] + 12
    assert read_traces(trace).n_tokens == 2 * len(first["experts"])  # the project's reader takes it
    for token in first["experts"]:
        assert len(token) == model_files.n_layers
        for chosen in token:
            assert len(set(chosen)) == model_files.top_k and all(0 <= e < model_files.n_experts for e in chosen)


@pytest.mark.parametrize("l2_reads", ["in-place", "copy"])
def test_through_the_daemon_the_second_run_finds_experts_in_l2(capsys, running_daemon, model_dir, model_files,
                                                                expected, l2_reads):
    args = ["--model", str(model_dir), "--prompt", PROMPT, "--socket", running_daemon.socket, "--l0-slots", "4",
            "--l2-reads", l2_reads, "--load-through-ms", "0"]
    cold = run_json(capsys, *args)

    def folded_and_loaded():
        # Reports are folded in between other requests: every lookup of the cold run counted, then its loads done.
        s = stats(running_daemon)
        m = s["models"][0]
        return m["hits"] + m["misses"] == cold["l2_hits"] + cold["l3_reads"] and not s["daemon"]["loads_in_flight"]

    wait_for(folded_and_loaded, what="the cold run's reports folded in and their loads done")
    warm = run_json(capsys, *args)
    for s in (cold, warm):
        assert s["tokens"] == expected
        assert s["daemon"]["attached"] and s["daemon"]["address"] == running_daemon.socket
    assert cold["l3_reads"] > 0
    assert warm["l2_hits"] > 0
    assert (warm["l2_lent"] > 0) == (l2_reads == "in-place")
    assert warm["copied_bytes"] == (warm["l2_hits"] + warm["daemon_reads"] - warm["l2_lent"]) * model_files.layout.nbytes


def test_by_default_a_miss_is_read_once_by_the_process_and_given_to_l2(capsys, daemon_factory, model_dir,
                                                                      model_files, expected):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket, "--l0-slots", "4")
    assert s["tokens"] == expected and s["l3_reads"] > 0
    # This process runs as the daemon's user: what it read it gave to L2 (fills); the daemon read only what it
    # was asked to load before the fill desk took the process (it connects as the process starts) and the
    # donations that lost their row before the copy (cancelled).
    wait_idle(daemon.socket)
    served = stats(daemon)["models"][0]
    assert served["fills"]["donated"] > 0
    assert served["loads_done"] == s["daemon_reads"] + served["fills"]["cancelled"]
    warm = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                    "--l0-slots", "4")
    assert warm["tokens"] == expected
    assert warm["daemon_reads"] == warm["l3_reads"] == 0 and warm["disk_rate"] == 0


def test_with_load_through_a_miss_is_read_once_by_the_daemon_and_computed_on_in_l2(capsys, daemon_factory,
                                                                                   model_dir, model_files, expected):
    port = free_port()
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)), "--metrics",
                            f"127.0.0.1:{port}")
    # Load-through, as for a process of another user than the daemon's, with a wait long enough for a loaded CI
    # machine.
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                 "--l0-slots", "4", "--load-through-ms", "5000", "--no-fill-l2")
    assert s["tokens"] == expected
    assert s["l2_lent"] > 0 and s["copied_bytes"] == 0
    # L2 has room for every expert: each miss was read once, by the daemon, while the client waited. That is
    # the cold run's disk share, not L2 hits (those are the experts L0 dropped and L2 already held).
    loaded = stats(daemon)["models"][0]["loads_done"]
    assert s["l3_reads"] == 0 and s["read_bytes"] == 0 and loaded == s["daemon_reads"] > 0
    assert s["disk_rate"] == pytest.approx(loaded / s["expert_lookups"])
    assert s["l0_hits"] + s["l2_hits"] + s["daemon_reads"] == s["expert_lookups"]
    summary = render(s).splitlines()[1]
    assert (f"L2 {format_pct(s['l2_hit_rate'])}, disk {format_pct(s['disk_rate'])} (read by moe-l2d while waiting "
            f"{format_pct(s['daemon_read_rate'])}") in summary
    # The daemon says the same from the client's reports, in stats, --watch and --metrics: the disk's share.
    cold = by_source(s)
    wait_for(lambda: stats(daemon)["models"][0]["tiers"] == cold, what="the cold run's lookups in stats")
    before = stats(daemon)
    assert (f"L2 {format_pct(s['l2_hit_rate'])}  disk {format_pct(s['disk_rate'])} (read by moe-l2d while waiting "
            f"{format_pct(s['daemon_read_rate'])}, by the client 0.0%)") in render_stats(before)
    assert model_rates(None, before["models"][0], 1.0)["tiers"] == cold
    lookups = {source: scrape(port)[("moe_l2_lookups_total", ("model", str(model_dir)), ("source", source))]
               for source in cold}
    assert lookups == cold and lookups["daemon_disk"] == loaded
    # A second process finds in L2 what the first had the daemon read: the same lookups, L2's share, no disk.
    warm = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                    "--l0-slots", "4", "--load-through-ms", "5000", "--no-fill-l2")
    assert warm["tokens"] == expected
    assert warm["daemon_reads"] == warm["l3_reads"] == 0 and warm["disk_rate"] == 0
    assert warm["l2_hits"] == s["l2_hits"] + s["daemon_reads"]
    assert stats(daemon)["models"][0]["loads_done"] == loaded
    # --watch's frame over the second run shows it all from L0 and L2.
    wait_for(lambda: stats(daemon)["models"][0]["tiers"] == {k: n + by_source(warm)[k] for k, n in cold.items()},
             what="the warm run's lookups in stats")
    assert model_rates(before["models"][0], stats(daemon)["models"][0], 1.0)["tiers"] == by_source(warm)


@pytest.mark.parametrize("value", ["-5", "soon", "nan"])
def test_a_bad_load_through_wait_is_refused_with_what_to_give(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        moe_l2_main(["generate", "--model", "m", "--prompt", "p", "--load-through-ms", value])
    assert exit_.value.code == 2
    assert "--load-through-ms" in capsys.readouterr().err


def test_a_shared_l0_gives_the_same_tokens(capsys, running_daemon, model_dir, model_files, expected):
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", running_daemon.socket,
                 "--l0-slots", str(model_files.top_k + 1), "--l0-shared")
    assert s["tokens"] == expected and s["l0_shared"]
    assert s["l0_ceiling_bytes"] == (model_files.top_k + 1) * model_files.layout.stride >= s["l0_bytes"]


def test_with_a_shared_l0_prefetch_loads_guesses_into_side_rows_not_l2(capsys, daemon_factory, model_dir, model_files,
                                                                        expected):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                 "--l0-slots", str(model_files.top_k), "--l0-shared", "--prefetch", "logistic",
                 "--load-through-ms", "5000", "--no-fill-l2")
    assert s["tokens"] == expected
    p = s["prefetch"]
    # The guesses L2 lacked were loaded into side rows by this process; the last layer's may still be held.
    assert p["issued"] > 0 and 0 < p["useful"] + p["wasted"] <= p["issued"]
    assert p["read_bytes"] + p["copied_bytes"] > 0
    # L2 has room for every expert and every demand miss waits for the daemon: the daemon loaded those and no
    # guess (a wrong guess costs L2 nothing: docs/architecture.md, "Next-layer prefetch").
    assert stats(daemon)["models"][0]["loads_done"] == s["daemon_reads"]
    assert s["read_bytes"] == 0 and s["copied_bytes"] == 0


def test_an_absent_daemon_means_reading_the_file(capsys, model_dir, tmp_path, expected):
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--socket",
                          f"ipc://{tmp_path / 'nobody.sock'}", "--max-tokens", "12", "--json"]) == 0
    out, err = capsys.readouterr()
    s = json.loads(out)
    assert s["tokens"] == expected
    assert not s["daemon"]["attached"] and s["l3_reads"] > 0 and s["l2_hits"] == 0
    assert "reading experts from the model files" in err


@pytest.mark.parametrize("args, message, status", [
    (["--l0-slots", "2"], "at least 4 slots", 1),  # fine flags, too small for this model
    (["--l0-budget", "1KiB"], "a token needs 4", 1),
    (["--max-tokens", "0"], "at least 1", 2),
])
def test_bad_arguments_are_refused(capsys, model_dir, args, message, status):
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", "hi", "--no-daemon", *args]) == status
    assert message in capsys.readouterr().err


def test_a_directory_that_is_no_model_is_refused(capsys, tmp_path):
    assert moe_l2_main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--no-daemon"]) == 1
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    cmd = [sys.executable, "-P", "-m", "moe_l2.cli", "demo", "--cache-dir", str(tmp_path), "--max-tokens", "8"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "creating the demo model" in first.stderr
    for line in ("tokens identical to the whole model: 3/3 prompts",
                 "attached to the daemon: run 1 yes, run 2 yes, process 2 yes, process 3 yes",
                 "shared memory cleaned up"):
        assert line in first.stdout
    assert "dominates: run 1 spent" in first.stdout and "one process against none: alone" in first.stdout
    # Label, then a column per run: alone (no daemon), run 1 (L2 cold), run 2 (L2 warm), process 2 (L2 warm),
    # process 3 (the daemon restarted).
    table = {line[:LABEL_WIDTH].strip(): [line[LABEL_WIDTH + COLUMN_WIDTH * i:][:COLUMN_WIDTH].strip()
                                          for i in range(len(RUNS))]
             for line in first.stdout.splitlines() if len(line) > LABEL_WIDTH}
    for row in ("waiting for experts, ms/token", "time to first token, ms"):
        assert all(float(v) >= 0 for v in table[row]), row
    # Ground truth for run 1's disk bytes: every expert L2 holds after it was read once, by the process (which gave
    # it to L2: it runs as the daemon's user) or by moe-l2d, at the record size of the model's file layout (nothing
    # is evicted: L2 holds every expert).
    took = re.search(r"run 1: L2 took in (\d+) experts .*?: (\d+) read by this process and given to it, (\d+) read "
                     r"by moe-l2d", first.stdout)
    resident, given, loaded = map(int, took.groups())
    record = ModelFiles.open(tmp_path / DEMO_NAME).layout.nbytes
    assert resident > 0 and given > 0 and given + loaded == resident
    assert table["read from disk by moe-l2d"] == ["0 B", format_size(loaded * record), "0 B", "0 B", "0 B"]
    # Alone, every L0 miss came from disk, read by the process; cold, every expert not yet in L2: read by the
    # process, or by the daemon while it waited; warm, in this process, a second one or a third after the daemon
    # restarted and preloaded what it held (all of it: nothing was evicted), L2 held them all.
    assert table["L2 hits (shared memory)"][0] == "0.0%" and table["disk, read by this process"][0] != "0.0%"
    assert (table["disk, read by moe-l2d"][1], table["disk, read by this process"][1]) != ("0.0%", "0.0%")
    assert f"the restarted moe-l2d read {resident} experts" in first.stdout
    for warm in (2, 3, 4):
        assert (table["disk, read by moe-l2d"][warm], table["disk, read by this process"][warm]) == ("0.0%", "0.0%")
        assert table["read from disk by this process"][warm] == "0 B"
        assert float(table["L2 hits (shared memory)"][warm].rstrip("%")) > 0
    made = (tmp_path / DEMO_NAME / "config.json").stat().st_mtime_ns
    out = io.StringIO()
    assert ensure_demo_model(tmp_path, out=out) == tmp_path / DEMO_NAME  # made once: the next run finds it
    assert out.getvalue() == "" and (tmp_path / DEMO_NAME / "config.json").stat().st_mtime_ns == made


def _generate_parser():
    import argparse

    from moe_l2.cli import build_parser

    (sub,) = [a for a in build_parser("generate")._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["generate"]


def test_every_mlx_lm_generate_flag_is_taken_with_its_default_or_refused_with_a_reason():
    """mlx_lm.generate's parser, as installed, against moe-l2 generate's: the same option strings, defaults,
    nargs, numeric types and kinds of action, flag by flag; its flags that moe-l2 lacks are NOT_TAKEN's."""
    from mlx_lm.generate import setup_arg_parser

    from moe_l2.cli.generate import NOT_TAKEN, _NotTaken

    ours = {a.dest: a for a in _generate_parser()._actions if not isinstance(a, _NotTaken)}
    theirs = [a for a in setup_arg_parser()._actions if a.dest != "help"]
    missing = {a.option_strings[0] for a in theirs if a.dest not in ours}
    assert missing == set(NOT_TAKEN)
    for a in theirs:
        if a.dest in ours:
            mine = ours[a.dest]
            assert (set(mine.option_strings), mine.default, mine.nargs, type(mine)) == \
                   (set(a.option_strings), a.default, a.nargs, type(a)), a.dest
            if a.type in (int, float):
                assert mine.type is a.type, a.dest
    assert ours["model"].required  # mlx-lm's default model is a dense one


@pytest.mark.parametrize("flag", ["--draft-model", "--adapter-path", "--image", "--num-draft-tokens"])
def test_an_mlx_lm_flag_moe_l2_does_not_take_is_refused_with_the_reason(capsys, flag):
    from moe_l2.cli.generate import NOT_TAKEN

    with pytest.raises(SystemExit) as exit_:
        moe_l2_main(["generate", "--model", "m", flag, "x"])
    assert exit_.value.code == 2
    assert f"{flag} is mlx_lm.generate's, and moe-l2 generate does not take it: {NOT_TAKEN[flag]}" in \
           capsys.readouterr().err


# mlx_lm.generate's command lines, each given to both (with -m 12 --verbose False); "-p -" reads stdin.
# Greedy: at a temperature, mlx_lm.generate's --seed also drives the initial weights of the model it builds.
SAME_AS_MLX_LM = {
    "defaults": [],
    "greedy with sampling flags": ["-p", PROMPT, "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05", "--seed", "7"],
    "stdin, system prompt, rotating KV cache": ["-p", "-", "--system-prompt", "Answer briefly.", "--max-kv-size",
                                                "16", "--prefill-step-size", "5"],
    "quantized KV cache": ["-p", PROMPT, "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "4"],
    "template options": ["-p", "Route\\nthis", "--prefill-response", "The router",
                         "--chat-template-config", '{"enable_thinking": false}', "--extra-eos-token", "."],
    "no template": ["-p", PROMPT, "--ignore-chat-template"],
}


@pytest.mark.parametrize("flags", SAME_AS_MLX_LM.values(), ids=SAME_AS_MLX_LM)
def test_the_same_command_line_prints_mlx_lm_generates_text(capsys, monkeypatch, model_dir, flags):
    """The model loaded whole by mlx_lm.generate's own main() and moe-l2 generate, same flags: the same text."""
    from mlx_lm.generate import main as mlx_lm_generate

    argv = ["--model", str(model_dir), *flags, "-m", "12", "--verbose", "False"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    monkeypatch.setattr(sys, "argv", ["mlx_lm.generate", *argv])
    mlx_lm_generate()
    want = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    assert moe_l2_main(["generate", *argv, "--no-daemon"]) == 0
    assert capsys.readouterr().out == want and want.strip()


def test_a_prompt_cache_file_continues_as_mlx_lm_generate_does(capsys, monkeypatch, model_dir, tmp_path):
    """A KV cache saved by mlx_lm.cache_prompt: moe-l2 generate prints mlx_lm.generate's text from it; it refuses
    the cache for another model (a wrong command line) and a file that is no cache (exit status 1)."""
    from mlx_lm.cache_prompt import main as mlx_lm_cache_prompt
    from mlx_lm.generate import main as mlx_lm_generate

    saved = tmp_path / "prefix.safetensors"
    monkeypatch.setattr(sys, "argv", ["mlx_lm.cache_prompt", "--model", str(model_dir), "--prompt",
                                      "You answer questions about routers.", "--prompt-cache-file", str(saved)])
    mlx_lm_cache_prompt()
    capsys.readouterr()
    argv = ["--model", str(model_dir), "--prompt-cache-file", str(saved), "-p", PROMPT, "-m", "12",
            "--verbose", "False"]
    monkeypatch.setattr(sys, "argv", ["mlx_lm.generate", *argv])
    mlx_lm_generate()
    want = capsys.readouterr().out
    assert moe_l2_main(["generate", *argv, "--no-daemon"]) == 0
    assert capsys.readouterr().out == want and want.strip()
    assert moe_l2_main(["generate", *argv[:2], *argv[4:], "--no-daemon"]) == 0
    assert capsys.readouterr().out != want  # the cached prefix counted
    assert moe_l2_main(["generate", "--model", str(tmp_path), *argv[2:], "--no-daemon"]) == 2
    assert "was made with the model" in capsys.readouterr().err
    assert moe_l2_main(["generate", *argv[:2], "--prompt-cache-file", str(model_dir / "config.json"), *argv[4:],
                        "--no-daemon"]) == 1
    assert "give a file that mlx_lm.cache_prompt wrote" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--temp", "0.8", "--top-k", "5", "--top-p", "0.9"],
                                   ["--temp", "1.0", "--min-p", "0.05", "--xtc-probability", "0.5",
                                    "--xtc-threshold", "0.05"]])
def test_a_seed_samples_the_whole_models_tokens(capsys, model_dir, flags):
    """At a temperature, --seed gives the tokens of the model loaded whole, seeded once it is built, with the
    sampler mlx_lm.generate makes of the same flags; twice the same."""
    from mlx_lm.generate import setup_arg_parser
    from mlx_lm.sample_utils import make_sampler

    whole, tokenizer = load(str(model_dir))
    a = setup_arg_parser().parse_args(flags)
    sampler = make_sampler(a.temp, a.top_p, a.min_p, a.min_tokens_to_keep, top_k=a.top_k,
                           xtc_probability=a.xtc_probability, xtc_threshold=a.xtc_threshold,
                           xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
    mx.random.seed(11)
    want = [r.token for r in stream_generate(whole, tokenizer, mx.array(encode_prompt(tokenizer, PROMPT)),
                                             max_tokens=12, sampler=sampler)]
    runs = [run_json(capsys, "--model", str(model_dir), "-p", PROMPT, "--no-daemon", *flags, "--seed", "11")
            for _ in range(2)]
    assert [s["tokens"] for s in runs] == [want, want]
    greedy = run_json(capsys, "--model", str(model_dir), "-p", PROMPT, "--no-daemon")
    assert greedy["tokens"] != want  # the flags did sample


@pytest.mark.parametrize("args, message", [
    (["--max-kv-size", "0"], "--max-kv-size must be at least 1"),
    (["--kv-group-size", "0"], "--kv-group-size must be at least 1"),
])
def test_bad_mlx_lm_values_are_a_wrong_command_line(capsys, model_dir, args, message):
    assert moe_l2_main(["generate", "--model", str(model_dir), "--no-daemon", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--kv-bits", "7"], ["--verbose"], ["--chat-template-config", "[1]"],
                                  ["-m", "many"]])
def test_values_the_parser_refuses(capsys, args):
    with pytest.raises(SystemExit) as exit_:
        moe_l2_main(["generate", "--model", "m", *args])
    assert exit_.value.code == 2


def test_the_demo_says_what_dominates_a_token():
    def run(wall_s, stall_s):
        return {"generated": 10, "wall_s": wall_s, "stall_s": stall_s}

    assert render_verdict(run(1.0, 0.1), run(0.9, 0.002), run(0.9, 0.003)) == (
        "on this machine compute dominates: run 1 spent 90.0 ms per token computing and 10.00 ms waiting for "
        "experts; with L2 warm, the wait was 0.20 ms (run 2), 0.30 ms (process 2)")
    assert render_verdict(run(1.0, 0.6), run(0.4, 0.0), run(0.4, 0.0)).startswith(
        "on this machine waiting for experts dominates: run 1 spent 40.0 ms per token computing and 60.00 ms")


def test_the_demo_says_what_the_daemon_changed_for_one_process():
    def run(stall_s, read, daemon_read=0):
        return {"generated": 10, "stall_s": stall_s, "counts": TierCounts(bytes_read=read), "daemon_read": daemon_read}

    assert render_gains(run(0.05, 4 << 20), run(0.03, 1 << 20, 2 << 20), run(0.004, 0), run(0.004, 0),
                        run(0.005, 0)) == (
        "one process against none: alone (no daemon, nothing cached) waited 5.00 ms a token for experts and read "
        "4.0 MiB from disk; with moe-l2d, run 1 (L2 cold) 3.00 ms and 3.0 MiB, run 2 (L2 warm) 0.40 ms and 0 B, "
        "process 2 (L2 warm) 0.40 ms and 0 B, process 3 (restart) 0.50 ms and 0 B")
