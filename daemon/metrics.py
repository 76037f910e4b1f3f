"""`moe-l2d --metrics HOST:PORT`: the figures of `moe-l2 stats` as Prometheus metrics (prometheus_client).

Each scrape asks the daemon's own control server for `stats` (over its inproc endpoint), so the figures are the
ones `moe-l2 stats` shows and only the server thread ever reads the daemon's state (docs/architecture.md, "A live
view and metrics").
"""

from __future__ import annotations

import logging

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from moe_l2 import control

from moe_l2.daemon.http import HttpServer, Page, message

log = logging.getLogger("moe-l2d.metrics")

# How long a scrape waits for the daemon's stats reply.
SCRAPE_TIMEOUT_S = 5.0


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
          memory.get("available_bytes"))
    gauge("memory_floor_bytes", "below this much available memory the daemon shrinks L2", memory.get("floor_bytes"))
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
        ("unbacked_slots", "L2 slots out of use because their pages could not be reserved again (a full /dev/shm)"),
        ("model_loads_in_flight", "this model's loads in flight"),
        ("served_layers", "MoE layers this daemon serves (moe-l2d --layers; the others are read from the files)"))}
    layer_gauges = {name: GaugeMetricFamily(f"moe_l2_layer_{name}", doc, labels=["model", "layer"]) for name, doc
                    in (("slots", "L2 slots in use in the layer (fewer than configured while shrunk)"),
                        ("resident", "experts resident in the layer"), ("pinned", "experts pinned in the layer"))}
    layer_counters = {name: CounterMetricFamily(f"moe_l2_layer_{name}", doc, labels=["model", "layer"])
                      for name, doc in (("hits", "L2 hits in the layer"), ("misses", "L2 misses in the layer"))}
    warm = {name: family(f"moe_l2_warm_start_{name}", doc, labels=["model"]) for name, family, doc in (
        ("records", GaugeMetricFamily, "records the warm start preloads (daemon/warm_start.py)"),
        ("preloaded", CounterMetricFamily, "of them, those preloaded so far"),
        ("pending", GaugeMetricFamily, "of them, those still queued or being read"),
        ("saved_timestamp_seconds", GaugeMetricFamily, "when the heat the warm start restored was saved"))}
    lookups = CounterMetricFamily("moe_l2_lookups", "clients' expert lookups by where their bytes came from, as "
                                  "they report them: l0 (the client's own rows), l2 (held in L2 when looked up), "
                                  "daemon_disk (read from the model files by moe-l2d while the lookup waited: "
                                  "load-through), own_disk (read by the client)", labels=["model", "source"])
    for m in payload["models"]:
        label = [m["path"]]
        for name, key in (("hits", "hits"), ("misses", "misses"), ("loads", "loads_done"),
                          ("load_errors", "load_errors"), ("disk_read_bytes", "loaded_bytes"),
                          ("served_bytes", "served_bytes")):
            counters[name].add_metric(label, m[key])
        for name, key in (("slots_per_layer", "slots_per_layer"), ("released_bytes", "released_bytes"),
                          ("unbacked_slots", "unbacked_slots"), ("model_loads_in_flight", "loads_in_flight")):
            gauges[name].add_metric(label, m[key])
        gauges["served_layers"].add_metric(label, len(m["layers"]))
        if m.get("warm_start") is not None:
            for name, key in (("records", "records"), ("preloaded", "preloaded"), ("pending", "pending"),
                              ("saved_timestamp_seconds", "saved_at")):
                warm[name].add_metric(label, m["warm_start"][key])
        for source, n in m.get("tiers", {}).items():
            lookups.add_metric([m["path"], source], n)
        for layer in m["layers"]:  # the served layers, by MoE layer number
            for name, family in (*layer_gauges.items(), *layer_counters.items()):
                family.add_metric([m["path"], str(layer["layer"])], layer[name])
    return out + [*counters.values(), lookups, *gauges.values(), *warm.values(), *layer_gauges.values(),
                  *layer_counters.values()]


class StatsCollector:
    """Asks the daemon it runs in for stats through the one request helper (src/moe_l2/control.py), over the
    server's inproc:// endpoint in the server's ZeroMQ context (daemon/server.py, INPROC_ADDRESS): whatever
    --socket is, a scrape needs no socket permission and no CurveZMQ key, and never leaves the process."""

    def __init__(self, address: str, context: zmq.Context | None = None):
        self.address = address
        self.context = context

    def ask(self) -> dict:
        return control.stats(self.address, SCRAPE_TIMEOUT_S, context=self.context)

    def collect(self):
        try:
            payload = self.ask()
        except (TimeoutError, RuntimeError, zmq.ZMQError) as exc:
            log.warning("metrics scrape without figures: %s", exc)
            return
        yield from families(payload)


def serve_metrics(host: str, port: int, daemon_address: str, context: zmq.Context | None = None) -> HttpServer:
    """Start the endpoint (daemon/http.py, bounded against every local user); the caller closes it.

    `/metrics` is the Prometheus text; `/health` is 200 "ok" while the daemon answers `stats`, else 503 and
    why, for a probe that wants a yes or no without parsing the metrics."""
    collector = StatsCollector(daemon_address, context)
    registry = CollectorRegistry()
    registry.register(collector)

    def health() -> Page:
        try:
            collector.ask()
        except (TimeoutError, RuntimeError, zmq.ZMQError) as exc:
            return message(503, f"the daemon does not answer stats: {exc}")
        return message(200, "ok")

    pages = {"/metrics": lambda: Page(200, CONTENT_TYPE_LATEST, generate_latest(registry)), "/health": health}
    return HttpServer(host, port, pages).start()
