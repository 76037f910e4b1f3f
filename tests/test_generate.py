"""`moe-l2 generate` and `moe-l2 demo`, checked against the model loaded whole by mlx-lm."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2.cli import main as moe_l2_main
from moe_l2.client.generation import encode_prompt
from moe_l2.commands.demo import COLUMN_WIDTH, DEMO_NAME, LABEL_WIDTH, ensure_demo_model, render_verdict
from moe_l2.commands.generate import render
from moe_l2.cache.trace import read_traces
from moe_l2.model import ModelFiles
from moe_l2.sizes import format_pct, format_size

from .conftest import budget_for, stats, wait_for


PROMPT = "Which experts does the router pick for this sentence?"


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    whole, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, PROMPT)
    return [r.token for r in stream_generate(whole, tokenizer, mx.array(ids), max_tokens=12)]


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
    assert s["bytes_read"] == s["l3_reads"] * model_files.layout.nbytes
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
    assert warm["bytes_copied"] == (warm["l2_hits"] + warm["daemon_reads"] - warm["l2_lent"]) * model_files.layout.nbytes


def test_by_default_a_miss_is_read_once_by_the_daemon_and_computed_on_in_l2(capsys, daemon_factory, model_dir,
                                                                            model_files, expected):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    # The default path, with a wait long enough for a loaded CI machine.
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                 "--l0-slots", "4", "--load-through-ms", "5000")
    assert s["tokens"] == expected
    assert s["l2_lent"] > 0 and s["bytes_copied"] == 0
    # L2 has room for every expert: each miss was read once, by the daemon, while the client waited. That is
    # the cold run's disk share, not L2 hits (those are the experts L0 dropped and L2 already held).
    loaded = stats(daemon)["models"][0]["loads_done"]
    assert s["l3_reads"] == 0 and s["bytes_read"] == 0 and loaded == s["daemon_reads"] > 0
    assert s["disk_rate"] == pytest.approx(loaded / s["expert_lookups"])
    assert s["l0_hits"] + s["l2_hits"] + s["daemon_reads"] == s["expert_lookups"]
    summary = render(s).splitlines()[1]
    assert (f"L2 {format_pct(s['l2_hit_rate'])}, disk {format_pct(s['disk_rate'])} (read by moe-l2d while waiting "
            f"{format_pct(s['daemon_read_rate'])}") in summary
    # A second process finds in L2 what the first had the daemon read: the same lookups, L2's share, no disk.
    warm = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                    "--l0-slots", "4", "--load-through-ms", "5000")
    assert warm["tokens"] == expected
    assert warm["daemon_reads"] == warm["l3_reads"] == 0 and warm["disk_rate"] == 0
    assert warm["l2_hits"] == s["l2_hits"] + s["daemon_reads"]
    assert stats(daemon)["models"][0]["loads_done"] == loaded


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
    assert s["l0_bytes"] == (model_files.top_k + 1) * model_files.layout.nbytes


def test_with_a_shared_l0_prefetch_has_the_daemon_load_the_guesses(capsys, daemon_factory, model_dir, model_files,
                                                                    expected):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, model_files.n_experts)))
    s = run_json(capsys, "--model", str(model_dir), "--prompt", PROMPT, "--socket", daemon.socket,
                 "--l0-slots", str(model_files.top_k), "--l0-shared", "--prefetch", "logistic",
                 "--load-through-ms", "5000")
    assert s["tokens"] == expected
    p = s["prefetch"]
    assert p["issued"] > 0 and p["useful"] + p["wasted"] == p["issued"]
    # L2 has room for every expert and every miss waits for the daemon, so the loads no fetch waited for are
    # the guesses the daemon was asked for.
    loaded = stats(daemon)["models"][0]["loads_done"]
    assert s["daemon_reads"] < loaded <= s["daemon_reads"] + p["issued"]
    assert s["bytes_read"] == 0 and s["bytes_copied"] == 0


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
                 "attached to the daemon: run 1 yes, run 2 yes, process 2 yes", "shared memory cleaned up"):
        assert line in first.stdout
    assert "dominates: run 1 spent" in first.stdout
    # Label, then a column per run: run 1 (L2 cold), run 2 (L2 warm), process 2 (L2 warm).
    table = {line[:LABEL_WIDTH].strip(): [line[LABEL_WIDTH + COLUMN_WIDTH * i:][:COLUMN_WIDTH].strip()
                                          for i in range(3)]
             for line in first.stdout.splitlines() if len(line) > LABEL_WIDTH}
    for row in ("waiting for experts, ms/token", "time to first token, ms"):
        assert all(float(v) >= 0 for v in table[row]), row
    # Ground truth for run 1's disk bytes: every expert moe-l2d holds after it was read once, at the record size
    # of the model's file layout (nothing is evicted: L2 holds every expert).
    resident = int(first.stdout.split("run 1: moe-l2d read ")[1].split()[0])
    record = ModelFiles.open(tmp_path / DEMO_NAME).layout.nbytes
    assert resident > 0
    assert table["read from disk by moe-l2d"] == [format_size(resident * record), "0 B", "0 B"]
    # Cold, every expert not yet in L2 came from disk: read by the process, or by the daemon while it waited;
    # warm, in this process or a second one, L2 held them all.
    assert (table["disk, read by moe-l2d"][0], table["disk, read by this process"][0]) != ("0.0%", "0.0%")
    for warm in (1, 2):
        assert (table["disk, read by moe-l2d"][warm], table["disk, read by this process"][warm]) == ("0.0%", "0.0%")
        assert table["read from disk by this process"][warm] == "0 B"
        assert float(table["L2 hits (shared memory)"][warm].rstrip("%")) > 0
    made = (tmp_path / DEMO_NAME / "config.json").stat().st_mtime_ns
    out = io.StringIO()
    assert ensure_demo_model(tmp_path, out=out) == tmp_path / DEMO_NAME  # made once: the next run finds it
    assert out.getvalue() == "" and (tmp_path / DEMO_NAME / "config.json").stat().st_mtime_ns == made


def test_the_demo_says_what_dominates_a_token():
    def run(wall_s, stall_s):
        return {"generated": 10, "wall_s": wall_s, "stall_s": stall_s}

    assert render_verdict(run(1.0, 0.1), run(0.9, 0.002), run(0.9, 0.003)) == (
        "on this machine compute dominates: run 1 spent 90.0 ms per token computing and 10.00 ms waiting for "
        "experts; with L2 warm, the wait was 0.20 ms (run 2), 0.30 ms (process 2)")
    assert render_verdict(run(1.0, 0.6), run(0.4, 0.0), run(0.4, 0.0)).startswith(
        "on this machine waiting for experts dominates: run 1 spent 40.0 ms per token computing and 60.00 ms")
