"""What this machine gives moe-l2: the platform facts that decide its behaviour, read or probed for real.

The daemon's budget check at start (`SharedMemoryRoom.check`) and `moe-l2 doctor` read them here, so that the
two never disagree about what a budget needs (docs/architecture.md, "Shared memory" and "moe-l2 doctor").
Nothing here imports MLX: the daemon uses this module and never touches MLX's allocator.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import sys
import time
from dataclasses import dataclass

import psutil

from moe_l2 import _native
from moe_l2.layout import page_size
from moe_l2.sizes import format_size

# The open-files limit the daemon raises its soft one to must leave room for a model's shards (the largest MoE
# checkpoints have ~170) and for the gate's connections (three descriptors each, daemon/gate.py): at 1024, Linux's
# default soft limit, the gate admits some 280 clients.
MIN_OPEN_FILES = 1024
# CAP_IPC_LOCK (linux/capability.h): mlock without RLIMIT_MEMLOCK.
CAP_IPC_LOCK = 14
# A read-speed probe reads at most this much of one file, for at most this long, in chunks of this size.
READ_PROBE_BYTES = 128 << 20
READ_PROBE_S = 2.0
READ_CHUNK_BYTES = 8 << 20


def sysctl_int(name: str) -> int | None:
    """An integer sysctl by name on macOS (sysctlbyname); None elsewhere or where it cannot be read."""
    if sys.platform != "darwin":
        return None
    sysctlbyname = getattr(ctypes.CDLL(None, use_errno=True), "sysctlbyname", None)
    value, size = ctypes.c_uint64(0), ctypes.c_size_t(8)
    if sysctlbyname is None or sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None,
                                            ctypes.c_size_t(0)) != 0:
        return None
    return value.value if size.value in (4, 8) else None  # a 4-byte int lands in the low half (little-endian)


def limit(value: int) -> int | None:
    """An rlimit value; None for unlimited."""
    return None if value == resource.RLIM_INFINITY else value


# --- shared memory and the budget check ------------------------------------------------------------------


@dataclass(frozen=True)
class SharedMemoryRoom:
    """What the daemon's budget check at start reads: the machine's memory and, on Linux, /dev/shm's space.

    psutil's figures, not `moe_l2.plan.read_memory`'s test hook: a refusal to start must follow the real
    machine, while tests fake memory to drive the governor (tests/test_governor.py)."""

    total: int
    available: int
    inactive: int       # macOS: pages the system hands out on demand (0 elsewhere)
    shm_path: str | None  # Linux's /dev/shm, a tmpfs with its own size; None where POSIX shm has no filesystem
    shm_size: int | None
    shm_free: int | None

    @classmethod
    def read(cls) -> "SharedMemoryRoom":
        vm = psutil.virtual_memory()
        path = size = free = None
        if sys.platform.startswith("linux"):
            path = "/dev/shm"
            stat = os.statvfs(path)
            size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
        return cls(vm.total, vm.available, vm.inactive if sys.platform == "darwin" else 0, path, size, free)

    @property
    def refused_above(self) -> int:
        """The largest budget (all models together) the daemon starts with."""
        if sys.platform == "darwin":
            return self.total
        return self.available if self.shm_free is None else min(self.available, self.shm_free)

    def refused_above_why(self) -> str:
        """What bounds `refused_above`, with its figure, e.g. "21.7 GiB of memory is available"."""
        if sys.platform == "darwin":
            return f"this Mac has {format_size(self.total)} of memory"
        if self.shm_free is not None and self.shm_free < self.available:
            return f"{self.shm_path} has {format_size(self.shm_free)} free"
        return f"{format_size(self.available)} of memory is available"

    @property
    def warned_above(self) -> int:
        """Past this (macOS only: available + inactive) the daemon starts with a warning."""
        return self.available + self.inactive if sys.platform == "darwin" else self.refused_above

    def check(self, needed: int) -> tuple[tuple[str, str] | None, str | None]:
        """((why a budget of `needed` bytes is refused, what to do), or None; a warning, or None). On Linux it
        must fit in available memory and in /dev/shm; macOS' `available` leaves out inactive and purgeable pages
        that the system hands out on demand, so there it is refused only past physical memory and warned about
        past available + inactive."""
        if sys.platform == "darwin":
            if needed > self.total:
                return (f"the models need {format_size(needed)} of shared memory but this Mac has "
                        f"{format_size(self.total)} of memory", "lower the budget"), None
            if needed > self.warned_above:
                return None, (f"the models need {format_size(needed)} of shared memory and only "
                              f"{format_size(self.warned_above)} is free or inactive: macOS will compress or swap "
                              "other memory (or these segments) to make room; lower the budget if the machine "
                              "slows down")
            return None, None
        if needed > self.available:
            return (f"the models need {format_size(needed)} of shared memory but only "
                    f"{format_size(self.available)} of memory is available", "lower --budget"), None
        if self.shm_free is not None and needed > self.shm_free:
            return (f"the models need {format_size(needed)} of shared memory but {self.shm_path} has "
                    f"{format_size(self.shm_free)} free", f"lower --budget or enlarge {self.shm_path} "
                    f"(e.g. mount -o remount,size=32G {self.shm_path})"), None
        return None, None


def sysv_shm_limits() -> dict[str, int | None]:
    """macOS' System V shared-memory limits where sysctl reads them. moe-l2's POSIX segments (shm_open) are
    not bound by them; they are listed because people ask about them."""
    return {name: sysctl_int(f"kern.sysv.{name}") for name in ("shmmax", "shmall", "shmseg", "shmmni")}


# --- locking, swap and open files --------------------------------------------------------------------------


def memlock_limits() -> tuple[int | None, int | None]:
    """RLIMIT_MEMLOCK (soft, hard) in bytes; None for unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return limit(soft), limit(hard)


