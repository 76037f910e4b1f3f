"""macOS paths exercised on Linux (issue 13): the macOS-only branches selected by taking Linux-only names away or
by Darwin's figures, a static check that keeps Linux-only calls inside platform branches, and the checks only
a Mac can run."""

from __future__ import annotations

import ast
import collections
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
on_mac = pytest.mark.darwin


# --- sd_notify without SOCK_CLOEXEC ---------------------------------------------------------------


def test_sd_notify_works_where_sock_cloexec_does_not_exist(monkeypatch, tmp_path):
    from moe_l2.daemon.notify import sd_notify

    monkeypatch.delattr(socket, "SOCK_CLOEXEC", raising=False)  # as on macOS
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(str(path))
        manager.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sd_notify("READY=1") is True
        assert manager.recv(64) == b"READY=1"
        assert sd_notify("STOPPING=1") is True  # what Daemon.stop() sends
        assert manager.recv(64) == b"STOPPING=1"


# --- the budget check with Darwin's memory figures ------------------------------------------------

DarwinMemory = collections.namedtuple("DarwinMemory", "total available percent used free active inactive wired")
GIB = 1 << 30


@pytest.fixture
def darwin_memory(monkeypatch):
    """psutil's virtual_memory() as on a 64 GiB Mac whose caches fill memory: 6 GiB available, 30 GiB inactive."""
    from moe_l2.daemon import main

    figures = DarwinMemory(total=64 * GIB, available=6 * GIB, percent=90.0, used=40 * GIB, free=1 * GIB,
                           active=20 * GIB, inactive=30 * GIB, wired=8 * GIB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: figures)  # as moe_l2.machine reads them for the check
    monkeypatch.setattr(sys, "platform", "darwin")
    return main


def test_a_sound_budget_is_accepted_on_macos_without_a_word(darwin_memory, caplog):
    darwin_memory.check_memory(24 * GIB)  # over `available`, well within available + inactive
    assert not caplog.records


def test_a_budget_past_free_and_inactive_memory_is_warned_about_on_macos(darwin_memory, caplog):
    with caplog.at_level(logging.WARNING, logger="moe-l2d"):
        darwin_memory.check_memory(48 * GIB)
    assert len(caplog.records) == 1 and "compress or swap" in caplog.text


def test_a_budget_past_physical_memory_is_refused_on_macos(darwin_memory):
    with pytest.raises(darwin_memory.StartupError, match="this Mac has 64.0 GiB of memory; lower the budget"):
        darwin_memory.check_memory(65 * GIB)


@on_mac
def test_macos_memory_figures_are_there():
    memory = psutil.virtual_memory()
    assert memory.inactive >= 0 and memory.available > 0


# --- the runtime dir ------------------------------------------------------------------------------

RESOLVE = "from moe_l2.runtime import resolve_runtime_dir; print(resolve_runtime_dir()[0])"


def resolve_in(**env: str | None) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in ("MOE_L2_RUNTIME_DIR", "RUNTIME_DIRECTORY")}
    for key, value in env.items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    out = subprocess.run([sys.executable, "-P", "-c", RESOLVE], env=environment, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_runtime_dir_ignores_tmpdir(tmp_path):
    """A GUI shell on macOS (a per-user $TMPDIR), ssh/sudo/cron (none) and a user's own choice all agree."""
    gui = resolve_in(TMPDIR=str(tmp_path), XDG_RUNTIME_DIR=None)
    ssh = resolve_in(TMPDIR=None, XDG_RUNTIME_DIR=None)
    other = resolve_in(TMPDIR="/var/tmp", XDG_RUNTIME_DIR=None)
    assert gui == ssh == other
    assert not gui.startswith(str(tmp_path))


def test_the_runtime_dir_without_xdg_is_the_login_managers_or_a_fixed_one():
    uid = os.getuid()
    run_user = Path(f"/run/user/{uid}")
    expected = run_user / "moe-l2" if run_user.is_dir() and run_user.stat().st_uid == uid \
        else Path(f"/tmp/moe-l2-{uid}")
    assert resolve_in(XDG_RUNTIME_DIR=None) == str(expected)
    assert resolve_in(XDG_RUNTIME_DIR=str(run_user)) == str(run_user / "moe-l2")


def test_a_client_that_finds_no_daemon_warns_once(model_files, tmp_path, caplog):
    from moe_l2.client.connection import L2Client

    address = f"ipc://{tmp_path}/none.sock"
    with caplog.at_level(logging.WARNING, logger="moe-l2.client"):
        for _ in range(2):
            client = L2Client(model_files, address, wait_s=0.2)
            assert not client.attached
            client.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert f"no moe-l2d socket at {tmp_path}/none.sock; reading experts from the model files only" in caplog.text
    assert "MOE_L2_RUNTIME_DIR" in caplog.text


# --- Linux-only calls stay inside platform branches ----------------------------------------------

# (module, attribute) pairs that exist on Linux only (or macOS only), and path prefixes only Linux has.
PLATFORM_ONLY = {
    ("os", "posix_fadvise"), ("os", "posix_fallocate"), ("os", "O_DIRECT"), ("os", "O_NOATIME"),
    ("os", "O_TMPFILE"), ("os", "O_PATH"), ("os", "memfd_create"), ("os", "splice"), ("os", "pidfd_open"),
    ("os", "eventfd"), ("os", "copy_file_range"), ("os", "getxattr"), ("os", "setxattr"),
    ("os", "POSIX_FADV_DONTNEED"), ("os", "POSIX_FADV_WILLNEED"), ("os", "POSIX_FADV_SEQUENTIAL"),
    ("os", "POSIX_FADV_RANDOM"), ("socket", "SOCK_CLOEXEC"), ("socket", "SOCK_NONBLOCK"),
    ("mmap", "MAP_POPULATE"), ("mmap", "MADV_HUGEPAGE"), ("resource", "RLIMIT_RTPRIO"),
    ("fcntl", "F_FULLFSYNC"), ("fcntl", "F_NOCACHE"), ("fcntl", "F_GETPATH"),
}
PLATFORM_ONLY_PREFIXES = {("os", "sched_")}
LINUX_PATHS = ("/proc/", "/dev/shm", "/sys/")


def _is_guard(test: ast.AST) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and node.attr == "platform":
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "system":
            return True
    return False


def _catches_os_errors(node: ast.Try) -> bool:
    wanted = {"OSError", "AttributeError", "FileNotFoundError", "ImportError", "Exception"}
    for handler in node.handlers:
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(n, ast.Name) and n.id in wanted for n in names):
            return True
    return False


