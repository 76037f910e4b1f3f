"""Shared fixtures: tiny real checkpoints made by our generator, and a real moe-l2d in a subprocess."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from moe_l2 import _native, protocol
from moe_l2.cache.trace import TraceWriter
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.fill_protocol import FrameReader, encode, fill_socket_path
from moe_l2.lab.daemon_process import DaemonProcess, short_tempdir
from moe_l2.lab.random_models import make_model
from moe_l2.layout import Geometry, IndexHeader
from moe_l2.model import ModelFiles


def pytest_configure(config):
    """A suite started in the background of a script (`pytest &`, nohup) inherits SIGINT ignored, and an ignored
    signal stays ignored across exec: the tests that press ctrl-c in a child would see it ignored. A handler (not
    SIG_IGN) resets to the default in every child."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A daemon started without DaemonProcess (socket activation, run_daemon) keeps its heat in the state dir
    # (warm start): the suite's own, never the user's, so that no run warms another.
    state = os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="moe-l2-tests-state-")
    config.add_cleanup(lambda: shutil.rmtree(state, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    """Tests marked darwin check what only macOS does: run there (`pytest -m darwin`), skipped elsewhere."""
    if sys.platform == "darwin":
        return
    skip = pytest.mark.skip(reason="checks what only macOS does (pytest -m darwin on a Mac)")
    for item in items:
        if "darwin" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """qwen3_moe, 3 MoE layers x 16 experts, 4-bit: the default subject of daemon and client tests."""
    out = tmp_path_factory.mktemp("models") / "qwen3-4bit"
    make_model(out, arch="qwen3_moe", layers=3, experts=16, top_k=4, hidden_size=128, moe_hidden_size=64,
               bits=4, seed=1)
    return out


@pytest.fixture(scope="session")
def model_files(model_dir) -> ModelFiles:
    return ModelFiles.open(model_dir)


def retire(daemons) -> None:
    """Stop daemons, unlink what they left in shared memory, then remove their runtime dirs (one dir may serve
    several daemons in turn: none is removed while a daemon in it runs)."""
    for daemon in daemons:
        daemon.stop()
        daemon.unlink_leftovers()
    for daemon in daemons:
        shutil.rmtree(daemon.runtime_dir, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []
    dirs: list[Path] = []

    def start(models, budget: str, *extra: str, runtime_dir: Path | None = None) -> DaemonProcess:
        directory = runtime_dir or short_tempdir()
        dirs.append(directory)
        daemon = DaemonProcess.serving(models, budget, *extra, runtime_dir=directory)
        started.append(daemon)
        return daemon.start()

    yield start
    retire(started)
    for directory in dirs:  # also those of daemons that never got as far as starting
        shutil.rmtree(directory, ignore_errors=True)


def quarter_budget(files: ModelFiles) -> str:
    """A budget whose slots hold a quarter of each layer's experts."""
    return str(budget_for(files, max(1, files.n_experts // 4)))


def budget_for(files: ModelFiles, slots: int) -> int:
    """The budget that buys exactly `slots` slots per layer."""
    return Geometry.budget_for(files.n_layers, files.n_experts, files.layout.nbytes, slots)


@pytest.fixture
def running_daemon(daemon_factory, model_dir, model_files) -> DaemonProcess:
    """The real daemon on a temp socket and runtime dir, serving the default model with a quarter budget."""
    return daemon_factory([model_dir], quarter_budget(model_files))


def assert_same_as_whole(got, want, *, chunked: bool) -> None:
    """What the platform guarantees of a streamed forward against the model loaded whole (docs/architecture.md,
    "Exactness"): bit-identical on the CPU, and on a GPU whenever the batch ran in one piece; a prefill run in
    chunks can take another quantized kernel on Metal, so there only closeness is promised."""
    import mlx.core as mx

    if not chunked or mx.default_device() == mx.cpu:
        assert mx.array_equal(got, want).item()
    else:
        scale = mx.abs(want).max().item()
        assert mx.allclose(got, want, rtol=0, atol=METAL_CHUNKED_ATOL * scale).item()


# Relative to the largest logit; a bound written down before measuring on a Mac (none is available here).
METAL_CHUNKED_ATOL = 1e-2


# ---- helpers the test modules share (imported from here, never from one another) ---------------------------


def corrupt_in_place(files: ModelFiles, layer: int, expert: int) -> None:
    """Flip the bytes of the record's first piece in its file, then put the file's times back: the model's
    size and mtime, so its fingerprint, do not change."""
    file_index, offset, nbytes, _ = files.extents(layer, expert)[0]
    path = files.files[file_index]
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        original = f.read(nbytes)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in original))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def made_and_loaded_whole(tmp_path_factory, folder: str, name: str, **spec):
    """A model written by the project's generator to a temp dir, with mlx-lm's load of it whole (ground truth):
    (path, model, tokenizer)."""
    from mlx_lm import load

    out = tmp_path_factory.mktemp(folder) / name
    make_model(out, **spec)
    whole, tokenizer = load(str(out))
    return out, whole, tokenizer


def assert_resident_exact(pool: ExpertPool, files: ModelFiles, layer: int, experts) -> None:
    for expert in experts:
        assert pool.layers[layer].record(expert) == files.read_record(layer, expert), (layer, expert)


def assert_every_tier_exact(files: ModelFiles, daemon) -> None:
    """Every expert cold (L3, reported to the daemon), then warm (copied from L2), then from L0: exact bytes."""
    client = L2Client(files, daemon.socket, wait_s=5)
    assert client.attached
    pool = ExpertPool(files, capacity=2, client=client)
    try:
        experts = list(range(files.n_experts))
        for layer in range(files.n_layers):
            for pair in zip(experts[::2], experts[1::2]):
                assert pool.fetch(layer, list(pair)).l3_reads == 2
                assert_resident_exact(pool, files, layer, pair)
        wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == files.n_layers * files.n_experts,
                 what="demand loads")
        for layer in range(files.n_layers):
            for pair in zip(experts[::2], experts[1::2]):
                assert pool.fetch(layer, list(pair)).l2_hits == 2
                assert_resident_exact(pool, files, layer, pair)
                assert pool.fetch(layer, list(pair)).l0_hits == 2
        assert stats(daemon)["models"][0]["load_errors"] == 0
    finally:
        pool.close()
        client.close()


# CI lays the shared folder beside the repository checkout; so does a developer's machine.
SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def shared_trace(name: str) -> Path:
    path = SHARED_TRACES / name
    if not path.exists():
        pytest.skip(f"shared routing traces not found at {path} (they live in shared/traces beside the repo)")
    return path


def synthetic_trace(path: Path, *, n_layers=2, n_experts=8, top_k=2, seqs=8, tokens=40, seed=0,
                    domains=("alpha", "beta")) -> Path:
    """Two domains with disjoint favourite experts, so that hints and profiles have something to find."""
    rng = random.Random(seed)
    words = {"alpha": "integral derivative calculus theorem", "beta": "court statute contract plaintiff"}
    with TraceWriter(path, model="toy", n_layers=n_layers, n_experts=n_experts, top_k=top_k) as w:
        for i in range(seqs):
            domain = domains[i % len(domains)]
            half = n_experts // 2
            base = 0 if domain == domains[0] else half
            w.begin(seq=f"s{i}", domain=domain, prompt=f"{words.get(domain, domain)} question {i}")
            for _ in range(tokens):
                token = []
                for _layer in range(n_layers):
                    pool = list(range(base, base + half)) if rng.random() < 0.85 else list(range(n_experts))
                    token.append(rng.sample(pool, top_k))
                w.add_token(token)
            w.end()
    return path


def stats(daemon) -> dict:
    """The stats reply of a DaemonProcess, or of the daemon at an address."""
    reply = request(getattr(daemon, "socket", daemon), protocol.Stats(id=1))
    assert reply.ok, reply
    return reply.payload


# How long a test polls a socket for a reply that must come: a bound for a loaded machine, never waited out when
# the reply comes.
ANSWER_MS = 30_000


def run_daemon(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """moe-l2d run to its end (a start that is refused), in a private runtime dir unless args name one; the dir
    is removed after."""
    directory = short_tempdir()
    try:
        return subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main",
                               *(() if "--runtime-dir" in args else ("--runtime-dir", str(directory))), *args],
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def wait_for(predicate, timeout=20.0, what="condition", detail=None):
    """Poll `predicate` until it holds; fail naming `what`, with `detail()` (a log, the last figures) if given.
    The timeout is a bound for a loaded machine, never waited out on the path that succeeds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}" + (f":\n{detail()}" if detail else ""))


# Linux's futex syscall number per machine, for reading /proc/<pid>/syscall.
FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)


def sleeping_on(task: str, address: int) -> int | None:
    """The value a task (/proc/PID or /proc/PID/task/TID) sleeps expecting at `address` in a shared FUTEX_WAIT (not
    FUTEX_PRIVATE_FLAG: op 0), as an int32; None while it does anything else, or is gone. Linux only
    (SlotIndex.wait)."""
    try:
        fields = Path(task, "syscall").read_text().split()
    except (FileNotFoundError, ProcessLookupError):  # a thread that has exited
        return None
    if len(fields) < 4 or fields[0] != str(FUTEX_SYSCALL) or int(fields[1], 16) != address or int(fields[2], 16):
        return None
    value = int(fields[3], 16) & 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def segment_exists(name: str) -> bool:
    try:
        _native.Segment.open(name, readonly=True).close()
        return True
    except OSError:
        return False


def daemon_segments(daemon, files: ModelFiles) -> tuple[str, tuple[str, ...]]:
    """The daemon's index segment for `files` and each MoE layer's data segment ('' where not served), learnt as
    a client learns them: the index from hello, the rest from its header (the names are random)."""
    reply = request(daemon.socket, protocol.Hello(id=1, model=os.path.realpath(files.path),
                                                  fingerprint=files.fingerprint, client="test"))
    name = protocol.HelloReply.decode(reply).index_segment
    index = _native.Segment.open(name, readonly=True)
    try:
        return name, IndexHeader.unpack(index.view()).data_names
    finally:
        index.close()


# ---- a second, hostile local user --------------------------------------------------------------------------

NOBODY = 65534
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")


@functools.cache
@contextlib.contextmanager
def filling_pool(files, daemon, load_through_s: float = 0.0):
    """A pool of this process (the daemon's uid) that gives its misses to L2, once the fill desk took it; it waits
    up to load_through_s for a record on its way into L2 (0: it reads it)."""
    client = L2Client(files, daemon.socket, wait_s=5)
    pool = ExpertPool(files, capacity=4, client=client, fill_l2=True, lend=False, load_through_s=load_through_s)
    try:
        wait_for(lambda: pool.donor.accepting, what="the fill desk's welcome")
        yield pool
    finally:
        pool.close()
        client.close()


class RawDonor:
    """The fill socket spoken by hand: a donor that gives, copies and answers as a test tells it."""

    def __init__(self, daemon):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(fill_socket_path(daemon.socket))
        self.reader = FrameReader(("welcome", "refused", "offer"))
        assert self.next().type == "welcome"

    def next(self):
        messages = []
        while not messages:
            data = self.sock.recv(65536)
            assert data, "the fill desk closed the connection"
            messages = self.reader.feed(data)
        assert len(messages) == 1
        return messages[0]

    def offer(self, files, layer: int, expert: int) -> int:
        """Give one record; the slot offered for it."""
        self.sock.sendall(encode("give", model=files.fingerprint, layer=layer, experts=[expert], keep=[]))
        offer = self.next()
        assert offer.type == "offer" and [e for e, _ in offer.slots] == [expert]
        return offer.slots[0][1]


def pages_mapped(address: int, nbytes: int) -> int:
    """How many pages of [address, address + nbytes) this process' page table maps now (Linux: the present bit of
    /proc/self/pagemap, which needs no privilege)."""
    page = os.sysconf("SC_PAGESIZE")
    first, count = address // page, -(-(address + nbytes) // page) - address // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read(count * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", entries))


def slot_stride(files, daemon) -> int:
    index = _native.Segment.open(daemon_segments(daemon, files)[0], readonly=True)
    try:
        return IndexHeader.unpack(index.view()).geometry.slot_stride
    finally:
        index.close()


def nobody_runs_python() -> bool:
    """Whether uid 65534 can run this interpreter with moe-l2 (needs root, setpriv, and a venv other users can
    read); the tests that act as that user skip otherwise."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    probe = subprocess.run([*AS_NOBODY, sys.executable, "-P", "-c", "import moe_l2._native, moe_l2.cli, zmq"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


# moe-l2 serve as its own process (tests/test_serve.py, tests/test_messages.py).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """{(name, labels...): value} of every sample of a Prometheus endpoint on this host."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class ServeProcess:
    """An HTTP server process on a free loopback port: `moe-l2 serve ...` or `mlx_lm server ...`."""

    def __init__(self, cmd: list[str], log_path: Path, port: int | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([*cmd, "--port", str(self.port), "--log-level", "WARNING"],
                                         stdout=log, stderr=log)
        self.url = f"http://127.0.0.1:{self.port}"

    @classmethod
    def moe_l2(cls, model_dir, log_path: Path, *args: str) -> "ServeProcess":
        # -P: the source checkout in the working directory must not shadow the installed package.
        return cls([sys.executable, "-P", "-m", "moe_l2.cli", "serve", "--model", str(model_dir), *args], log_path)

    @classmethod
    def mlx_lm(cls, model_dir, log_path: Path) -> "ServeProcess":
        return cls([sys.executable, "-P", "-m", "mlx_lm", "server", "--model", str(model_dir)], log_path)

    def wait_healthy(self, timeout: float = 120.0) -> "ServeProcess":
        def healthy() -> bool:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    return json.loads(r.read()) == {"status": "ok"}
            except OSError:
                return False

        wait_for(healthy, timeout, what=f"{self.url}/health", detail=self.log)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def raw(self, head: bytes, body: bytes = b"") -> tuple[int, dict]:
        """A request sent byte for byte: `head` is its request line and headers, without the blank line that
        ends them. The reply's status and JSON body, read to the connection's end."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            s.sendall(head + b"\r\n\r\n" + body)
            reply = b"".join(iter(lambda: s.recv(1 << 16), b""))
        status_line, _, rest = reply.partition(b"\r\n")
        return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])

    def metrics(self) -> dict[tuple, float]:
        """GET /metrics as {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def client(self):
        import openai  # the test extra

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


# Next-layer prefetch's fixtures (tests/test_prefetch.py, tests/test_side_rows.py).
PREFETCH_TEXT = "The router picks a few experts per token, and the next layer's picks follow from this layer's. " * 3


@pytest.fixture(scope="module")
def whole(model_dir):
    return load(str(model_dir))


@pytest.fixture
def landing(monkeypatch):
    """Every prefetch lands before the forward goes on (a tiny model computes faster than a thread wakes):
    the worker's writes then happen at every layer, which is what the tests are about."""
    original = ExpertPool.prefetch

    def prefetch_and_wait(pool, layer, guesses):
        original(pool, layer, guesses)
        pool.wait_prefetches(layer)

    monkeypatch.setattr(ExpertPool, "prefetch", prefetch_and_wait)


def greedy(model, tokenizer, n_prompt=40, max_tokens=12) -> list[int]:
    ids = tokenizer.encode(PREFETCH_TEXT)[:n_prompt]
    # Prefill in steps of 8: mlx-lm drops each step's last-layer output unevaluated (the tail).
    return [r.token for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens,
                                             prefill_step_size=8)]
