"""Byte sizes as people write them ("24GiB", "512M", "1.5G") and as we print them; shares as percentages."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size; decimal units (K, M, G, T) are powers of 1000, binary ones (KiB, MiB, ...) of 1024."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: write a number with an optional unit, e.g. 512MiB, 24GiB, 2G")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def size_arg(n: int, slack: int) -> str:
    """`n` as a flag value people read ("11.3GiB"), rounded up by less than `slack` bytes so that it still means
    what `n` does (a budget buys the same slots: slack is one slot); exact bytes where no such rounding exists."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if n < scale:
            continue
        for digits in range(0, 4):
            text = f"{-(-n * 10**digits // scale) / 10**digits:.{digits}f}{unit}"
            if 0 <= parse_size(text) - n < slack:
                return text
    return str(n)


def format_pct(rate: float | None, digits: int = 1, sign: bool = True) -> str:
    """A share as a percentage ("37.5%"); "-" when there is nothing to divide."""
    if rate is None:
        return "-"
    return f"{100 * rate:.{digits}f}{'%' if sign else ''}"
