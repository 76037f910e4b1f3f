"""Asking moe-l2d (src/moe_l2/control.py, issues 20 and 21.3): every asker goes through one helper that speaks
CurveZMQ, refuses an impostor before saying anything, takes a bounded reply and reads a malformed one as a clear
error; the metrics exporter asks the same way; and files moe-l2 writes in a directory other users can write are
never written through a link planted there (src/moe_l2/atomic_file.py), a routing trace included (issue 37.4)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import zmq.auth
from prometheus_client.parser import text_string_to_metric_families

from moe_l2 import control, protocol
from moe_l2.atomic_file import UnsafeFile
from moe_l2.cache.trace import TraceWriter, read_traces
from moe_l2.cli import main as moe_l2_main
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.model import MANIFEST_NAME, ModelFiles
from moe_l2.model.packer import pack
from moe_l2.lab.random_models import make_model

from .conftest import AS_NOBODY, NOBODY, budget_for, nobody_runs_python, wait_for

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown and the planted links of another user need root")

# A plain ZeroMQ ROUTER posing as moe-l2d: "silent" never answers, "huge" answers everything with 300 MB, anything
# else is the JSON of the payload of every ok reply. It prints the type of every request it gets.
FAKE_DAEMON = r"""
import json, sys, msgpack, zmq
address, mode = sys.argv[1], sys.argv[2]
sock = zmq.Context().socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(address)
huge = b"\0" * (300 << 20) if mode == "huge" else None
while True:
    identity, frame = sock.recv_multipart()
    request = msgpack.unpackb(frame)
    print(request["type"], flush=True)
    if mode == "huge":
        sock.send_multipart([identity, huge], copy=False)
    elif mode != "silent":
        reply = {"v": 1, "id": request["id"], "status": "ok", **json.loads(mode)}
        sock.send_multipart([identity, msgpack.packb(reply)])
"""

DAEMON = {"version": "0", "pid": 1, "socket": "ipc:///x", "uptime_s": 1.0, "rss_bytes": 0, "clients": 0,
          "requests": 0, "errors": 0, "loads_in_flight": 0, "shm_bytes": 0}
LAYER = {"layer": 0, "resident": 1, "loading": 0, "pinned": 0, "slots": 2, "hits": 0, "misses": 0}
MODEL = {"path": "/m", "policy": "lru", "n_layers": 1, "n_experts": 4, "slots_per_layer": 2, "hit_rate": None,
         "hits": 0, "misses": 0, "served_bytes": 0, "loaded_bytes": 0, "loads_done": 0, "load_errors": 0,
         "loads_in_flight": 0, "load_latency_p50_s": None, "load_latency_p99_s": None, "shm_bytes": 0, "layers": [LAYER]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_daemon():
    """Factory: start a FAKE_DAEMON in a subprocess (what it holds is not this process' memory) on an ipc socket
    of a new directory; returns (address, the file it prints the requests' types to)."""
    started = []

    def start(mode: str) -> tuple[str, Path]:
        directory = short_tempdir()
        address = f"ipc://{directory}/moe-l2d.sock"
        seen = directory / "seen"
        with open(seen, "w") as out:
            started.append((subprocess.Popen([sys.executable, "-P", "-c", FAKE_DAEMON, address, mode], stdout=out),
                            directory))
        # Listening, not only bound: libzmq makes the file at bind(), and a connect before its listen() is refused.
        wait_for(lambda: accepts(directory / "moe-l2d.sock"), what="the fake daemon's socket")
        return address, seen

    yield start
    for proc, directory in started:
        proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


@pytest.fixture
def curve_keys(tmp_path, monkeypatch):
    """The daemon's arguments for CurveZMQ, and this process' environment set to use them."""
    keys, allowed = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    client_public, client_secret = zmq.auth.create_certificates(keys, "client")
    shutil.copy(client_public, allowed)
    os.chmod(server_secret, 0o600)
    monkeypatch.setenv("MOE_L2_CURVE_SERVER_KEY", server_public)
    monkeypatch.setenv("MOE_L2_CURVE_CLIENT_CERT", client_secret)
    return ["--curve-secret-key", server_secret, "--curve-clients", str(allowed)]


@pytest.mark.parametrize("transport", ["ipc", "tcp", "curve"])
def test_the_helper_round_trips_with_a_real_daemon(daemon_factory, model_dir, model_files, transport, request):
    extra = [] if transport == "ipc" else ["--socket", f"tcp://127.0.0.1:{free_port()}"]
    if transport == "curve":
        extra += request.getfixturevalue("curve_keys")
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 4)), *extra)
    address = daemon.socket if transport == "ipc" else extra[1]
    reply = control.request(address, protocol.Prefetch(id=7, model=model_files.fingerprint, layer=0, experts=[0, 1]))
    assert (reply.ok, reply.id) == (True, 7)
    wait_for(lambda: control.stats(address)["models"][0]["loads_done"] == 2, what="the prefetch's loads")
    figures = control.stats(address, routing=True)
    assert figures["daemon"]["pid"] == daemon.proc.pid
    assert figures["models"][0]["layers"][0]["experts"] == [0, 1] and "routing" in figures["models"][0]


