"""Counters the daemon keeps for `moe-l2 stats`: per model hits, misses, loads and their latency."""

from __future__ import annotations

import collections
import os
import sys
import threading

import psutil

from moe_l2.protocol import PREFETCH_COUNTERS, TIER_COUNTERS

# What became of the records clients read themselves and gave to L2 (daemon/fills.py): slots offered for them,
# published (donated), given back by the client (cancelled: the daemon read them instead), refused a slot (no
# room, the policy kept its victim, or the client's bound), reclaimed once their client process was gone, and
# rejected (the slot's bytes failed the check).
FILL_COUNTERS = ("offered", "donated", "cancelled", "refused", "reclaimed", "rejected")
# stats lists at most this many of the records that failed their checksum (corrupt_records counts them all)
_CORRUPT_LISTED = 64


class LatencyWindow:
    """The latest N samples, so that percentiles follow the daemon's current behaviour."""

    def __init__(self, size: int = 4096):
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)

    def percentile(self, q: float) -> float | None:
        with self._lock:
            samples = sorted(self._samples)
        if not samples:
            return None
        return samples[min(len(samples) - 1, int(q / 100 * len(samples)))]


class ModelCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = 0          # experts clients copied from L2
        self.misses = 0        # experts clients looked up in L2 and did not find
        self.picks = 0         # experts clients' routers picked, L0 hits included (moe-l2 stats --watch)
        self.loads_done = 0
        self.load_errors = 0
        # (layer, expert) of every record that failed its checksum, and how many loads it refused
        self.corrupt: set[tuple[int, int]] = set()
        self.corrupt_loads = 0
        self.loaded_bytes = 0  # read from the model files into L2
        self.served_bytes = 0  # copied out of L2 by clients
        self.load_latency = LatencyWindow()
        self.prefetch = dict.fromkeys(PREFETCH_COUNTERS, 0)  # clients' next-layer prefetch, summed
        self.tiers = dict.fromkeys(TIER_COUNTERS, 0)  # where clients' lookups got their bytes, summed
        self.fills = dict.fromkeys(FILL_COUNTERS, 0)

    def add_lookups(self, hits: int, misses: int, record_bytes: int, picks: int) -> None:
        with self._lock:
            self.picks += picks
            self.hits += hits
            self.misses += misses
            self.served_bytes += hits * record_bytes

    def add_prefetch(self, counters: dict[str, int]) -> None:
        with self._lock:
            for name, n in counters.items():
                self.prefetch[name] += n

    def add_tiers(self, counters: dict[str, int]) -> None:
        with self._lock:
            for name, n in counters.items():
                self.tiers[name] += n

    def add_fills(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.fills[name] += n

    def add_load(self, seconds: float, nbytes: int) -> None:
        self.load_latency.add(seconds)
        with self._lock:
            self.loads_done += 1
            self.loaded_bytes += nbytes

    def add_load_error(self) -> None:
        with self._lock:
            self.load_errors += 1

    def add_corrupt(self, layer: int, expert: int) -> bool:
        """Count a load refused by the checksum manifest; True the first time for this record."""
        with self._lock:
            self.corrupt_loads += 1
            new = (layer, expert) not in self.corrupt
            self.corrupt.add((layer, expert))
            return new

    def snapshot(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {
                "hits": self.hits,
                "misses": self.misses,
                "picks": self.picks,
                "hit_rate": self.hits / lookups if lookups else None,
                "loads_done": self.loads_done,
                "load_errors": self.load_errors,
                "corrupt_records": len(self.corrupt),
                "corrupt_loads": self.corrupt_loads,
                "corrupt": [list(c) for c in sorted(self.corrupt)[:_CORRUPT_LISTED]],
                "loaded_bytes": self.loaded_bytes,
                "served_bytes": self.served_bytes,
                "load_latency_p50_s": self.load_latency.percentile(50),
                "load_latency_p99_s": self.load_latency.percentile(99),
                "prefetch": dict(self.prefetch),
                "tiers": dict(self.tiers),
                "fills": dict(self.fills),
            }


def shm_lock_figures(models) -> dict:
    """Bytes of the served models' shared memory whose pages are locked in memory, and the rest, which the
    system may swap or compress (docs/architecture.md, "Shared memory")."""
    segments = [s for m in models for s in (m.index, *m.data.values()) if s is not None]
    locked = sum(s.nbytes for s in segments if s.locked)
    return {"shm_locked_bytes": locked, "shm_unlocked_bytes": sum(s.nbytes for s in segments) - locked}


class OwnRss:
    """The daemon's resident memory, for every stats reply: on Linux from /proc/self/statm through a descriptor
    opened once (procfs makes the file anew at every read from offset 0), where psutil opened two files a call,
    half of what a stats request cost, and none at all once a flood filled the descriptor table; elsewhere
    psutil, which asks the kernel."""

    def __init__(self) -> None:
        self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC) if sys.platform == "linux" else None
        self._process = psutil.Process() if self._statm is None else None
        self._page = os.sysconf("SC_PAGE_SIZE")

    def read(self) -> int:
        if self._statm is None:
            return self._process.memory_info().rss
        return int(os.pread(self._statm, 256, 0).split()[1]) * self._page  # "size resident shared ..." in pages

    def close(self) -> None:
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None
