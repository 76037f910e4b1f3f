"""A fetch's lookup: `Lookup`, the record one fetch keeps as it goes and reports to the daemon once, and
`TierCounts`, where the experts of the lookups came from (docs/architecture.md, "Client pool (L0)")."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class TierCounts:
    l0_hits: int = 0
    l2_hits: int = 0
    l2_lent: int = 0       # of l2_hits, those computed on in place (ExpertPool.borrow), not copied
    l2_awaited: int = 0    # of l2_hits, those L2 lacked when looked up: on their way into it (another process'
                           # read, or the daemon's) or loaded for this lookup (load-through) while the pool
                           # waited, so they cost a disk read
    l3_reads: int = 0
    bytes_copied: int = 0  # from L2
    bytes_read: int = 0    # from the model files
    copy_s: float = 0.0    # spent copying from L2
    read_s: float = 0.0    # spent reading from the model files

    def add(self, other: "TierCounts") -> None:
        for name in _COUNTS:  # once a fetch: dataclasses.fields() would cost it about 10 us
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def minus(self, other: "TierCounts") -> "TierCounts":
        """The counts since `other` was taken (a run's, from the pool's totals before and after it)."""
        return TierCounts(**{name: getattr(self, name) - getattr(other, name) for name in _COUNTS})

    def by_source(self) -> dict[str, int]:
        """Each lookup once, by where its bytes came from: L0; L2, held when looked up; the disk, read by the
        daemon while the lookup waited (load-through: in l2_hits above, yet no cache hit) or by this process.
        What every hit rate shown to a user is made of (docs/architecture.md, "Client pool (L0)")."""
        return {"l0": self.l0_hits, "l2": self.l2_hits - self.l2_awaited, "daemon_disk": self.l2_awaited,
                "own_disk": self.l3_reads}


_COUNTS = tuple(f.name for f in fields(TierCounts))


@dataclass
class Lookup:
    """One fetch of a layer's batch, as it goes: the router's picks, the experts L2 lent (`awaited` of them loaded
    for this lookup while it waited), the misses L0 took rows for and which of them came from L2 (`copied`), and,
    where this process gives to L2, those it read (`given`). The daemon hears of it once: at the end, or where the
    fetch is about to wait for the daemon's loads of its misses (load-through), before that wait, so that they start
    at once."""

    layer: int
    picks: list[int]
    lent: list[int] = field(default_factory=list)
    awaited: int = 0
    missing: list[int] = field(default_factory=list)
    copied: list[bool] = field(default_factory=list)
    given: list[int] = field(default_factory=list)
    folded: bool = False  # its L2 lookups went to the daemon's policy through the donor (Donor.look)
    reported: bool = False

    def report(self, client, now: bool = False) -> None:
        """Tell the daemon what L2 had (lent or copied) and lacked (it loads what it lacked, but those given),
        unless it was told already or there is none. now: without waiting for the connection's next flush."""
        if self.reported or client is None:
            return
        self.reported = True
        client.report(self.layer, [*self.lent, *(e for e, ok in zip(self.missing, self.copied) if ok)],
                      [e for e, ok in zip(self.missing, self.copied) if not ok], self.picks, now, self.given,
                      self.folded)

    def counts(self, l0_hits: int, filled: TierCounts) -> TierCounts:
        """The lookup's TierCounts: `l0_hits`, the lent experts as L2 hits, and what filling the misses counted."""
        filled.l0_hits = l0_hits
        filled.l2_hits += len(self.lent)
        filled.l2_lent = len(self.lent)
        filled.l2_awaited += self.awaited
        return filled