def _exits(block: list[ast.stmt]) -> bool:
    return bool(block) and isinstance(block[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _offence(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        pair = (node.value.id, node.attr)
        if pair in PLATFORM_ONLY or any(node.value.id == m and node.attr.startswith(p)
                                        for m, p in PLATFORM_ONLY_PREFIXES):
            return f"{node.value.id}.{node.attr}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(LINUX_PATHS):
        return repr(node.value)
    return None


def platform_only_uses(source: str, filename: str = "<test>") -> list[str]:
    """Uses of platform-only names and Linux-only paths outside a branch on sys.platform / platform.system() /
    hasattr(), a try that catches OSError or AttributeError, or after an early return on such a test."""
    found: list[str] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if not guarded and (what := _offence(node)):
            found.append(f"{filename}:{node.lineno}: {what}")
        if isinstance(node, (ast.If, ast.IfExp, ast.While)) and _is_guard(node.test):
            for child in ast.iter_child_nodes(node):
                visit(child, True)
            return
        if isinstance(node, ast.Try) and _catches_os_errors(node):
            for child in node.body:
                visit(child, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        if isinstance(node, ast.BoolOp):
            seen_guard = guarded
            for value in node.values:
                visit(value, seen_guard)
                seen_guard = seen_guard or _is_guard(value)
            return
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                block_guarded = guarded
                for item in value:
                    if isinstance(item, ast.AST):
                        visit(item, block_guarded)
                        if isinstance(item, ast.If) and _is_guard(item.test) and _exits(item.body):
                            block_guarded = True
            elif isinstance(value, ast.AST):
                visit(value, guarded)

    visit(ast.parse(source, filename), False)
    return found


@pytest.mark.parametrize("snippet, flagged", [
    ("os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)", 2),
    ("s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)", 1),
    ("os.listdir('/dev/shm')", 1),
    ("open('/proc/self/status')", 1),
    ("os.sched_setaffinity(0, {1})", 1),
    ("fcntl.fcntl(fd, fcntl.F_FULLFSYNC)", 1),
    ("if sys.platform.startswith('linux'):\n    os.posix_fallocate(fd, 0, n)", 0),
    ("if sys.platform == 'darwin':\n    fcntl.fcntl(fd, fcntl.F_FULLFSYNC)\nelse:\n    os.fsync(fd)", 0),
    ("if hasattr(os, 'posix_fadvise'):\n    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)", 0),
    ("x = os.O_DIRECT if hasattr(os, 'O_DIRECT') else 0", 0),
    ("flag = hasattr(os, 'O_DIRECT') and os.O_DIRECT", 0),
    ("try:\n    open('/proc/meminfo')\nexcept OSError:\n    pass", 0),
    ("def f():\n    if not hasattr(os, 'O_DIRECT'):\n        return 0\n    return os.O_DIRECT", 0),
    ("flag = getattr(os, 'O_DIRECT', 0)", 0),
    ("if os.path.exists('/dev/shm'):\n    os.statvfs('/dev/shm')", 2),  # a path test is no platform branch
])
def test_the_platform_check_itself(snippet, flagged):
    assert len(platform_only_uses(snippet)) == flagged, platform_only_uses(snippet)


def test_linux_only_calls_are_inside_platform_branches():
    found = []
    for folder in ("moe_l2", "daemon", "client", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += platform_only_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "Linux-only (or macOS-only) names outside a platform branch:\n" + "\n".join(found)


# --- only on a Mac --------------------------------------------------------------------------------


@on_mac
def test_macos_has_none_of_the_linux_only_names():
    assert not hasattr(socket, "SOCK_CLOEXEC") and not hasattr(os, "posix_fadvise")


@on_mac
def test_macos_segments_take_their_mode_as_given_and_report_locking():
    import _posixshmem

    from moe_l2 import _native

    name = f"/ml2mac{os.getpid()}"
    old = os.umask(0o077)
    try:
        segment = _native.Segment.create(name, 1 << 20, mode=0o640)
    finally:
        os.umask(old)
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, 0)
        assert os.fstat(fd).st_mode & 0o777 == 0o640  # macOS' shm_open ignores the umask
        os.close(fd)
        assert segment.locked or segment.lock_error.startswith("[Segment.create] cannot lock")
    finally:
        _native.Segment.unlink(name)


@on_mac
def test_apple_silicon_pages_are_16_kib():
    import platform

    if platform.machine() == "arm64":
        assert os.sysconf("SC_PAGESIZE") == 16384


@on_mac
def test_the_runtime_dir_on_macos_is_not_the_per_user_tmpdir():
    out = subprocess.run([sys.executable, "-P", "-c", RESOLVE], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "MOE_L2_RUNTIME_DIR"})
    assert out.returncode == 0, out.stderr
    assert not out.stdout.strip().startswith(os.environ.get("TMPDIR", "/nonexistent").rstrip("/"))
