"""Busy cores: CPU-bound programs beside `moe-l2 bench` (`--busy-cores`), as on a machine doing other work.

A miss path whose helpers run only where a core would idle is fast on a quiet machine and starves on a busy one
(docs/benchmarks.md, "The donor in the background"): the bench shows both.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

# Spins at the default priority, and ends once its parent (argv[1], passed in: the parent may die before the
# spinner's interpreter has started) is gone: a bench killed outright leaves no spinner.
SPIN = """\
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


@contextlib.contextmanager
def busy_cores(n: int):
    """n processes, each keeping a core busy until the block ends; yields their Popen objects."""
    spinners = []
    try:
        for _ in range(n):
            spinners.append(subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())],
                                             stdin=subprocess.DEVNULL))
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()
