"""Where expert lookups got their bytes (protocol.TIER_COUNTERS, counted by client.pool.TierCounts.by_source):
L0; L2, held when looked up; the disk, read by the daemon while the lookup waited (load-through) or by the
client itself. Their shares and the one line that `stats`, `stats --watch` and `serve`'s log show them in.
Standard library only (`stats` imports it)."""

from __future__ import annotations

from moe_l2.sizes import format_pct


def source_shares(tiers: dict[str, int]) -> dict:
    """Of lookups counted by source, their number, each source's share and `disk`, the two disk shares together:
    a cold run shows its disk share, a warm one its L2 (None for each when none)."""
    lookups = sum(tiers.values())
    rate = (lambda n: n / lookups) if lookups else (lambda n: None)
    return {"lookups": lookups, **{tier: rate(n) for tier, n in tiers.items()},
            "disk": rate(tiers["daemon_disk"] + tiers["own_disk"])}


def describe_sources(tiers: dict[str, int], reader: str = "the client") -> str:
    """"L0 a  L2 b  disk c (read by moe-l2d while waiting d, by <reader> e) of N"."""
    r = source_shares(tiers)
    return (f"L0 {format_pct(r['l0'])}  L2 {format_pct(r['l2'])}  disk {format_pct(r['disk'])} (read by moe-l2d "
            f"while waiting {format_pct(r['daemon_disk'])}, by {reader} {format_pct(r['own_disk'])}) of "
            f"{r['lookups']}")
