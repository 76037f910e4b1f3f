"""moe-l2 doctor, run as a user runs it (`python -P -m moe_l2.cli doctor`): its figures against this machine's
own, a real daemon found and named, and failing checks produced for real (a low open-files limit, a socket of
another user, a packed model on a filesystem without direct I/O), each with its fix."""

from __future__ import annotations

import json
import os
import platform
import pwd
import resource
import shutil
import socket
import subprocess
import sys

import mlx.core as mx
import pytest

from moe_l2 import _native as native
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.model import ModelFiles
from moe_l2.plan import ModelSizes, plan, read_memory

on_mac = pytest.mark.darwin
on_linux = pytest.mark.skipif(sys.platform != "linux", reason="O_DIRECT, /dev/shm and prlimit are Linux's")
ROOT = os.geteuid() == 0
NO_DAEMON = "ipc:///nonexistent/moe-l2-doctor/moe-l2d.sock"


def doctor(*args: str, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The command in a fresh process, asking no daemon unless --socket names one."""
    if "--socket" not in args:
        args = (*args, "--socket", NO_DAEMON)
    return subprocess.run([*wrapper, sys.executable, "-P", "-m", "moe_l2.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=120)


def report(*args: str, **kwargs) -> tuple[dict, int]:
    result = doctor("--json", *args, **kwargs)
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout), result.returncode


def check(data: dict, name: str) -> dict:
    (found,) = [c for c in data["checks"] if c["name"] == name]
    return found


def limits(which: int) -> list[int | None]:
    return [None if v == resource.RLIM_INFINITY else v for v in resource.getrlimit(which)]


def test_the_figures_are_this_machines():
    data, rc = report()
    assert rc == (1 if any(c["status"] == "fail" for c in data["checks"]) else 0) and data["ok"] == (rc == 0)
    assert data["page_size_bytes"] == os.sysconf("SC_PAGE_SIZE")
    assert [data["locking"]["memlock_soft_bytes"], data["locking"]["memlock_hard_bytes"]] == limits(
        resource.RLIMIT_MEMLOCK)
    assert [data["open_files"]["soft_files"], data["open_files"]["hard_files"]] == limits(resource.RLIMIT_NOFILE)
    backend = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "cpu"
    assert data["mlx"]["backend"] == backend
    if backend != "cuda":  # MLX computes on host memory in place on the CPU and on Metal
        assert data["zero_copy"] == {"possible": True, "client_uses": True, "why_not": None}
        assert check(data, "zero-copy L2")["status"] == "ok"
    if sys.platform == "linux":
        stat = os.statvfs("/dev/shm")
        assert data["shared_memory"]["path"] == "/dev/shm"
        assert data["shared_memory"]["size_bytes"] == stat.f_blocks * stat.f_frsize
        # Other processes make and drop segments meanwhile: within 256 MiB.
        assert abs(data["shared_memory"]["free_bytes"] - stat.f_bavail * stat.f_frsize) < 256 << 20
        assert data["memory"]["budget_refused_above_bytes"] <= data["shared_memory"]["free_bytes"]
    # No daemon at the socket: said, and not a failure.
    runtime = data["runtime"]
    assert runtime["socket_exists"] is False and runtime["daemon_answers"] is False
    assert check(data, "daemon")["status"] == "note" and "none at" in check(data, "daemon")["detail"]


def test_checksums_name_what_the_reads_run_on():
    data, _ = report()
    assert data["checksums"] == {"crc32": native.CRC32_KIND}
    on_the_cpu = native.CRC32_KIND in ("vpclmulqdq", "pclmul", "arm-crc32")
    assert check(data, "checksums")["status"] == ("ok" if on_the_cpu else "note")
    assert native.CRC32_KIND in check(data, "checksums")["detail"]
    if platform.machine() in ("x86_64", "AMD64", "arm64"):  # every such CPU has them (arm64: every Mac)
        assert on_the_cpu


def test_the_table_says_what_the_json_says():
    data, rc = report()
    table = doctor()
    assert table.returncode == rc
    for c in data["checks"]:
        assert c["name"] in table.stdout
    assert f"page size {data['page_size_bytes'] / 1024:.1f} KiB" in table.stdout


def test_a_running_daemon_answers_and_its_owner_is_named(running_daemon):
    data, _ = report("--socket", running_daemon.socket)
    runtime = data["runtime"]
    assert runtime["daemon_answers"] is True and runtime["daemon"]["pid"] == running_daemon.proc.pid
    assert runtime["owner_uid"] == os.geteuid() and runtime["trusted"] is True
    assert runtime["owner_name"] == f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    assert check(data, "daemon")["status"] == "ok"
    # This user runs the daemon: its processes fill L2 themselves (docs/architecture.md, "Fills").
    assert runtime["fills"] is True and check(data, "fills")["status"] == "ok"


@pytest.mark.skipif(not ROOT, reason="needs root to give the socket to another user")
def test_a_socket_of_an_untrusted_user_fails_with_its_fix():
    directory = short_tempdir()
    path = directory / "moe-l2d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chown(path, 65534, 65534)  # nobody: whoever listens there, it is not a user this client trusts
        result = doctor("--json", "--socket", f"ipc://{path}")
        assert result.returncode == 1, result.stderr
        data = json.loads(result.stdout)
        assert data["runtime"]["owner_uid"] == 65534 and data["runtime"]["trusted"] is False
        assert data["runtime"]["daemon_answers"] is False
        c = check(data, "daemon")
        assert c["status"] == "fail" and "uid 65534" in c["detail"] and "MOE_L2_TRUSTED_UIDS" in c["fix"]
    finally:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_a_low_open_files_limit_fails_with_its_fix():
    data, rc = report(wrapper=("prlimit", "--nofile=64:64"))
    assert rc == 1 and data["open_files"]["hard_files"] == 64
    c = check(data, "open files")
    assert c["status"] == "fail" and "LimitNOFILE" in c["fix"]
    table = doctor(wrapper=("prlimit", "--nofile=64:64"))
    assert table.returncode == 1 and "fix: raise the hard limit" in table.stdout


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_a_low_soft_limit_is_no_failure_the_daemon_raises_it_to_the_hard_one():
    data, _ = report(wrapper=("prlimit", "--nofile=256:4096"))
    assert (data["open_files"]["soft_files"], data["open_files"]["daemon_files"]) == (256, 4096)
    assert check(data, "open files")["status"] == "ok"


@on_linux
def test_l2_pages_are_what_dev_shm_is_mounted_with(tmp_path):
    """/dev/shm's huge= option, as /proc/mounts has it, decides whether L2's segments get huge pages: the
    machine's own is reported, and each option is read as the kernel applies it (the last mount wins)."""
    from moe_l2.cli.doctor import check_l2_pages

    with open("/proc/mounts") as f:
        shm = [line.split()[3] for line in f if line.split()[1:2] == ["/dev/shm"]]
    want = next((o.split("=", 1)[1] for o in shm[-1].split(",") if o.startswith("huge=")), "never") if shm else None
    data, _ = report()
    assert data["l2_pages"]["shm_huge"] == want
    for options, huge, status in [("rw,nosuid,nodev", "never", "note"), ("rw,huge=within_size", "within_size", "ok"),
                                  ("rw,huge=always,size=1g", "always", "ok"), ("rw,huge=advise", "advise", "note")]:
        mounts = tmp_path / "mounts"
        mounts.write_text(f"proc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs rw,huge=always 0 0\n"
                          f"tmpfs /dev/shm tmpfs {options} 0 0\n")
        facts, (found,) = check_l2_pages(str(mounts))
        assert facts == {"shm_huge": huge} and found.status == status, (options, found)
        assert (status == "ok") == ("huge=within_size /dev/shm" not in found.detail)
    (tmp_path / "none").write_text("proc /proc proc rw 0 0\n")
    assert check_l2_pages(str(tmp_path / "none")) == ({"shm_huge": None}, [])


def test_a_budget_the_daemon_would_refuse_fails_with_its_fix():
    data, _ = report()
    too_much = data["memory"]["total_bytes"] * 2
    data, rc = report("--budget", str(too_much))
    c = check(data, "budget")
    assert rc == 1 and c["status"] == "fail" and "moe-l2d refuses it" in c["detail"]
    assert c["fix"] == ("lower the budget" if sys.platform == "darwin" else "lower --budget")


def test_a_model_is_read_and_its_direct_io_is_what_the_reader_decides(model_dir, model_files):
    data, _ = report("--model", str(model_dir))
    model = data["model"]
    assert model["read"]["read_bytes"] == max(os.path.getsize(f) for f in model_files.files)  # small: read whole
    assert model["read"]["mb_s"] > 0 and model["read"]["elapsed_s"] > 0
    if sys.platform == "linux":
        for direct, key in ((True, "direct_io_supported"), (None, "direct_io_default")):
            fds = model_files.open_fds(direct=direct)
            try:
                assert model[key] == ModelFiles.direct_fds(fds)
            finally:
                for fd in fds:
                    os.close(fd)
    expected = plan(read_memory(), ModelSizes.of(model_files))
    assert (model["plan"]["l0_slots"], model["plan"]["l2_slots"]) == (expected.l0_slots, expected.l2_slots)
    assert check(data, "budget")["status"] == "ok"


@on_linux
@pytest.mark.skipif(not ROOT, reason="needs root to mount a ramfs")
def test_a_packed_model_on_a_filesystem_without_direct_io_fails(model_dir, tmp_path):
    from moe_l2.model.packer import pack

    mount = tmp_path / "ramfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "none", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    try:
        pack(model_dir, mount / "packed", moe_l2_only=True, progress=False)
        data, rc = report("--model", str(mount / "packed"))
        assert data["model"]["direct_io_supported"] is False and data["model"]["read"]["direct"] is False
        c = check(data, "direct I/O")
        assert rc == 1 and c["status"] == "fail" and "filesystem with direct I/O" in c["fix"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@on_mac
def test_a_mac_reports_metal_zero_copy_and_its_own_limits():
    data, _ = report()
    assert data["mlx"]["backend"] == "metal" and data["zero_copy"]["possible"] is True
    assert data["shared_memory"]["path"] is None
    assert all(isinstance(v, int) for v in data["shared_memory"]["sysv"].values())
    assert data["open_files"]["daemon_files"] >= data["open_files"]["soft_files"]  # macOS refuses an unlimited soft one
    assert data["memory"]["budget_refused_above_bytes"] == data["memory"]["total_bytes"]
