"""RefusalLog: the daemon's log of what it refuses, short under attack (docs/security.md, "Logs under attack").

One WARNING per refused request let a flood write 141,386 lines (22.8 MB) in one run; under journald, rate
limiting then hides the real errors. So the first FIRST_LOGGED refusals of each kind in a window of WINDOW_S are
logged one by one, and the rest are counted and summarised in one line when the window ends ("N refused
requests of type T in the last minute"). Kinds are the daemon's own names (an error name, a limit), never
text from a peer, so the table of counts is as small as the set of names. Not thread-safe: one per thread.
"""

from __future__ import annotations

import logging
import time

FIRST_LOGGED = 5
WINDOW_S = 60.0


class RefusalLog:
    def __init__(self, logger: logging.Logger, noun: str):
        self.log = logger
        self.noun = noun  # what is refused, plural: "requests", "connections"
        self.counts: dict[str, int] = {}
        self.window_start: float | None = None

    def refused(self, kind: str, message: str, *args) -> None:
        """Count a refusal of `kind`; log `message % args` at WARNING while few of that kind came this window."""
        if self.window_start is None:
            self.window_start = time.monotonic()
        seen = self.counts.get(kind, 0) + 1
        self.counts[kind] = seen
        if seen <= FIRST_LOGGED:
            self.log.warning(message, *args)

    def flush(self, final: bool = False) -> None:
        """Once the window is over (or at stop, `final`): one line per kind with refusals left unlogged."""
        if self.window_start is None:
            return
        elapsed = time.monotonic() - self.window_start
        if elapsed < WINDOW_S and not final:
            return
        span = "the last minute" if elapsed >= WINDOW_S else f"the last {elapsed:.0f} s"
        for kind, n in sorted(self.counts.items()):
            if n > FIRST_LOGGED:
                self.log.warning("%d refused %s of type %s in %s (the first %d logged one by one)", n, self.noun,
                                 kind, span, FIRST_LOGGED)
        self.counts.clear()
        self.window_start = None
