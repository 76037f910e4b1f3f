"""LogLimit: what a daemon can make a client log, bounded (docs/security.md, "One way to ask the daemon").

A peer may send as many bad messages as it likes, each a little different, so "once per reason in a row" bounds
nothing. So each kind of line (the client's own names, never a peer's text) is logged once per INTERVAL_S, and the
next one logged after the interval says how many were left out. A peer's text in a line is protocol.printable's.
Not thread-safe: one per thread.
"""

from __future__ import annotations

import logging
import time

INTERVAL_S = 60.0


class LogLimit:
    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S):
        self.log = logger
        self.interval_s = interval_s
        self._logged: dict[str, float] = {}  # kind -> when its last line was logged
        self.left_out: dict[str, int] = {}  # kind -> lines of it not logged since

    def warning(self, kind: str, message: str, *args) -> None:
        """Log `message % args` at WARNING unless a line of `kind` was logged less than interval_s ago."""
        now = time.monotonic()
        last = self._logged.get(kind)
        if last is not None and now - last < self.interval_s:
            self.left_out[kind] = self.left_out.get(kind, 0) + 1
            return
        self._logged[kind] = now
        left = self.left_out.pop(kind, 0)
        if left:
            message, args = message + " (and %d more like it in the last %.0f s)", (*args, left, now - last)
        self.log.warning(message, *args)