def test_a_curve_daemon_serves_full_figures_to_its_metrics_exporter(daemon_factory, model_dir, model_files,
                                                                     curve_keys, monkeypatch):
    port, metrics = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    daemon = daemon_factory([model_dir], str(budget_for(model_files, 4)), "--socket", address, *curve_keys,
                            "--metrics", f"127.0.0.1:{metrics}")
    control.request(address, protocol.Prefetch(id=1, model=model_files.fingerprint, layer=1, experts=[2, 3, 5]))
    wait_for(lambda: control.stats(address)["models"][0]["loads_done"] == 3, what="the prefetch's loads")
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    samples = {(s.name, *sorted(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    model = ("model", str(model_dir))
    assert samples[("moe_l2_loads_total", model)] == 3
    assert samples[("moe_l2_layer_resident", ("layer", "1"), model)] == 3
    assert samples[("moe_l2_slots_per_layer", model)] == 4
    assert samples[("moe_l2_clients",)] == 0
    assert "scrape without figures" not in daemon.log()
    # The scrape did not need the client's keys: the daemon is refused to anyone without them.
    monkeypatch.delenv("MOE_L2_CURVE_CLIENT_CERT")
    monkeypatch.delenv("MOE_L2_CURVE_SERVER_KEY")
    with pytest.raises(TimeoutError):
        control.stats(address, timeout_s=0.5)


@needs_root
def test_an_impostor_socket_is_refused_by_stats_profile_and_verify(fake_daemon, model_dir, tmp_path, capsys,
                                                                   monkeypatch):
    address, seen = fake_daemon(json.dumps({"daemon": DAEMON, "models": [MODEL]}))
    path = Path(address[len("ipc://"):])
    os.chown(path.parent, NOBODY, NOBODY)
    os.chown(path, NOBODY, NOBODY)
    told = f"the directory {path.parent} belongs to nobody (uid {NOBODY}), whom this client does not trust"
    assert moe_l2_main(["stats", "--socket", address]) == 1
    assert f"refusing moe-l2d on {address}: {told}" in capsys.readouterr().err
    assert moe_l2_main(["profile", "--from-daemon", "--socket", address, "--out", str(tmp_path / "p.json")]) == 1
    assert told in capsys.readouterr().err and not (tmp_path / "p.json").exists()
    assert moe_l2_main(["verify", "--model", str(model_dir), "--socket", address, "--samples", "4"]) == 0
    out, err = capsys.readouterr()
    assert told in err and "0 from L2" in out
    assert seen.read_text() == ""  # refused before anything was sent: not even a hello with the model's path
    # Trusting that user is what lets the same socket be used.
    monkeypatch.setenv("MOE_L2_TRUSTED_UIDS", str(NOBODY))
    assert moe_l2_main(["stats", "--socket", address]) == 0
    assert seen.read_text() == "stats\n"


@pytest.mark.parametrize("payload, problem", [
    ({"daemon": {k: v for k, v in DAEMON.items() if k != "pid"}, "models": []}, "daemon.pid is missing"),
    ({"daemon": DAEMON, "models": [{**MODEL, "layers": [{**LAYER, "resident": "x"}]}]},
     "models[0].layers[0].resident is 'x', not an integer"),
    ({"daemon": DAEMON, "models": [{**MODEL, "routing": {"": [["many"]]}}]},
     "models[0].routing[''][0][0] is 'many', not an integer"),
    ({"daemon": DAEMON, "models": "none"}, "models is 'none', not a list"),
])
def test_a_malformed_stats_reply_is_a_clear_error(fake_daemon, payload, problem, tmp_path, capsys):
    address, _ = fake_daemon(json.dumps(payload))
    told = f"moe-l2d at {address} sent a malformed stats reply: {problem}; is it the same version? `moe-l2d --version`"
    assert moe_l2_main(["stats", "--socket", address]) == 1
    err = capsys.readouterr().err
    assert told in err and "Traceback" not in err
    assert moe_l2_main(["profile", "--from-daemon", "--socket", address, "--out", str(tmp_path / "p.json")]) == 1
    assert told in capsys.readouterr().err


# For each fake daemon in turn: ask it for stats, then attach an L2Client to it and read an expert through the
# pool; print what happened and this process' peak memory since it started.
CLIENT = r"""
import resource, sys
from moe_l2 import control
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.model import ModelFiles
files = ModelFiles.open(sys.argv[1])
for address in sys.argv[2:]:
    try:
        control.stats(address, timeout_s=0.5)
        print("stats answered")
    except TimeoutError:
        print("stats timed out")
    client = L2Client(files, address, wait_s=1.0, heartbeat_s=0.1, timeout_s=0.3)
    pool = ExpertPool(files, capacity=2, client=client)
    counts = pool.fetch(0, [1])
    print("attached" if client.attached else f"detached: {client.last_error}")
    print(f"read {counts.l3_reads} from the file, exact {pool.layers[0].record(1) == files.read_record(0, 1)}")
    pool.close()
    client.close()
    print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024))
"""


def test_a_silent_or_300_mb_answer_times_out_and_the_client_reads_its_files(fake_daemon, model_dir):
    (silent, silent_seen), (huge, huge_seen) = fake_daemon("silent"), fake_daemon("huge")
    run = subprocess.run([sys.executable, "-P", "-c", CLIENT, str(model_dir), silent, huge], capture_output=True,
                         text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert len(lines) == 8, run.stdout + run.stderr
    for answers in (lines[:4], lines[4:]):
        assert answers[0] == "stats timed out" and answers[2] == "read 1 from the file, exact True", run.stdout
        # Never "not msgpack": nothing was read. The hello timed out, or its retry found the new connection the
        # client makes after a time-out not yet up.
        assert answers[1] in ("detached: moe-l2d did not answer the heartbeat",
                              "detached: moe-l2d is not running"), run.stdout
    # A hello timed out and the heartbeat said hello again (after 300 MB, on a new connection: libzmq closes the
    # one that brought them for good).
    assert silent_seen.read_text().count("hello") >= 2 and huge_seen.read_text().count("hello") >= 2
    # The 300 MB were dropped unread (ZMQ_MAXMSGSIZE): the peak did not grow past the one with a silent daemon.
    peaks = int(lines[3].split()[1]), int(lines[7].split()[1])
    assert peaks[1] - peaks[0] < 64 << 20, peaks


@needs_root
def test_a_link_planted_in_a_shared_model_dir_is_never_written_through(model_dir, tmp_path, capsys):
    if not shutil.which("setpriv"):
        pytest.skip("the links are planted by uid 65534 through setpriv")
    shared, out = short_tempdir(), short_tempdir()
    try:
        victim = shared / "victim"
        victim.write_bytes(b"precious")
        model = shared / "model"
        shutil.copytree(model_dir, model)
        (model / MANIFEST_NAME).unlink(missing_ok=True)  # verify --manifest writes one
        for directory in (shared, model, out):
            directory.chmod(0o777)  # a shared cache any user can write, without the sticky bit
        plant = {model / f"{MANIFEST_NAME}.partial", out / f"{MANIFEST_NAME}.partial",
                 out / "config.json.partial", out / "model-00001-of-00002.safetensors",
                 out / "model-00001-of-00002.safetensors.partial", out / MANIFEST_NAME}
        for link in plant:
            subprocess.run([*AS_NOBODY, "ln", "-s", str(victim), str(link)], check=True)

        assert moe_l2_main(["verify", "--model", str(model), "--manifest"]) == 0, capsys.readouterr().err
        files = ModelFiles.open(model)
        assert files.checksums is not None and (model / MANIFEST_NAME).stat().st_mode & 0o777 == 0o644
        packed = pack(model_dir, out, moe_l2_only=True, progress=False)  # dense and expert shards
        assert len(packed.files) == 2 and packed.checksums is not None
        assert packed.checksums.checksums == files.checksums.checksums
        assert victim.read_bytes() == b"precious"
        assert all(not p.is_symlink() for p in out.iterdir())  # the links were replaced or removed, not followed
        assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.glob("*.safetensors"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


@needs_root
def test_generate_never_writes_its_trace_through_a_link_planted_in_a_sticky_dir(model_dir, capsys):
    if not shutil.which("setpriv"):
        pytest.skip("the links are planted by uid 65534 through setpriv")
    shared, private = short_tempdir(), short_tempdir()
    try:
        shared.chmod(0o1777)  # /tmp's mode: anyone may add a name, only its owner remove it
        victim = private / "victim"
        victim.write_bytes(b"precious")
        plain, packed, planted = shared / "t.jsonl", shared / "t.jsonl.gz", shared / "nobody.jsonl"
        for link in (plain, packed):
            subprocess.run([*AS_NOBODY, "ln", "-s", str(victim), str(link)], check=True)
        subprocess.run([*AS_NOBODY, "sh", "-c", f"echo planted > {planted}"], check=True)
        argv = ["generate", "--model", str(model_dir), "--no-daemon", "--max-tokens", "2", "--json", "--trace-out"]
        for path, why in ((plain, "is a symbolic link"), (packed, "is a symbolic link"),
                          (planted, f"belongs to uid {NOBODY}")):
            assert moe_l2_main([*argv, str(path)]) == 1
            assert f"moe-l2 generate: cannot write the trace: {path} {why}" in capsys.readouterr().err
        assert victim.read_bytes() == b"precious" and planted.read_text() == "planted\n"
        assert plain.is_symlink() and packed.is_symlink()
        hard = shared / "hard.jsonl"  # a hard link would have root copy the secret it names into the trace
        os.link(victim, hard)
        with pytest.raises(UnsafeFile, match="has 2 names"):
            TraceWriter(hard, model="m", n_layers=1, n_experts=2, top_k=1, append=True)
        # This user's own traces beside them: made, then added to, written whole under a private name each time.
        for path in (shared / "mine.jsonl", shared / "mine.jsonl.gz"):
            for _ in range(2):
                assert moe_l2_main([*argv, str(path)]) == 0
            capsys.readouterr()
            first, second = read_traces(path).sequences
            assert first.experts == second.experts and (path.stat().st_mode & 0o777) == 0o644
        assert sorted(p.name for p in shared.iterdir()) == sorted(
            ["hard.jsonl", "mine.jsonl", "mine.jsonl.gz", "nobody.jsonl", "t.jsonl", "t.jsonl.gz"])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def test_make_model_never_writes_through_a_link_planted_in_its_out_dir_meanwhile(tmp_path):
    victim, out = tmp_path / "victim", tmp_path / "shared" / "model"
    victim.write_bytes(b"precious")
    out.mkdir(parents=True)  # empty, as --out may be: another user's, whose links come once the check has passed

    def plant(message: str) -> None:
        if not (out / "tokenizer.json").is_symlink():
            (out / "tokenizer.json").symlink_to(victim)

    with pytest.raises(OSError):  # the model is built aside, and `out` is no longer empty to be renamed over
        make_model(out, arch="qwen3_moe", layers=1, experts=4, top_k=2, hidden_size=64, moe_hidden_size=32, bits=4,
                   progress=plant)
    assert victim.read_bytes() == b"precious" and os.listdir(out) == ["tokenizer.json"]
    assert os.listdir(out.parent) == ["model"]  # nothing of the build left beside it


@pytest.mark.skipif(not nobody_runs_python(), reason="the locked-out user is uid 65534: needs root, setpriv, and "
                                                      "this interpreter's packages readable by other users")
def test_a_user_locked_out_of_the_socket_dir_is_told_so(model_dir):
    closed, public = short_tempdir(), short_tempdir()  # closed: 0700, root's
    try:
        public.chmod(0o755)
        model = public / "model"
        shutil.copytree(model_dir, model)
        for p in (model, *model.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        address = f"ipc://{closed}/moe-l2d.sock"
        told = f"its directory {closed} is closed to this user"
        for argv in (["stats"], ["verify", "--model", str(model), "--samples", "2"]):
            run = subprocess.run([*AS_NOBODY, sys.executable, "-P", "-m", "moe_l2.cli", *argv, "--socket", address],
                                 capture_output=True, text=True, timeout=120)
            assert told in run.stderr and "no moe-l2d socket" not in run.stderr, run.stderr
    finally:
        shutil.rmtree(closed, ignore_errors=True)
        shutil.rmtree(public, ignore_errors=True)
