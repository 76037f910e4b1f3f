"""Issue 20, items 2, 3, 5 and 8: names in shared memory and sockets that someone else took first.

- a fake daemon's hello names a FIFO, a directory or a too-small file as a segment: the client refuses it at once
  and reads the model file (it used to block in open() holding the GIL, freezing the whole process);
- a service-user daemon starts though another user created files at every name it used to derive from its socket;
  where every random name it draws is taken, it refuses to start naming the file and its owner;
- a FIFO planted at a name of the segment list after a kill -9 does not hold up the next start;
- one socket spelled two ways has one lock.

A regression here hangs rather than fails, so whatever could block runs in a child process with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading

import msgpack
import pytest
import zmq

from moe_l2 import _native, protocol
from moe_l2.client.connection import L2Client, request, trusted_uids
from moe_l2.daemon.config import build_parser, resolve
from moe_l2.daemon.main import NAME_ATTEMPTS, Daemon, StartupError
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir
from moe_l2.layout import MAX_SHM_NAME, Geometry, IndexHeader, new_token, segment_name
from moe_l2.runtime import instance_tag

from .conftest import budget_for, segment_exists

SHM_DIR = "/dev/shm"  # where Linux keeps segments as files, and where another user can plant other files
needs_shm_files = pytest.mark.skipif(not os.path.isdir(SHM_DIR),
                                     reason="planting a FIFO or a directory at a segment's name needs /dev/shm "
                                            "(macOS' segments are not files)")
SERVICE_USER = 65534
# The daemon as another uid. CAP_DAC_READ_SEARCH only lets it read this interpreter and the test model (under
# /root here); it gives no right to unlink another user's file in the sticky /dev/shm, which is what counts.
AS_SERVICE_USER = ("setpriv", f"--reuid={SERVICE_USER}", f"--regid={SERVICE_USER}", "--clear-groups",
                   "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")


def _can_run_as_service_user() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    return subprocess.run([*AS_SERVICE_USER, "true"], capture_output=True, timeout=30).returncode == 0


needs_service_user = pytest.mark.skipif(not _can_run_as_service_user(),
                                reason="runs the daemon as uid 65534: needs root, util-linux setpriv and "
                                       "CAP_DAC_READ_SEARCH to hand on")


def test_segment_names_fit_macos_and_are_new_at_every_draw():
    longest = segment_name("f" * 8, 999, 9999, new_token())
    assert len(longest) == MAX_SHM_NAME
    with pytest.raises(ValueError, match="exceeds 31 characters"):
        segment_name("f" * 8, 1000, 9999, new_token())
    assert len({new_token() for _ in range(100)}) == 100
    seeded = [new_token(random.Random(7)) for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 10


# ---- item 2: a fake daemon names what is not a segment ------------------------------------------------------

class FakeDaemon:
    """A squatter on a TCP port: answers every hello with the segments it chooses."""

    def __init__(self, hello: protocol.HelloReply):
        self.hello = hello
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve)  # the socket is used by this thread only from here on
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if self.sock.poll(20):
                identity, payload = self.sock.recv_multipart()
                message = msgpack.unpackb(payload)
                if message.get("type") == "hello":
                    self.sock.send_multipart([identity, self.hello.encode(message["id"])])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.sock.close(0)


# The client side, in a child process: a client that blocks in open() holds the GIL, so only a timeout from the
# outside can end it.
_CLIENT = """
import json, sys, time
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.model import ModelFiles

files = ModelFiles.open(sys.argv[1])
out = []
for address in sys.argv[2:]:
    client = L2Client(files, address, wait_s=0, heartbeat_s=0.05)
    deadline = time.monotonic() + 20  # until the client has tried the segments the fake named, and failed
    while not client.last_error.startswith("cannot map"):
        if time.monotonic() > deadline:
            sys.exit(f"the client never tried the segments {address} named (last error {client.last_error!r})")
        time.sleep(0.01)
    pool = ExpertPool(files, capacity=2, client=client)
    counts = pool.fetch(0, [1, 2])
    out.append({"attached": client.attached, "error": client.last_error, "l2_hits": counts.l2_hits,
                "l3_reads": counts.l3_reads, "exact": pool.layers[0].record(1) == files.read_record(0, 1)})
    pool.close()
    client.close()
