"""Loaded notices: telling a client that misses it waits for (Report.notify) are in L2.

The server thread registers a waiter for each such miss once the report that named it was folded in: one
published already is told at once, one loading waits for its fill, and one that could not be given a slot is
not told at all (its client waits until its own deadline, as for a notice lost). Loader threads only record
that a fill ended and wake the server thread through a pipe; that thread sends the notices, batched per client
and layer, without ever blocking on a client that does not read (docs/architecture.md, "Control plane").
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from moe_l2 import protocol

# Identities waiting for one record, at most (as many as the server counts clients): a bound on the table, which
# holds records loading now only.
MAX_WAITERS = 1024

Send = Callable[[bytes, bytes], None]


@dataclass(frozen=True)
class EndedFill:
    """A fill a loader thread ended: the record (its model's fingerprint, layer, expert), published or aborted."""

    fingerprint: str
    layer: int
    expert: int
    published: bool


class LoadNotices:
    def __init__(self) -> None:
        # (model fingerprint, layer, expert) -> identities waiting for it, for records loading now only.
        self._waiting: dict[tuple[str, int, int], set[bytes]] = {}
        self._ended: collections.deque[EndedFill] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Loader threads may still end fills after close() (the daemon stops its server before its loader):
        # the lock keeps them off descriptors closed, or reused since.
        self._lock = threading.Lock()
        self._closed = False
        self.sent = 0

    def fileno(self) -> int:
        """Readable when fills have ended: for the server's poller."""
        return self._wake_r

    def fill_ended(self, fingerprint: str, layer: int, expert: int, published: bool) -> None:
        """From a loader thread, once the record's fill was published (or aborted)."""
        with self._lock:
            if self._closed:
                return
            self._ended.append(EndedFill(fingerprint, layer, expert, published))
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the server has wake-ups to read already

    def want(self, identity: bytes, model, notify: dict[int, list[int]], send: Send) -> None:
        """After a report of `identity` was folded in (its misses reserved): tell it now of the records of
        `notify` in L2 already, and register it for those still loading."""
        for layer, experts in notify.items():
            store = model.stores[layer]
            with model.lock:
                ready = [e for e in experts if store.slot(e) >= 0]
                loading = [e for e in experts if store.slot(e) < 0 and store.has(e)]
            for expert in loading:
                waiters = self._waiting.setdefault((model.files.fingerprint, layer, expert), set())
                if len(waiters) < MAX_WAITERS:
                    waiters.add(identity)
            if ready:
                self._send(send, identity, model.files.fingerprint, layer, ready)

    def send_due(self, send: Send) -> None:
        """Send the notices for the fills that ended since the last call, one per client and layer."""
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        due: dict[tuple[bytes, str, int], list[int]] = collections.defaultdict(list)
        while self._ended:
            ended = self._ended.popleft()
            for identity in self._waiting.pop((ended.fingerprint, ended.layer, ended.expert), ()):
                if ended.published:  # an aborted load tells no one: its waiters' deadlines end their waits
                    due[identity, ended.fingerprint, ended.layer].append(ended.expert)
        for (identity, fingerprint, layer), experts in due.items():
            self._send(send, identity, fingerprint, layer, sorted(experts))

    def _send(self, send: Send, identity: bytes, fingerprint: str, layer: int, experts: list[int]) -> None:
        send(identity, protocol.Loaded(fingerprint, layer, experts).encode())
        self.sent += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
