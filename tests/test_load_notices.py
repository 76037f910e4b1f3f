"""Issue 21.11: load-through waits end at the daemon's Loaded notice (protocol.Loaded, client/arrivals.py), against
a real moe-l2d over real sockets; a daemon in the middle (Relay) rewrites what the daemon says or adds hostile
notices."""

from __future__ import annotations

import logging
import queue
import shutil
import threading

import msgpack
import zmq

from moe_l2 import protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.daemon_process import short_tempdir

from .conftest import assert_resident_exact, stats, wait_for

# Far longer than the daemon takes to load a record of the test model (milliseconds): a wait that reached it
# would show as `expired`.
LOAD_THROUGH_S = 5.0


def load_through_client(files, address: str) -> L2Client:
    # Reports queue for a minute: the misses reach the daemon only because load-through sends them at once.
    return L2Client(files, address, wait_s=5, flush_s=60)


def test_a_miss_reported_after_it_landed_is_told_at_once(running_daemon, model_files):
    """The record may land between a lookup's look at L2 and its report: the daemon, finding it published when it
    folds the report in, tells the client at once (there is no fill left to wait for)."""
    request(running_daemon.socket, protocol.Prefetch(id=1, model=model_files.fingerprint, layer=1, experts=[6]))
    wait_for(lambda: stats(running_daemon)["models"][0]["loads_done"] == 1, what="the prefetch")
    client = load_through_client(model_files, running_daemon.socket)
    try:
        # A hello that finds no daemon yet wakes every layer's waiters: count notices per layer from here.
        assert client.wait_attached(30), client.last_error
        before = [client.arrivals.generation(layer) for layer in (1, 2)]
        client.report(1, [], [6], [6], now=True)
        wait_for(lambda: client.arrivals.counts.notices == 1, what="the notice")
        assert stats(running_daemon)["models"][0]["loads_done"] == 1  # nothing loaded again
        client.report(1, [], [6], [6])  # a miss no one waits for: no notice
        client.report(2, [], [9], [9], now=True)  # sent at once, with the report before it
        wait_for(lambda: client.arrivals.counts.notices == 2, what="the notice of layer 2")
        assert [client.arrivals.generation(layer) - b for layer, b in zip((1, 2), before)] == [1, 1]
    finally:
        client.close()


class Relay:
    """A daemon in the middle, as any local user could run one in front of the real moe-l2d: relays each client's
    frames to the daemon and the daemon's frames back through `rewrite` (bytes -> bytes), and sends every
    client the frames given to `inject`."""

    def __init__(self, daemon_address: str, rewrite=lambda frame: frame):
        self.daemon_address = daemon_address
        self.rewrite = rewrite
        self.directory = short_tempdir()
        self.address = f"ipc://{self.directory / 'relay.sock'}"
        self._injected: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run)  # owns every socket of the relay
        self._thread.start()
        self._ready.wait(5)

    def inject(self, frame: bytes) -> None:
        self._injected.put(frame)

    def _run(self) -> None:
        context = zmq.Context.instance()
        front = context.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.bind(self.address)
        self._ready.set()
        backs: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(5))
                if front in events:
                    identity, payload = front.recv_multipart()
                    if identity not in backs:
                        backs[identity] = context.socket(zmq.DEALER)
                        backs[identity].setsockopt(zmq.LINGER, 0)
                        backs[identity].connect(self.daemon_address)
                        poller.register(backs[identity], zmq.POLLIN)
                    backs[identity].send(payload)
                for identity, back in backs.items():
                    if back in events:
                        front.send_multipart([identity, self.rewrite(back.recv())])
                while not self._injected.empty():
                    frame = self._injected.get()
                    for identity in backs:
                        front.send_multipart([identity, frame])
        finally:
            for back in backs.values():
                back.close(0)
            front.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self.directory, ignore_errors=True)


def _notice(**fields) -> bytes:
    return msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "loaded", **fields})


def test_malformed_notices_from_a_hostile_daemon_are_dropped_and_the_client_keeps_working(running_daemon,
                                                                                           model_files, caplog):
    fp, n_layers, n_experts = model_files.fingerprint, model_files.n_layers, model_files.n_experts
    hostile = [
        _notice(model=fp, layer="0", experts=[1]),
        _notice(model=fp, layer=0, experts=[1, None]),
        _notice(model=fp, layer=0, experts=[0] * (protocol.MAX_IDS + 1)),  # over the bound, within the socket's
        _notice(model="x" * 10_000, layer=0, experts=[1]),
        _notice(model="0" * 32, layer=0, experts=[1]),  # another model's
        _notice(model=fp, layer=n_layers, experts=[1]),
        _notice(model=fp, layer=0, experts=[n_experts]),
        msgpack.packb({"v": 99, "type": "loaded", "model": fp, "layer": 0, "experts": [1]}),
        msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "evicted", "model": fp}),
        msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": {"x": 1}}),
    ]
    relay = Relay(running_daemon.socket)
    client = load_through_client(model_files, relay.address)
    pool = ExpertPool(model_files, capacity=4, client=client, load_through_s=LOAD_THROUGH_S, lend=False)
    try:
        assert client.notifies
        with caplog.at_level(logging.WARNING, logger="moe-l2.client"):
            for frame in hostile:
                relay.inject(frame)
            wait_for(lambda: client.arrivals.counts.dropped == len(hostile), what="every hostile notice dropped")
        assert client.arrivals.counts.notices == 0  # none woke a lookup
        dropped = [r.getMessage() for r in caplog.records if "dropped a notice" in r.getMessage()]
        # Ten notices, each bad in its own way, are one line: a kind is logged once a minute (client/log_limit.py).
        assert len(dropped) == 1 and len(dropped[0]) < 600
        # Never detached for them, and the real daemon's notices still end the waits of load-through.
        assert client.attaches == 1 and client.attached
        counts = pool.fetch(2, [5, 14])
        assert (counts.l2_awaited, counts.l3_reads) == (2, 0)
        assert_resident_exact(pool, model_files, 2, [5, 14])
        assert pool.waits.expired == 0 and client.attaches == 1
    finally:
        pool.close()
        client.close()
        relay.close()