def can_lock_any() -> bool | None:
    """Whether this process may lock any amount of memory (Linux: CAP_IPC_LOCK, as root has); None where it
    cannot be told (macOS, where a wired-memory limit applies)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return None


def lockable_bytes() -> int | None:
    """How much memory the daemon could lock, started like this process: None for no limit."""
    soft = memlock_limits()[0]
    if can_lock_any():
        return None
    wired = sysctl_int("vm.user_wire_limit")  # macOS' per-user wired-memory limit
    known = [v for v in (soft, wired) if v is not None]
    return min(known) if known else None


def swap_total() -> int:
    """Swap space: what can take L2's pages out of memory where they are not locked. macOS also compresses
    memory and adds swap files on demand, so there unlocked pages may always leave."""
    return psutil.swap_memory().total


def unlocked_pages_may_leave() -> bool:
    return sys.platform == "darwin" or swap_total() > 0


def shm_huge_pages(mounts: str | os.PathLike | None = None) -> str | None:
    """The `huge=` option of the tmpfs at /dev/shm (Linux; "never" when it has none): "within_size" or "always"
    give L2's segments transparent huge pages (moe-l2d reserves them before it maps them, so it cannot ask for
    them itself). None where there is no /dev/shm mount to read (macOS)."""
    if sys.platform != "linux":
        return None
    try:
        with open("/proc/mounts" if mounts is None else mounts) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:  # the last mount at /dev/shm is the one in effect
        fields = line.split()
        if len(fields) >= 4 and fields[1] == "/dev/shm":
            options = dict(option.partition("=")[::2] for option in fields[3].split(","))
            found = options.get("huge") or "never"
    return found


def open_files_limits() -> tuple[int | None, int | None]:
    """RLIMIT_NOFILE (soft, hard); None for unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return limit(soft), limit(hard)


@dataclass(frozen=True)
class SegmentProbe:
    """A one-page private segment, made and unlinked at once: whether its pages could be locked, and the
    mapping, for whoever checks more through it (moe-l2 doctor's zero-copy check)."""

    segment: object  # moe_l2._native.Segment, read-write, already unlinked
    locked: bool
    lock_error: str

    @classmethod
    def make(cls) -> "SegmentProbe":
        # A random name: one that someone else created first only fails this probe, it takes nothing of theirs.
        name = f"/ml2-doctor-{secrets.token_hex(5)}"
        segment = _native.Segment.create(name, page_size(), 0o600)
        _native.Segment.unlink(name)  # the mapping stays; nothing is left behind, whatever happens next
        return cls(segment, segment.locked, segment.lock_error)


# --- direct I/O and read speed ----------------------------------------------------------------------------


def direct_io_supported(path: str | os.PathLike) -> bool:
    """Whether `path`'s filesystem takes direct I/O, asked as moe-l2's readers ask it (`_native.set_direct`:
    O_DIRECT on Linux, F_NOCACHE on macOS; src/moe_l2/model/files.py open_fds)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return _native.set_direct(fd, True)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ReadSpeed:
    path: str
    nbytes: int
    seconds: float
    direct: bool          # read with direct I/O from start to end
    cached_before: int    # bytes of the range read that were in the page cache before (mincore)

    @property
    def mb_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def measure_read(path: str | os.PathLike, *, direct: bool, max_bytes: int = READ_PROBE_BYTES,
                 max_s: float = READ_PROBE_S) -> ReadSpeed:
    """Read `path` from its start with moe-l2's own reads (`_native.pread_records`), direct where asked and the
    filesystem allows, up to `max_bytes` or `max_s` seconds, whichever comes first."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = min(os.fstat(fd).st_size, max_bytes)
        cached = _native.page_cache_bytes(fd, 0, size)
        direct = direct and _native.set_direct(fd, True)
        fallbacks = _native.direct_fallbacks()
        buffer = _native.HostBuffer(min(READ_CHUNK_BYTES, max(size, 1)))
        done, start = 0, time.perf_counter()
        while done < size and time.perf_counter() - start < max_s:
            n = min(buffer.nbytes, size - done)
            _native.pread_records([(fd, done, n, buffer, 0)], threads=1)
            done += n
        seconds = time.perf_counter() - start
        direct = direct and _native.direct_fallbacks() == fallbacks  # a refused direct read falls back
        return ReadSpeed(os.fspath(path), done, seconds, direct, min(cached, done))
    finally:
        os.close(fd)
