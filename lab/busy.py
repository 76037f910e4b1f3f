"""Busy cores: CPU-bound programs beside `moe-l2 bench` (`--busy-cores`), as on a machine doing other work.

A miss path whose helpers run only where a core would idle is fast on a quiet machine and starves on a busy one
(docs/benchmarks.md, "The donor in the background"): the bench shows both. A spinner that copies memory instead
(`copying`) takes the memory bandwidth a core can, as a fill's copy and moe-l2d's check do beside the reads
(bench/bench_miss_path.py).

Each spinner runs as ``python -P -m moe_l2.lab.lifeline PARENT_PID moe_l2.lab.busy``, tied to the bench
(lab/lifeline.py), so that a bench killed outright leaves no spinner behind.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

from moe_l2.lab import lifeline


# What a copying spinner copies, over and over: more than most CPUs' last-level cache, so that copies go to memory.
COPY_BYTES = 64 << 20


@contextlib.contextmanager
def busy_cores(n: int, copying: bool = False):
    """n processes, each keeping a core busy until the block ends (copying: with copies through memory, not a
    loop in the core's own cache); yields their Popen objects."""
    command = (*lifeline.command(__name__), *(["copying"] if copying else []))
    spinners = []
    try:
        for _ in range(n):
            spinners.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["copying"]:
        source, target = bytearray(COPY_BYTES), bytearray(COPY_BYTES)
        while True:
            target[:] = source
    while True:
        pass
