"""Busy cores: CPU-bound programs beside `moe-l2 bench` (`--busy-cores`), as on a machine doing other work.

A miss path whose helpers run only where a core would idle is fast on a quiet machine and starves on a busy one
(docs/benchmarks.md, "The donor in the background"): the bench shows both.

Each spinner runs as ``python -P -m moe_l2.lab.lifeline PARENT_PID moe_l2.lab.busy``, tied to the bench
(lab/lifeline.py), so that a bench killed outright leaves no spinner behind.
"""

from __future__ import annotations

import contextlib
import subprocess

from moe_l2.lab import lifeline


@contextlib.contextmanager
def busy_cores(n: int):
    """n processes, each keeping a core busy until the block ends; yields their Popen objects."""
    spinners = []
    try:
        for _ in range(n):
            spinners.append(subprocess.Popen(lifeline.command(__name__), stdin=subprocess.DEVNULL))
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


if __name__ == "__main__":
    while True:
        pass
