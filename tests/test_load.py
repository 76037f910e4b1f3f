"""moe_l2.load: mlx-lm's own generate, stream_generate and batch_generate on a streamed model, against the model
loaded whole by mlx_lm.load; closing, counting, and the one owner of the streaming options (client/options.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys
import threading

import mlx.core as mx
import pytest
from mlx_lm import batch_generate, generate, load as load_whole, stream_generate

import moe_l2
from moe_l2.cli import main as moe_l2_main
from moe_l2.client import ExpertPool, L2Client, OptionError, StreamOptions
from moe_l2.lm.streamed_lm import streamed
from moe_l2.client.options import DEFAULTS, add_arguments, from_args
from moe_l2.cli import bench
from moe_l2.cli import generate as generate_command
from moe_l2.cli import serve

PROMPTS = ["Which experts does the router pick?", "The cache keeps what the router picks most often"]
TOKENS = 6


@pytest.fixture(scope="module")
def whole(model_dir):
    return load_whole(str(model_dir))


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("moe-l2")]


def assert_as_whole(model, tokenizer, whole) -> None:
    """generate, stream_generate and batch_generate give the whole model's tokens at temperature 0."""
    reference, reference_tokenizer = whole
    ids = [reference_tokenizer.encode(p) for p in PROMPTS]
    assert generate(model, tokenizer, PROMPTS[0], max_tokens=TOKENS) == \
        generate(reference, reference_tokenizer, PROMPTS[0], max_tokens=TOKENS)
    assert [r.token for r in stream_generate(model, tokenizer, mx.array(ids[1]), max_tokens=TOKENS)] == \
        [r.token for r in stream_generate(reference, reference_tokenizer, mx.array(ids[1]), max_tokens=TOKENS)]
    got = batch_generate(model, tokenizer, ids, max_tokens=TOKENS, return_token_ids=True)
    want = batch_generate(reference, reference_tokenizer, ids, max_tokens=TOKENS, return_token_ids=True)
    assert got.token_ids == want.token_ids and got.texts == want.texts


def assert_counts_add_up(model) -> moe_l2.ExpertStats:
    s = moe_l2.stats(model)
    assert isinstance(s, moe_l2.ExpertStats)
    assert s.l0_hits + s.l2_hits + s.daemon_reads + s.disk_reads == s.lookups > 0
    assert s.l2_lent <= s.l2_hits + s.daemon_reads
    return s


def test_with_the_daemon_at_the_default_socket(monkeypatch, running_daemon, model_dir, model_files, whole):
    monkeypatch.setenv("MOE_L2_RUNTIME_DIR", running_daemon.env_runtime_dir)
    before = client_threads()
    model, tokenizer = moe_l2.load(str(model_dir))
    with model:
        assert streamed(model).options == StreamOptions()  # the library's defaults are the dataclass'
        assert streamed(model).pool.shared_l0  # a daemon, in-place reads: one set of rows for all layers
        assert_as_whole(model, tokenizer, whole)
        s = assert_counts_add_up(model)
        assert s.daemon == running_daemon.socket
        assert s.l2_hits > 0 and s.l2_lent > 0  # computed on in L2's shared memory
        assert s.bytes_read == s.disk_reads * model_files.layout.nbytes
    assert client_threads() == before  # `with model:` closed the daemon link
    moe_l2.close(model)  # again: nothing to do


def test_without_a_daemon_it_reads_the_files_and_says_so(monkeypatch, caplog, tmp_path, model_dir, model_files,
                                                         whole):
    monkeypatch.setenv("MOE_L2_RUNTIME_DIR", str(tmp_path))
    before = client_threads()
    with caplog.at_level(logging.WARNING, logger="moe-l2.client"):
        model, tokenizer = moe_l2.load(str(model_dir), client_wait_s=0.2, l0_slots=model_files.top_k + 1,
                                       shared_l0=False, prefetch="logistic")
    said = [r.message for r in caplog.records if "reading experts from the model files only" in r.message]
    assert len(said) == 1 and str(tmp_path) in said[0]
    try:
        assert_as_whole(model, tokenizer, whole)
        s = assert_counts_add_up(model)
        assert s.daemon is None and s.l2_hits == 0 and s.disk_reads > 0
        assert streamed(model).pool.capacity == model_files.top_k + 1
        assert any(t.name == "moe-l2-prefetch" for t in client_threads())
    finally:
        moe_l2.close(model)
    assert client_threads() == before  # the prefetch worker and the daemon link are gone


