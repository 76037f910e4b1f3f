"""What the donor's copy into L2 costs through a mapping that has not written the slot yet, against one whose pages
are mapped ahead (`Segment.prefault`, client/donor.py), and what mapping ahead costs the first time and again; and
what a first read of a slot costs through a client's read-only mapping (a layer computing on L2 in place), against
a read through pages mapped already.

A segment of --slots slots of a real geometry's record (`moe-l2 bench --geometry`'s, lab/synthetic.py) is created and
written once, as moe-l2d's are; each round then opens three fresh writable mappings of it, as a donor's, and a
read-only one, as a client's, and times, slot by slot: a copy of a record from an L0-like buffer into a slot the
mapping has not touched (each page a fault); `prefault` of a slot, then the copy into it; `prefault` of a slot
already mapped; a copy of the record out of the read-only mapping, the first and the second time. They take turns,
slot by slot. Medians over every slot of every round, in ms per record.

    python bench/bench_prefault.py [--geometry deepseek-v2-lite] [--slots 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from moe_l2 import _native
from moe_l2.lab import synthetic


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def one_round(name: str, slots: int, stride: int, nbytes: int, row) -> dict[str, list[float]]:
    """Three fresh mappings of the segment; per slot, the copy unmapped, the prefault and copy, and prefault again."""
    fresh, ahead, again = (_native.Segment.open(name, readonly=False) for _ in range(3))
    reader = _native.Segment.open(name, readonly=True)
    out: dict[str, list[float]] = {"copy, unmapped": [], "prefault, first": [], "copy, mapped ahead": [],
                                   "prefault, again": [], "read, first": [], "read, again": []}
    for slot in range(slots):
        at = slot * stride
        out["copy, unmapped"].append(timed(lambda: _native.copy_record(row, 0, fresh, at, nbytes, [])))
        out["prefault, first"].append(timed(lambda: ahead.prefault(at, stride)))
        out["copy, mapped ahead"].append(timed(lambda: _native.copy_record(row, 0, ahead, at, nbytes, [])))
        again.prefault(at, stride)
        out["prefault, again"].append(timed(lambda: again.prefault(at, stride)))
        for key in ("read, first", "read, again"):
            out[key].append(timed(lambda: _native.copy_record(reader, at, row, 0, nbytes, [])))
    for mapping in (fresh, ahead, again, reader):
        mapping.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(synthetic.GEOMETRIES), default="deepseek-v2-lite")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    layout = synthetic.GEOMETRIES[args.geometry].layout()
    nbytes, stride = layout.nbytes, layout.stride
    name = f"/ml2-pf{os.getpid()}"
    owner = _native.Segment.create(name, args.slots * stride)
    try:
        row = _native.Buffer(stride)
        row.view()[:] = os.urandom(stride)
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for key, values in one_round(name, args.slots, stride, nbytes, row).items():
                times.setdefault(key, []).extend(values)
    finally:
        _native.Segment.unlink(name)
        owner.close()
    print(f"{args.geometry}: {nbytes / 2**20:.1f} MiB records, {args.slots} slots x {args.rounds} rounds, "
          f"mappings opened fresh each round; load average {os.getloadavg()[0]:.2f}")
    for key, values in times.items():
        print(f"  {key:22s} {statistics.median(values):7.3f} ms  [{min(values):.3f}-{max(values):.3f}]")


if __name__ == "__main__":
    main()
