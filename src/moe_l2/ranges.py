"""Decoder layer ranges as `--layers` takes them ("0-23", "0-11,24-35"): parsed and written back. Standard
library only, so that light commands (`moe-l2 stats`) can show them without the model readers."""

from __future__ import annotations


def parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """"A-B[,C-D...]" (or a single "N") as (first, last) pairs of decoder layer numbers, inclusive."""
    ranges = []
    for part in str(text).split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"layers {text!r} must be decoder layer ranges such as 0-23 or 0-11,24-35")
        first, last = int(first), int(last if dash else first)
        if last < first:
            raise ValueError(f"layers {text!r}: the range {first}-{last} is empty; write it first-last")
        ranges.append((first, last))
    return tuple(ranges)


def format_ranges(ids) -> str:
    """Sorted layer numbers as ranges, e.g. [1, 2, 3, 5] -> "1-3,5" (what --layers takes)."""
    ranges: list[list[int]] = []
    for i in sorted(ids):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return format_ranges_of(ranges)


def format_ranges_of(ranges) -> str:
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)
