"""Issue 36: fills. A process of the daemon's uid reads its misses itself and gives them to L2 (client/donor.py,
daemon/fills.py); the daemon never reads them again, publishes only bytes that pass its own check, never takes a
fill from another uid, and never hands a slot offered to a donor to anything else while that process lives."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from moe_l2 import _native
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.fill_protocol import FrameReader, encode, fill_socket_path
from moe_l2.layout import IndexHeader

from .conftest import AS_NOBODY, daemon_segments, nobody_runs_python, quarter_budget, stats, wait_for


def fills(daemon) -> dict:
    return stats(daemon)["models"][0]["fills"]


def slot_record(files, daemon, layer: int, expert: int) -> bytes | None:
    """The expert's record as L2 holds it now (copied through the seqlock), or None when L2 lacks it."""
    index_name, data_names = daemon_segments(daemon, files)
    index = _native.Segment.open(index_name, readonly=True)
    data = _native.Segment.open(data_names[layer], readonly=True)
    try:
        g = IndexHeader.unpack(index.view()).geometry
        slots = g.layer_slots(range(files.n_layers))[layer]
        out = _native.Buffer(g.slot_stride)
        if not g.slot_index(index, layer, slots, data).copy([(0, files.layout.nbytes, out, g.slot_stride)],
                                                            [expert], [0])[0]:
            return None
        return bytes(out.view()[:files.layout.nbytes])
    finally:
        index.close()
        data.close()


def test_misses_read_by_a_process_of_the_daemons_uid_are_given_to_l2_exact_and_never_read_again(
        running_daemon, model_files):
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    pool = ExpertPool(model_files, capacity=4, client=client, fill_l2=True, lend=False)
    try:
        wait_for(lambda: pool.donor.accepting, what="the fill desk's welcome")
        for layer, experts in ((0, [2, 9]), (1, [3, 7])):
            counts = pool.fetch(layer, experts)
            assert counts.l3_reads == len(experts)  # read by this process, as with no daemon
        wait_for(lambda: fills(running_daemon)["donated"] == 4, what="four donations",
                 detail=lambda: fills(running_daemon))
        model = stats(running_daemon)["models"][0]
        assert model["loads_done"] == 0  # the daemon read nothing: one disk read per miss
        assert model["fills"]["rejected"] == model["fills"]["cancelled"] == 0
        for layer, experts in ((0, [2, 9]), (1, [3, 7])):
            for expert in experts:
                assert slot_record(model_files, running_daemon, layer, expert) == model_files.read_record(layer, expert)
    finally:
        pool.close()
        client.close()