print(json.dumps(out))
"""


@pytest.fixture
def planted():
    """Makes things at shared-memory names (as /dev/shm files or as segments); removes them afterwards."""
    made = []

    def plant(kind: str, nbytes: int = 4096) -> str:
        name = f"/ml2sq{os.getpid()}-{len(made)}"
        path = SHM_DIR + name
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "directory":
            os.mkdir(path, 0o700)
        elif kind == "file":
            with open(path, "wb") as f:
                f.write(b"\0" * nbytes)
        else:
            made.append((name, _native.Segment.create(name, nbytes, 0o600)))
            return name
        made.append((name, None))
        return name

    yield plant
    for name, segment in made:
        if segment is not None:
            segment.close()
            _native.Segment.unlink(name)
        elif os.path.isdir(SHM_DIR + name):
            os.rmdir(SHM_DIR + name)
        else:
            os.unlink(SHM_DIR + name)


def fake_hello(files, index: str) -> protocol.HelloReply:
    g = Geometry(files.n_layers, files.n_experts, 2, files.layout.nbytes)
    return protocol.HelloReply(epoch=1, fingerprint=files.fingerprint, index_segment=index, data_segments=[],
                               n_layers=g.n_layers, n_experts=g.n_experts, n_slots=g.n_slots,
                               record_bytes=g.record_bytes, slot_stride=g.slot_stride,
                               layers=list(range(g.n_layers)))


def index_naming(plant, files, data: str) -> str:
    """A well-formed index segment of `files` whose every data segment is `data`."""
    g = Geometry(files.n_layers, files.n_experts, 2, files.layout.nbytes)
    index = plant("segment", g.index_bytes)
    header = IndexHeader(g, 1, files.fingerprint, index, (data,) * g.n_layers).pack()
    segment = _native.Segment.open(index, readonly=False)
    segment.view()[:len(header)] = header
    segment.close()
    return index


@needs_shm_files
def test_a_fake_daemon_naming_what_is_not_a_segment_is_refused_and_the_client_reads_the_file(planted, model_files):
    g = Geometry(model_files.n_layers, model_files.n_experts, 2, model_files.layout.nbytes)
    cases = {  # what the fake hello names -> what the refusal says
        planted("fifo"): "is a FIFO, not a shared-memory segment",
        planted("directory"): "is a directory, not a shared-memory segment",
        planted("file", 100): f"has 100 bytes, fewer than the {IndexHeader.min_bytes(model_files.n_layers)} expected",
        index_naming(planted, model_files, planted("fifo")): "is a FIFO, not a shared-memory segment",
        index_naming(planted, model_files, planted("segment", 4096)):
            f"has 4096 bytes, fewer than the {2 * g.slot_stride} expected",
    }
    fakes = [FakeDaemon(fake_hello(model_files, index)) for index in cases]
    try:
        result = subprocess.run([sys.executable, "-P", "-c", _CLIENT, str(model_files.path),
                                 *(fake.address for fake in fakes)], capture_output=True, text=True, timeout=60)
    finally:
        for fake in fakes:
            fake.close()
    assert result.returncode == 0, result.stderr
    for (index, refusal), got in zip(cases.items(), json.loads(result.stdout)):
        assert not got["attached"]
        assert got["error"].startswith("cannot map the daemon's segments: [Segment.open]") and refusal in got["error"]
        assert (got["l2_hits"], got["l3_reads"], got["exact"]) == (0, 2, True)


# ---- item 3: names no other user can take ----------------------------------------------------------------

def old_names(socket: str, n_layers: int) -> list[str]:
    """The names a daemon on `socket` used to take: anyone could work them out from the socket's address."""
    tag = hashlib.sha1(socket.encode()).hexdigest()[:8]
    return [f"/ml2{tag}.0i", *(f"/ml2{tag}.0.{layer}" for layer in range(n_layers))]


@needs_service_user
def test_a_service_user_daemon_starts_though_another_user_took_its_old_names(model_dir, model_files):
    runtime = short_tempdir()
    os.chown(runtime, SERVICE_USER, SERVICE_USER)
    socket = f"ipc://{runtime / 'moe-l2d.sock'}"
    taken = old_names(socket, model_files.n_layers)
    squatted = [_native.Segment.create(name, 4096, 0o600) for name in taken]  # root's, in the sticky /dev/shm
    daemon = DaemonProcess(["--model", str(model_dir), "--budget", str(budget_for(model_files, 2))], runtime,
                           wrapper=AS_SERVICE_USER)
    try:
        daemon.start()
        assert daemon.segments and not set(daemon.segments) & set(taken)
        assert {_native.Segment.open(name).owner_uid for name in daemon.segments} == {SERVICE_USER}
        client = L2Client(model_files, daemon.socket, wait_s=5, trusted=trusted_uids([SERVICE_USER]))
        try:
            assert client.attached
        finally:
            client.close()
        assert all(segment_exists(name) for name in taken)  # untouched
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
        for segment in squatted:
            segment.close()
            _native.Segment.unlink(segment.name)
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture
def runtime():
    directory = short_tempdir()  # an ipc:// path must fit sun_path: tmp_path is too long
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def in_process_daemon(model_dir, model_files, runtime, seed: int) -> Daemon:
    """moe-l2d's Daemon with names drawn from random.Random(seed): the same names a test can draw first."""
    config = resolve(build_parser().parse_args(["--model", str(model_dir), "--budget",
                                                str(budget_for(model_files, 2)), "--runtime-dir", str(runtime)]))
    return Daemon(config, rng=random.Random(seed))


