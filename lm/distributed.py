"""What the ranks of an mlx.distributed group share when they stream one model's pipeline stages.

Every byte between ranks goes through mx.distributed collectives (no transport of our own): rank 0's prompt
to every rank, each rank's summary to rank 0, and which rank speaks to each daemon. Collectives run on the CPU
stream, as mlx-lm's own (docs/distributed.md). Every rank must call these functions in the same order.
"""

from __future__ import annotations

import hashlib
import json
import os

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

__all__ = ["RANK_PLACEHOLDER", "rank_socket", "share_text", "gather_json", "speaks_for_daemon"]

# `--socket ipc:///run/moe-l2-{rank}/moe-l2d.sock`: one daemon per rank (tests, several daemons on one host).
RANK_PLACEHOLDER = "{rank}"


def rank_socket(address: str | None, group: mx.distributed.Group) -> str | None:
    """The daemon address of this rank: `{rank}` replaced by its rank; None stays the host's default."""
    return None if address is None else address.replace(RANK_PLACEHOLDER, str(group.rank()))


def _settle() -> None:
    """Wait for the work queued on mlx-lm's generation stream: its loop leaves the next token's forward in
    flight, and under a pipeline that forward holds collectives; collectives must run in the same order on
    every rank, so a collective of ours must not overtake it."""
    mx.synchronize(generation_stream)
    mx.synchronize(mx.default_stream(mx.cpu))


def gather_json(group: mx.distributed.Group, value) -> list:
    """Every rank's JSON-able `value`, in rank order, on every rank."""
    _settle()
    data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    sizes = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=group, stream=mx.cpu)
    sizes = [int(n) for n in sizes.tolist()]
    padded = np.zeros(max(sizes), dtype=np.uint8)
    padded[:data.size] = data
    rows = np.array(mx.distributed.all_gather(mx.array(padded)[None], group=group, stream=mx.cpu))
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes)]


def share_text(group: mx.distributed.Group, text: str | None) -> str | None:
    """Rank 0's text (None when rank 0 has none, e.g. it could not read the prompt) on every rank; only rank
    0 needs to hold it, so a prompt on rank 0's standard input reaches every host."""
    return gather_json(group, text if group.rank() == 0 else None)[0]


def speaks_for_daemon(group: mx.distributed.Group, address: str | None) -> bool:
    """Whether this rank is the one that sends per-request messages (hints) to its daemon: the lowest rank of
    those on the same host with the same daemon address, so each daemon hears a request once
    (docs/distributed.md)."""
    key = hashlib.sha1(f"{os.uname().nodename}\0{address}".encode()).hexdigest()
    return gather_json(group, key).index(key) == group.rank()
