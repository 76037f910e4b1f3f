"""moe-l2d over real ZeroMQ and real POSIX shared memory: serving, refusing bad input, stopping, restarting."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from moe_l2 import _native, protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.layout import IndexHeader
from moe_l2.machine import SharedMemoryRoom
from moe_l2.sizes import format_size

from .conftest import ANSWER_MS, budget_for, daemon_segments, run_daemon, segment_exists, stats, wait_for


def test_stats_describe_the_served_model(running_daemon, model_files):
    s = stats(running_daemon)
    assert s["daemon"]["pid"] == running_daemon.proc.pid
    (m,) = s["models"]
    assert m["fingerprint"] == model_files.fingerprint
    assert m["slots_per_layer"] == model_files.n_experts // 4
    assert len(m["layers"]) == model_files.n_layers
    assert m["hits"] == m["misses"] == m["loads_done"] == 0 and m["hit_rate"] is None


def test_prefetched_experts_are_served_from_l2_byte_exact(running_daemon, model_files):
    fp = model_files.fingerprint
    for layer in range(model_files.n_layers):
        request(running_daemon.socket, protocol.Prefetch(id=1, model=fp, layer=layer, experts=[0, 5, 9]))
    wait_for(lambda: stats(running_daemon)["models"][0]["loads_done"] == 3 * model_files.n_layers,
             what="prefetch loads")
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    assert client.attached
    pool = ExpertPool(model_files, capacity=4, client=client)
    try:
        for layer in range(model_files.n_layers):
            counts = pool.fetch(layer, [0, 5, 9, 3])
            assert (counts.l2_hits, counts.l3_reads) == (3, 1)
            for expert in (0, 5, 9, 3):
                assert pool.layers[layer].record(expert) == model_files.read_record(layer, expert)
    finally:
        pool.close()
        client.close()
    # The client's report arrives asynchronously: 3 hits and 1 miss per layer.
    wait_for(lambda: stats(running_daemon)["models"][0]["misses"] == model_files.n_layers, what="report")
    m = stats(running_daemon)["models"][0]
    assert m["hits"] == 3 * model_files.n_layers
    assert m["served_bytes"] == m["hits"] * model_files.layout.nbytes


def send_raw(sock, frame: bytes) -> protocol.Reply:
    sock.send(frame)
    assert sock.poll(ANSWER_MS), "daemon did not answer"
    return protocol.decode_reply(sock.recv())


def test_bad_requests_get_error_replies_and_the_daemon_serves_on(running_daemon, model_files):
    fp = model_files.fingerprint
    ok = {"v": protocol.PROTOCOL_VERSION, "id": 1}
    cases = [
        (b"\xc1 not msgpack", "MalformedFrame"),
        (msgpack.packb({**ok, "type": "explode"}), "UnknownType"),
        (msgpack.packb({"v": 999, "id": 1, "type": "stats"}), "VersionMismatch"),
        (b"\x80" * (protocol.MAX_FRAME_BYTES + 10), "FrameTooLarge"),
        (protocol.Prefetch(id=1, model="nope", layer=0, experts=[1]).encode(), "UnknownModel"),
        (protocol.Prefetch(id=1, model=fp, layer=99, experts=[1]).encode(), "OutOfRange"),
        (protocol.Prefetch(id=1, model=fp, layer=0, experts=[model_files.n_experts]).encode(), "OutOfRange"),
        (protocol.Report(id=1, model=fp, layers={0: [[], [-1]]}).encode(), "OutOfRange"),
        (protocol.Pin(id=1, model=fp, layer=0, experts=[1], kind="forever").encode(), "BadField"),
        (protocol.Hello(id=1, model=str(model_files.path), fingerprint="0" * 32, client="t").encode(),
         "FingerprintMismatch"),
        (protocol.Hello(id=1, model="/elsewhere", fingerprint="0" * 32, client="t").encode(), "UnknownModel"),
        (protocol.Hint(id=1, model=fp, text="hello").encode(), "NoProfile"),
    ]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(running_daemon.socket)
    try:
        for frame, ename in cases:
            reply = send_raw(sock, frame)
            assert not reply.ok and reply.ename == ename, (ename, reply)
            assert reply.evalue
        # A multi-frame message is answered too.
        sock.send_multipart([b"", protocol.Stats(id=5).encode()])
        assert sock.poll(ANSWER_MS) and protocol.decode_reply(sock.recv()).id == 5
    finally:
        sock.close(0)
    s = stats(running_daemon)
    assert s["daemon"]["errors"] == len(cases) - 1  # NoProfile is an answer, not a refused request
    assert s["models"][0]["loads_done"] == 0  # nothing refused had an effect
    assert running_daemon.proc.poll() is None


def test_pins_load_and_survive_eviction_pressure(running_daemon, model_files):
    fp = model_files.fingerprint
    reply = request(running_daemon.socket, protocol.Pin(id=1, model=fp, layer=1, experts=[2, 7, 11],
                                                        kind="permanent"))
    assert reply.ok
    assert reply.payload["pinned"] == [2, 7] and reply.payload["refused"] == [11]  # 4 slots: 2 pinnable
    for expert in range(model_files.n_experts):
        request(running_daemon.socket, protocol.Prefetch(id=2, model=fp, layer=1, experts=[expert]))
        wait_for(lambda: stats(running_daemon)["models"][0]["layers"][1]["loading"] == 0, what="load")
    layer = stats(running_daemon)["models"][0]["layers"][1]
    assert layer["pinned"] == 2 and layer["resident"] == 4
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    pool = ExpertPool(model_files, capacity=2, client=client)
    try:
        assert pool.fetch(1, [2, 7]).l2_hits == 2
    finally:
        pool.close()
        client.close()


def test_sigterm_stops_cleanly_and_unlinks_segments(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 2)))
    client = L2Client(model_files, daemon.socket, wait_s=5)
    names = [client.attachment.index.name, *(s.name for s in client.attachment.data)]
    client.close()
    assert all(segment_exists(n) for n in names)
    assert daemon.stop(signal.SIGTERM) == 0, daemon.log()
    assert not any(segment_exists(n) for n in names)
    assert not (daemon.runtime_dir / "moe-l2d.sock").exists()
    assert "segments unlinked" in daemon.log()


def test_restart_after_kill9_reclaims_segments(daemon_factory, model_dir, model_files):
    first = daemon_factory([model_dir], str(budget_for(model_files, 2)))
    client = L2Client(model_files, first.socket, wait_s=5)
    old = client.attachment
    left = [old.index.name, *(segment.name for segment in old.data)]
    client.close()
    first.kill9()
    assert all(segment_exists(name) for name in left)  # a crash leaves them behind
    second = daemon_factory([model_dir], str(budget_for(model_files, 2)), runtime_dir=first.runtime_dir)
    assert "reclaimed shared-memory segment" in second.log()
    assert not any(segment_exists(name) for name in left)
    index, _ = daemon_segments(second, model_files)
    assert index not in left  # names are chosen anew at each start
    assert IndexHeader.unpack(_native.Segment.open(index).view()).epoch != old.epoch
    assert second.stop() == 0
    assert not segment_exists(index)


def test_second_daemon_on_the_same_socket_is_refused(running_daemon, model_dir, model_files):
    result = subprocess.run(
        [sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(model_dir), "--budget", "1MiB",
         "--runtime-dir", str(running_daemon.runtime_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "already serving" in result.stderr
    assert stats(running_daemon)["daemon"]["pid"] == running_daemon.proc.pid  # untouched


@pytest.mark.parametrize("args, code, words", [
    (["--budget", "1GiB"], 2, "--budget needs a --model"),
    ([], 2, "nothing to serve"),
    (["--model", "{model}"], 2, "--budget is required"),
    (["--model", "{model}", "--budget", "lots"], 2, "invalid size 'lots'"),
    (["--model", "{model}", "--budget", "1G", "--policy", "fifo"], 2, "invalid choice"),
    (["--model", "{model}", "--budget", "1G", "--shm-mode", "777"], 2, "nothing executable"),
    (["--model", "{model}", "--budget", "1G", "--socket", "http://x"], 2, "ipc://PATH or tcp://"),
    (["--model", "/nonexistent/model", "--budget", "1G"], 1, "cannot serve /nonexistent/model"),
    (["--model", "{model}", "--budget", "4KiB"], 1, "too small"),
    (["--model", "{model}", "--budget", "1G", "--config", "/nonexistent.toml"], 2, "cannot read config"),
    (["--model", "{model}", "--budget", "1G", "--loader-threads", "0"], 2,
     "--loader-threads must be an integer from 1 to 256, got 0"),
])
def test_bad_flags_fail_at_start_with_a_clear_message(args, code, words, model_dir):
    result = run_daemon(*[a.format(model=model_dir) for a in args])
    assert result.returncode == code, result.stderr
    assert words in result.stderr


# ---- the option table (daemon/config.py OPTIONS) drives the flags, the TOML keys, the checks and the README ----


def toml_literal(value) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) else str(value)


def config_file(tmp_path, top: dict | None = None, model: dict | None = None):
    lines = [f"{key} = {toml_literal(value)}" for key, value in (top or {}).items()]
    lines += ["[[model]]", *(f"{key} = {toml_literal(value)}"
                             for key, value in {"path": "/m", "budget": "1GiB", **(model or {})}.items())]
    path = tmp_path / "moe-l2d.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def resolved(*argv):
    from moe_l2.daemon.config import build_parser, resolve

    return resolve(build_parser().parse_args(list(argv)))


def integer_bounds():
    from moe_l2.daemon.config import OPTIONS, Integer

    for o in OPTIONS:
        if isinstance(o.kind, Integer):
            yield pytest.param(o, o.kind.low - 1, id=f"{o.name}-below-{o.kind.low}")
            yield pytest.param(o, o.kind.high + 1, id=f"{o.name}-above-{o.kind.high}")


@pytest.mark.parametrize("option, value", list(integer_bounds()))
def test_a_value_past_a_bound_is_refused_with_the_range_from_a_flag_and_from_toml(option, value, tmp_path):
    from moe_l2.daemon.config import ConfigError

    low, high = option.kind.low, option.kind.high
    with pytest.raises(ConfigError, match=f"^{option.option} must be an integer from {low} to {high}, got {value}$"):
        resolved("--model", "/m", "--budget", "1G", option.option, str(value))
    config = config_file(tmp_path, top={option.name: value})
    with pytest.raises(ConfigError, match=f"^{option.name} in {config} must be an integer from {low} to {high}, "
                                          f"got {value}$"):
        resolved("--config", str(config))
    for inside in (low, high):  # the bounds themselves are in range
        assert getattr(resolved("--model", "/m", "--budget", "1G", option.option, str(inside)), option.name) == inside
        assert getattr(resolved("--config", str(config_file(tmp_path, top={option.name: inside}))),
                       option.name) == inside


# A value other than the default for the options whose default is unset, with what it needs beside it.
EXAMPLES = {
    "path": ("/n", {}), "budget": ("2GiB", {}), "layers": ("0-1", {}), "profile": ("/p.json", {}),
    "socket": ("ipc:///tmp/moe-l2-example.sock", {}), "runtime_dir": ("/tmp/moe-l2-example", {}),
    "state_dir": ("/tmp/moe-l2-state-example", {}),
    "socket_group": ("0", {}), "metrics": ("127.0.0.1:9464", {}),
    "curve_secret_key": ("{secret}", {"curve_clients": "{clients}", "socket": "tcp://127.0.0.1:5557"}),
    "curve_clients": ("{clients}", {"curve_secret_key": "{secret}", "socket": "tcp://127.0.0.1:5557"}),
}


def test_every_option_is_a_flag_and_a_toml_key_with_its_default(tmp_path):
    import zmq.auth

    from moe_l2.daemon.config import BOTH, MODEL, OPTIONS, TOP, DaemonConfig, ModelConfig, Switch, build_parser

    (tmp_path / "clients").mkdir()
    _, secret = zmq.auth.create_certificates(str(tmp_path), "daemon")
    Path(secret).chmod(0o600)
    names = {"secret": secret, "clients": str(tmp_path / "clients")}
    parser = build_parser()
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert flags == {"-h", "--help", "--config", "--version", *(o.option for o in OPTIONS)}
    by_name = {o.name: o for o in OPTIONS}
    plain = resolved("--config", str(config_file(tmp_path)))
    assert plain == resolved("--model", "/m", "--budget", "1GiB")
    for o in OPTIONS:
        (action,) = [a for a in parser._actions if o.option in a.option_strings]
        assert action.help.replace("%%", "%") == o.full_help() and o.help
        where = {TOP: [DaemonConfig], MODEL: [ModelConfig], BOTH: [DaemonConfig, ModelConfig]}[o.scope]
        fields = [f for cls in where for f in cls.__dataclass_fields__]
        if o.default is not None:  # unset but for what the flag or key gives, or a value found at start
            if o.name in fields:
                found = plain.models[0] if o.scope != TOP else plain
                assert getattr(found, o.name) == o.default_value(), o.name
            value, extra = o.default, {}
        else:
            value, extra = EXAMPLES[o.name]
        value = value.format(**names) if isinstance(value, str) else value
        extra = {k: v.format(**names) for k, v in extra.items()}
        top = {k: v for k, v in {o.name: value, **extra}.items() if by_name[k].scope != MODEL}
        model = {k: v for k, v in {o.name: value, **extra}.items() if by_name[k].scope == MODEL}
        keyed = resolved("--config", str(config_file(tmp_path, top, model)))
        if o.name == "path":  # --model adds a model beside the file's
            assert [str(m.path) for m in resolved("--model", "/n", "--budget", "1GiB").models] == ["/n"]
            continue
        argv = [arg for k, v in {o.name: value, **extra}.items()
                for arg in ([by_name[k].option] if isinstance(by_name[k].kind, Switch) else [by_name[k].option, str(v)])
                if not (isinstance(by_name[k].kind, Switch) and v is False)]
        flagged = resolved("--model", "/m", "--budget", "1GiB", *argv) if o.name != "budget" else \
            resolved("--model", "/m", *argv)
        assert flagged == keyed, o.name
        assert (keyed == plain) == (o.default is not None), o.name
        if o.scope == BOTH:  # also a [[model]] key
            assert resolved("--config", str(config_file(tmp_path, model={o.name: value}))) == keyed


def test_the_readme_table_of_flags_is_the_one_the_option_table_makes():
    from moe_l2.daemon.config import flags_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert flags_table() in readme, "README.md's moe-l2d flags differ from daemon/config.py's OPTIONS: paste " \
        "python -c 'from moe_l2.daemon.config import flags_table; print(flags_table(), end=\"\")'"


def write_sparse_model(directory, n_experts=64, expert_bytes=1 << 30):
    """A real safetensors checkpoint whose experts need far more memory than any test machine has.

    The file is sparse, so it costs no disk; only its headers are read before the budget check refuses it.
    """
    directory.mkdir()
    moe_hidden = expert_bytes // (4096 * 2)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": n_experts, "num_experts_per_tok": 2,
        "num_hidden_layers": 1, "hidden_size": 4096, "moe_intermediate_size": moe_hidden, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
        "vocab_size": 16, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": False}))
    header = {}
    offset = 0
    for proj, shape in (("down_proj", (4096, moe_hidden)), ("gate_proj", (moe_hidden, 4096)),
                        ("up_proj", (moe_hidden, 4096))):
        size = n_experts * moe_hidden * 4096 * 2
        header[f"model.layers.0.mlp.switch_mlp.{proj}.weight"] = {
            "dtype": "F16", "shape": [n_experts, *shape], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


def test_a_budget_the_machine_cannot_back_is_refused(tmp_path):
    model = tmp_path / "huge"
    write_sparse_model(model)
    result = run_daemon("--model", str(model), "--budget", "100TiB")
    assert result.returncode == 1, result.stderr
    assert "of memory is available; lower --budget" in result.stderr or "/dev/shm has" in result.stderr


def test_a_budget_above_what_the_model_needs_is_reported_with_what_l2_takes(daemon_factory, model_dir, model_files):
    daemon = daemon_factory([model_dir], "1GiB")
    every = budget_for(model_files, model_files.n_experts)
    taken = stats(daemon)["daemon"]["shm_bytes"]
    assert taken == every < 1 << 30
    (line,) = [line for line in daemon.log().splitlines() if "--budget 1.0 GiB" in line]
    assert f"--budget 1.0 GiB for {model_dir} is more than every expert" in line
    assert f"L2 takes {format_size(taken)}; the rest stays free" in line


def test_a_budget_above_memory_and_the_model_is_reported_in_one_line_with_what_l2_takes(daemon_factory, model_dir,
                                                                                        model_files):
    gib = (SharedMemoryRoom.read().total >> 30) * 4 + 4  # 100 GiB on this 24 GB machine; above memory anywhere
    daemon = daemon_factory([model_dir], f"{gib}GiB")
    taken = stats(daemon)["daemon"]["shm_bytes"]
    assert taken == budget_for(model_files, model_files.n_experts)
    (line,) = [line for line in daemon.log().splitlines() if f"--budget {gib}.0 GiB" in line]
    assert f"--budget {gib}.0 GiB for {model_dir} is more than this machine's memory (" in line
    assert re.search(r"(of memory is available|/dev/shm has .* free|this Mac has .* of memory)\) and more than "
                     r"every expert of its \d+ served layers needs", line), line
    assert f"L2 takes {format_size(taken)}; the rest stays free" in line


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("moe-l2d")
    assert exe, "pip install . installs the moe-l2d console script"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--budget" in result.stdout


STARTER = """
import json, sys, time
from moe_l2.lab.daemon_process import DaemonProcess
daemon = DaemonProcess.serving([sys.argv[1]], sys.argv[2]).start()
print(json.dumps({"pid": daemon.proc.pid, "segments": daemon.segments, "dir": str(daemon.runtime_dir)}), flush=True)
time.sleep(600)
"""


def test_a_daemon_process_ends_with_its_starter_killed_outright(model_dir, model_files):
    """A demo, bench or test run killed with SIGKILL cleans nothing itself: its DaemonProcess ends on its own
    (lab/lifeline.py), unlinking its segments, instead of serving on as an orphan."""
    starter = subprocess.Popen([sys.executable, "-P", "-c", STARTER, str(model_dir), str(budget_for(model_files, 2))],
                               stdout=subprocess.PIPE, text=True)
    started = {}
    try:
        started = json.loads(starter.stdout.readline())
        assert started["segments"] and all(segment_exists(name) for name in started["segments"])
        starter.kill()
        starter.wait()

        def ended(pid: int) -> bool:
            try:  # a zombie not yet reaped by its new parent has ended too
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_for(lambda: ended(started["pid"]), what="the orphaned daemon to end")
        assert not any(segment_exists(name) for name in started["segments"])
    finally:
        starter.kill()
        starter.stdout.close()
        if "dir" in started:  # the daemon's private runtime dir (its log) is what a killed starter leaves
            shutil.rmtree(started["dir"], ignore_errors=True)