def drawn_index_names(socket: str, seed: int, n: int) -> list[str]:
    """The first n names the daemon draws for model 0's index with random.Random(seed)."""
    rng = random.Random(seed)
    return [segment_name(instance_tag(socket), 0, None, new_token(rng)) for _ in range(n)]


def test_a_taken_name_gets_another_random_part(runtime, model_dir, model_files):
    daemon = in_process_daemon(model_dir, model_files, runtime, seed=11)
    first, second = drawn_index_names(daemon.config.socket, 11, 2)
    squatter = _native.Segment.create(first, 4096, 0o600)
    try:
        daemon.start()
        assert daemon.models[0].index_name == second
        assert first not in json.loads((runtime / f"moe-l2d-{daemon.tag}.segments").read_text())
    finally:
        daemon.stop()
        squatter.close()
        _native.Segment.unlink(first)
    assert not segment_exists(second)


def test_when_every_name_drawn_is_taken_the_start_is_refused_naming_the_file_and_its_owner(runtime, model_dir,
                                                                                          model_files):
    daemon = in_process_daemon(model_dir, model_files, runtime, seed=12)
    names = drawn_index_names(daemon.config.socket, 12, NAME_ATTEMPTS)
    squatted = [_native.Segment.create(name, 4096, 0o600) for name in names]
    try:
        with pytest.raises(StartupError) as info:
            daemon.start()
        message = str(info.value)
        assert message.startswith(f"cannot serve {model_dir}: {NAME_ATTEMPTS} random shared-memory names in a row "
                                  "were taken")
        assert f"'{names[-1]}': File exists (a segment of uid {os.geteuid()}, mode 0600" in message
        if os.path.isdir(SHM_DIR):
            assert f"the file {SHM_DIR}{names[-1]}" in message
        assert not daemon.models
    finally:
        daemon.stop()
        for segment in squatted:
            segment.close()
            _native.Segment.unlink(segment.name)
    assert not list(runtime.glob("*.segments"))


# ---- item 5: reclaim opens nothing blocking ----------------------------------------------------------------

@needs_shm_files
def test_a_fifo_planted_at_a_listed_name_does_not_hold_up_the_next_start(daemon_factory, model_dir, model_files):
    first = daemon_factory([model_dir], str(budget_for(model_files, 2)))
    listed = first.segments
    first.kill9()
    fifo = listed[-1]
    _native.Segment.unlink(fifo)
    os.mkfifo(SHM_DIR + fifo, 0o600)
    try:
        second = daemon_factory([model_dir], str(budget_for(model_files, 2)), runtime_dir=first.runtime_dir)
        log = second.log()
        assert f"not reclaiming {fifo}: [Segment.unlink] '{fifo}' is a FIFO" in log
        assert not any(segment_exists(name) for name in listed[:-1])  # the rest were reclaimed
        assert request(second.socket, protocol.Stats(id=1)).ok
    finally:
        os.unlink(SHM_DIR + fifo)


# ---- item 8: one lock per socket however it is spelled ------------------------------------------------------

def test_one_socket_spelled_two_ways_has_one_lock(daemon_factory, tmp_path, model_dir, model_files):
    first = daemon_factory([model_dir], str(budget_for(model_files, 2)))
    directory = first.runtime_dir
    links = short_tempdir()  # the spelling through the link must still fit an ipc:// path
    try:
        (links / "l").symlink_to(directory.parent)
        spellings = {  # the second daemon's --socket, and the directory it runs in
            "ipc://moe-l2d.sock": directory,
            f"ipc://{links / 'l' / directory.name / 'moe-l2d.sock'}": tmp_path,
        }
        for socket, cwd in spellings.items():
            second = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(model_dir),
                                     "--budget", str(budget_for(model_files, 2)), "--socket", socket,
                                     "--runtime-dir", str(tmp_path / "elsewhere")],
                                    cwd=cwd, capture_output=True, text=True, timeout=60)
            assert second.returncode == 1, second.stderr
            assert f"another moe-l2d (pid {first.proc.pid}) is already serving {socket}" in second.stderr
    finally:
        shutil.rmtree(links)
    assert (directory / "moe-l2d.sock").exists()
    reply = request(first.socket, protocol.Stats(id=1))
    assert reply.ok and reply.payload["daemon"]["pid"] == first.proc.pid
