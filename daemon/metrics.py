"""`moe-l2d --metrics HOST:PORT`: the figures of `moe-l2 stats` as Prometheus metrics (prometheus_client).

Each scrape asks the daemon's own control socket for `stats`, so the figures are the ones `moe-l2 stats` shows
and only the server thread ever reads the daemon's state (docs/architecture.md, "A live view and metrics").
"""

from __future__ import annotations

import logging
import re

import zmq
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from moe_l2 import protocol

log = logging.getLogger("moe-l2d.metrics")

SCRAPE_TIMEOUT_MS = 5000


def local_address(address: str) -> str:
    """Where to reach the daemon's socket from inside the daemon: a wildcard TCP host becomes loopback."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0|\[::\]):", "tcp://127.0.0.1:", address)


def ask_stats(address: str) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(protocol.Stats(id=1).encode())
        if not sock.poll(SCRAPE_TIMEOUT_MS):
            raise TimeoutError(f"the daemon did not answer a stats request on {address}")
        reply = protocol.decode_reply(sock.recv())
        if not reply.ok:
            raise RuntimeError(f"stats refused: {reply.ename}: {reply.evalue}")
        return reply.payload
    finally:
        sock.close(0)


def families(payload: dict) -> list:
    """The stats reply as metric families; every model's figures carry its path as the `model` label."""
    d = payload["daemon"]
    out = []

    def gauge(name, doc, value, labels=None, label_names=()):
        g = GaugeMetricFamily(f"moe_l2_{name}", doc, labels=list(label_names))
        if value is not None:
            g.add_metric(labels or [], value)
        out.append(g)
        return g

    gauge("clients", "client processes attached (heartbeat within 30 s)", d["clients"])
    gauge("loads_in_flight", "loads from the model files into L2 in flight", d["loads_in_flight"])
    gauge("shm_bytes", "shared memory of all served models", d["shm_bytes"])
    gauge("rss_bytes", "the daemon's resident memory", d["rss_bytes"])
    gauge("uptime_seconds", "seconds since the daemon started", d["uptime_s"])
    memory = d.get("memory") or {}
    gauge("memory_available_bytes", "the machine's available memory, as the governor last read it",
          memory.get("available"))
    gauge("memory_floor_bytes", "below this much available memory the daemon shrinks L2", memory.get("floor"))
    requests = CounterMetricFamily("moe_l2_requests", "control-plane requests handled")
    requests.add_metric([], d["requests"])
    errors = CounterMetricFamily("moe_l2_request_errors", "control-plane requests refused")
    errors.add_metric([], d["errors"])
    out += [requests, errors]
    counters = {name: CounterMetricFamily(f"moe_l2_{name}", doc, labels=["model"]) for name, doc in (
        ("hits", "experts clients copied from L2"), ("misses", "experts clients looked up in L2 and missed"),
        ("loads", "records loaded from the model files into L2"), ("load_errors", "failed loads"),
        ("disk_read_bytes", "bytes read from the model files into L2"),
        ("served_bytes", "bytes clients copied out of L2"))}
    gauges = {name: GaugeMetricFamily(f"moe_l2_{name}", doc, labels=["model"]) for name, doc in (
        ("slots_per_layer", "L2 slots per layer configured"),
        ("released_bytes", "shared memory the governor gave back to the system"),
        ("model_loads_in_flight", "this model's loads in flight"),
        ("served_layers", "MoE layers this daemon serves (moe-l2d --layers; the others are read from the files)"))}
    layer_gauges = {name: GaugeMetricFamily(f"moe_l2_layer_{name}", doc, labels=["model", "layer"]) for name, doc
                    in (("slots", "L2 slots in use in the layer (fewer than configured while shrunk)"),
                        ("resident", "experts resident in the layer"), ("pinned", "experts pinned in the layer"))}
    layer_counters = {name: CounterMetricFamily(f"moe_l2_layer_{name}", doc, labels=["model", "layer"])
                      for name, doc in (("hits", "L2 hits in the layer"), ("misses", "L2 misses in the layer"))}
    for m in payload["models"]:
        label = [m["path"]]
        for name, key in (("hits", "hits"), ("misses", "misses"), ("loads", "loads_done"),
                          ("load_errors", "load_errors"), ("disk_read_bytes", "bytes_loaded"),
                          ("served_bytes", "bytes_served")):
            counters[name].add_metric(label, m[key])
        for name, key in (("slots_per_layer", "slots_per_layer"), ("released_bytes", "released_bytes"),
                          ("model_loads_in_flight", "loads_in_flight")):
            gauges[name].add_metric(label, m[key])
        gauges["served_layers"].add_metric(label, len(m["layers"]))
        for layer in m["layers"]:  # the served layers, by MoE layer number
            for name, family in (*layer_gauges.items(), *layer_counters.items()):
                family.add_metric([m["path"], str(layer["layer"])], layer[name])
    return out + [*counters.values(), *gauges.values(), *layer_gauges.values(), *layer_counters.values()]


class StatsCollector:
    def __init__(self, address: str):
        self.address = local_address(address)

    def collect(self):
        try:
            payload = ask_stats(self.address)
        except (TimeoutError, RuntimeError, zmq.ZMQError) as exc:
            log.warning("metrics scrape without figures: %s", exc)
            return
        yield from families(payload)


def serve_metrics(host: str, port: int, daemon_address: str):
    """Start the HTTP endpoint on its own thread; returns (server, thread) for shutdown."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(daemon_address))
    return start_http_server(port, addr=host, registry=registry)