def test_an_unknown_option_is_refused_with_the_valid_names(model_dir):
    with pytest.raises(TypeError) as refused:
        moe_l2.load(str(model_dir), l2_read="copy")
    assert "'l2_read'" in str(refused.value)
    assert all(f.name in str(refused.value) for f in dataclasses.fields(StreamOptions))


@pytest.mark.parametrize("options, names", [
    ({"l2_reads": "mmap"}, "l2_reads takes one of in-place, copy"),
    ({"prefetch_from": "trace.jsonl.gz"}, "prefetch_from seeds next-layer prefetch, which is off: give prefetch"),
    ({"shared_l0": True, "policy": "lfu"}, "policy 'lfu' needs per-layer rows"),
    ({"load_through_ms": -1}, "load_through_ms takes 0 or more"),
])
def test_bad_values_are_refused_in_the_librarys_terms(model_dir, options, names):
    with pytest.raises(OptionError) as refused:
        moe_l2.load(str(model_dir), **options)
    assert names in str(refused.value) and "--" not in str(refused.value)


def test_the_command_line_names_the_flags(capsys, model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    assert moe_l2_main(["generate", "--model", str(model_dir), "--prompt", "hi", "--no-daemon",
                        "--prefetch-from", str(trace)]) == 2
    assert "--prefetch-from seeds next-layer prefetch, which is off: give --prefetch too" in capsys.readouterr().err


REQUIRED = {generate_command: ["--model", "m", "--prompt", "p"], serve: ["--model", "m"], bench: ["--trace", "t"]}
WITH_FLAGS = [f.name for f in dataclasses.fields(StreamOptions) if f.metadata["flag"]]


@pytest.mark.parametrize("command, fields", [(generate_command, WITH_FLAGS), (serve, WITH_FLAGS),
                                             (bench, list(bench.STREAMING))])
def test_every_streaming_default_is_the_dataclass(command, fields):
    """Each command's parser, given no streaming flag, gives the options the library uses by default."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(REQUIRED[command])
    given = [f.name for f in dataclasses.fields(StreamOptions) if hasattr(args, f.name)]
    assert sorted(given) == sorted(fields)
    assert {name: getattr(args, name) for name in given} == {name: getattr(DEFAULTS, name) for name in given}
    assert from_args(args) == StreamOptions()


@pytest.mark.parametrize("flags, expected", [
    ([], None), (["--l0-shared"], True), (["--no-l0-shared"], False), (["--l0", "shared"], True),
    (["--l0", "per-layer"], False),
])
def test_the_l0_layout_flags(flags, expected):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(flags).shared_l0 is expected


def test_old_flags_give_the_options_they_always_gave():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--no-daemon", "--direct-io", "off", "--verify-checksums", "all", "--l2-reads", "copy",
                              "--load-through-ms", "0", "--l0-budget", "1MiB", "--prefetch", "cooccurrence"])
    options = from_args(args)
    assert (options.daemon, options.direct, options.verify, options.lend, options.load_through_s) == \
        (False, False, "all", False, 0.0)
    assert (options.l0_budget, options.prefetch, options.l0_shared) == ("1MiB", "cooccurrence", False)


def test_the_default_l0_layout_follows_the_daemon_and_the_l2_reads():
    assert StreamOptions().l0_shared
    assert not StreamOptions(daemon=False).l0_shared
    assert not StreamOptions(l2_reads="copy").l0_shared
    assert not StreamOptions(policy="adaptive").l0_shared
    assert not StreamOptions(shared_l0=False).l0_shared


def test_the_pool_and_the_client_are_context_managers(running_daemon, model_files):
    before = client_threads()
    with L2Client(model_files, running_daemon.socket, wait_s=5) as client, \
            ExpertPool(model_files, 4, client) as pool:
        assert client.attached
        assert pool.fetch(0, [0, 1]).l3_reads == 2
    assert pool.loader.fds == [] and client_threads() == before


def test_importing_the_package_loads_no_mlx_lm():
    code = ("import sys, moe_l2, moe_l2.client; from moe_l2.client import ExpertPool, L2Client, StreamOptions; "
            "print(moe_l2.__version__, sorted({'mlx_lm', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [moe_l2.__version__, "[]"]
