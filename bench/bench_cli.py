"""How fast the light commands answer: `moe-l2 --version`, `moe-l2 stats --help` and `moe-l2 stats` with no
daemon, against a bare `python -c 'import zmq, msgpack'` (the floor any client of the daemon pays).

The commands run interleaved, round after round, so that the machine's drift hits all of them alike; each line
gives the median and the min-max of the wall time, and the median's ratio to the floor's.

    python bench/bench_cli.py --rounds 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def commands(socket: str) -> dict[str, list[str]]:
    exe = shutil.which("moe-l2")
    if exe is None:
        sys.exit("bench_cli: no moe-l2 on PATH: pip install . first")
    return {
        "python -c 'import zmq, msgpack'": [sys.executable, "-c", "import zmq, msgpack"],
        "moe-l2 --version": [exe, "--version"],
        "moe-l2 stats --help": [exe, "stats", "--help"],
        "moe-l2 stats (no daemon)": [exe, "stats", "--socket", socket],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="runs of each command, interleaved (default 10)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = commands(f"ipc://{Path(tmp) / 'none.sock'}")
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, argv in runs.items():
                start = time.perf_counter()
                subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                times[name].append(time.perf_counter() - start)
    floor = statistics.median(next(iter(times.values())))
    print(f"{'command':<34} {'median':>8} {'min-max':>15} {'x floor':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<34} {median * 1e3:6.0f}ms {min(samples) * 1e3:6.0f}-{max(samples) * 1e3:.0f}ms "
              f"{median / floor:7.2f}x")


if __name__ == "__main__":
    main()
