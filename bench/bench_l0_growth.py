"""L0 grown on demand against L0 allocated whole, same ceiling, side by side (client/layerpool.py, Rows).

One process, no daemon (the pread configuration of `moe-l2 bench`): a routing trace's tokens fetched layer by
layer through an ExpertPool with `grow=True` and one with `grow=False`, interleaved (A B A B ...) because the
disk drifts between runs. Every token is timed, the warm-up included, since that is where a pool grows; the
time spent reallocating is measured apart. Prints per configuration the median seconds per token over the
repeats with their min-max, and the ratio of the medians.

    python bench/bench_l0_growth.py --model ~/.cache/moe-l2/bench/gpt-oss-20b-6layers \
        --trace /work/shared/traces/gpt-oss-20b.jsonl.gz [--tokens 100] [--share 0.25] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from moe_l2.cache.trace import read_traces
from moe_l2.client.layerpool import Rows
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.replayer import replay
from moe_l2.model import ModelFiles
from moe_l2.sizes import format_size


def run(files: ModelFiles, tokens: list, capacity: int, grow: bool) -> tuple[float, float, int]:
    """Seconds fetching, seconds of it reallocating rows, rows held at the end."""
    spent = [0.0]
    resize = Rows._resize

    def timed(self, rows):
        start, growing = time.perf_counter(), self.held > 0  # the first allocation is the constructor's
        resize(self, rows)
        if growing:
            spent[0] += time.perf_counter() - start

    Rows._resize = timed
    try:
        with ExpertPool(files, capacity, grow=grow) as pool:
            stall, _ = replay(pool, tokens, 0.0)
            return stall, spent[0], pool.rows
    finally:
        Rows._resize = resize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--share", type=float, default=0.25, help="L0 ceiling as a share of a layer's experts")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    files = ModelFiles.open(args.model)
    traces = read_traces(args.trace)
    tokens = [[list(layer) for layer in token[:files.n_layers]] for s in traces.sequences for token in s.experts]
    tokens = tokens[:args.tokens]
    capacity = max(files.top_k, int(args.share * files.n_experts))
    print(f"{files.path}: {files.n_layers} MoE layers x {files.n_experts} experts, top-{files.top_k}; L0 ceiling "
          f"{capacity} rows per layer; {len(tokens)} tokens; {args.repeat} rounds, interleaved")
    seconds: dict[bool, list[float]] = {False: [], True: []}
    grow_s, rows = [], {}
    for _ in range(args.repeat):
        for grow in (False, True):
            stall, resizing, rows[grow] = run(files, tokens, capacity, grow)
            seconds[grow].append(stall / len(tokens))
            if grow:
                grow_s.append(resizing / len(tokens))
    for grow, name in ((False, "whole"), (True, "grown")):
        s = seconds[grow]
        print(f"  {name:<6} {1e3 * statistics.median(s):8.1f} ms/token (min {1e3 * min(s):.1f}, max "
              f"{1e3 * max(s):.1f}), {rows[grow]} rows at the end ({format_size(rows[grow] * files.layout.nbytes)})")
    print(f"  grown/whole {statistics.median(seconds[True]) / statistics.median(seconds[False]):.3f}x; "
          f"reallocating {1e3 * statistics.median(grow_s):.2f} ms/token of it")


if __name__ == "__main__":
    main()
