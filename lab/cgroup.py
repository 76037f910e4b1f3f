"""A Linux memory cgroup that holds a group of processes' memory, their page cache included, to a limit: how
`moe-l2 bench` gives the page cache the same memory as moe-l2's tiers (docs/architecture.md, "The bench"). cgroup
v2 (one hierarchy at /sys/fs/cgroup) and v1 (the memory controller at /sys/fs/cgroup/memory) are both handled;
macOS has no such thing, and `MemoryCgroup.make` says why none can be made instead of raising.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["MemoryCgroup"]


class MemoryCgroup:
    """A fresh child group; processes join it by writing their pid to `procs` (the bench's workers do).

    Its maker may be killed outright (SIGKILL) before it can remove it, so a keeper process, outside the group,
    holds a pipe from the maker and removes the group once that pipe ends (the maker exited, or called
    `remove`) and the members have gone."""

    def __init__(self, path: Path, v2: bool):
        self.path = path
        self.v2 = v2
        # Its own process group: a Ctrl-C to the maker's terminal does not reach it.
        self.keeper = subprocess.Popen([sys.executable, "-P", "-m", __name__, str(path)], stdin=subprocess.PIPE,
                                       process_group=0)

    @classmethod
    def make(cls, name: str) -> "tuple[MemoryCgroup | None, str]":
        """(the group, "") or (None, why none can be made here)."""
        if sys.platform != "linux":
            return None, f"{sys.platform} has no memory cgroups"
        root = Path("/sys/fs/cgroup")
        v2 = "memory" in _read(root / "cgroup.controllers").split()
        parent = root if v2 else root / "memory"
        if not v2 and not (parent / "memory.limit_in_bytes").exists():
            return None, f"no cgroup memory controller at {root} (v2) or {parent} (v1)"
        path = parent / name
        try:
            path.mkdir()
        except OSError as e:
            return None, f"cannot make a memory cgroup at {path} ({e.strerror}; it takes root or a delegated group)"
        return cls(path, v2), ""

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def usage(self) -> int:
        """Bytes charged now: the members' anonymous memory and the page cache they brought in."""
        return int(_read(self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")))

    def anon(self) -> int:
        """Bytes of the members' anonymous memory (the rest of usage is mostly page cache)."""
        key = "anon" if self.v2 else "total_rss"
        for line in _read(self.path / "memory.stat").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def limit(self, nbytes: int) -> None:
        """Hold usage to nbytes: past it the kernel reclaims the group's page cache first."""
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(nbytes))

    def reset_peak(self) -> None:
        peak = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        try:
            peak.write_text("0")
        except OSError:
            pass  # kernels before 6.12 cannot reset memory.peak: it then counts from the group's start

    def peak(self) -> int:
        """The most bytes charged at once since reset_peak (v2 kernels before 5.19: the usage now)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        text = _read(self.path / name)
        return int(text) if text else self.usage()

    def remove(self, timeout: float = 5.0) -> None:
        """Remove the group once its members have exited; its charges go to the parent. Ends the keeper."""
        try:
            _remove(self.path, timeout)
        finally:
            self.keeper.stdin.close()
            self.keeper.wait()


def _remove(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def keep(path: Path) -> None:
    """The keeper: wait for the maker's pipe to end, then remove the group once its members exit (they were
    tied to the same maker, lab/lifeline.py, so they are ending too)."""
    sys.stdin.buffer.read()
    _remove(path, timeout=60.0)


if __name__ == "__main__":
    keep(Path(sys.argv[1]))
