"""`GET /metrics` on `moe-l2 serve`: its requests, tokens and expert tiers as Prometheus text (prometheus_client).

The HTTP handler counts requests by endpoint and status as it answers them, and those whose client hung up;
`ObservedGenerator` (serve/generation.py) counts each request's prompt tokens and the seconds to its
first and last token; the generation thread's own counts (`ServedResponseGenerator`: the tokens it generated, the
requests it holds) and the expert pool's tiers (the StreamedLM's counters, lm/streamed_lm.py `stats`, what
`moe-l2 generate --json` reports) are read at each scrape, on this process' rank only. Rates are for the scraper:
rate(moe_l2_serve_generated_tokens_total) is tokens/s over time, and its ratio to
rate(moe_l2_serve_generation_seconds_total) the decode speed a request sees (docs/decisions.md, "serve's
/metrics").
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from moe_l2.lm.streamed_lm import stats

__all__ = ["ServingMetrics", "ENDPOINTS", "CONTENT_TYPE_LATEST"]

# The endpoint label's values: the server's routes; any other path is "other", so a client cannot grow the
# label set (and the scrape) by asking for made-up paths.
ENDPOINTS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/messages", "/v1/models",
             "/health", "/metrics")


def endpoint_of(path: str) -> str:
    path = path.partition("?")[0]
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ENDPOINTS else "other"


class _GenerationCollector:
    """The generation thread's own counts at scrape time: what it did, whoever read it."""

    def __init__(self, generator):
        self.generator = generator

    def collect(self):
        yield CounterMetricFamily("moe_l2_serve_generated_tokens", "tokens the generation thread generated "
                                  "(each request's completion_tokens, and those of requests cancelled on the way)",
                                  value=self.generator.generated_tokens)
        yield GaugeMetricFamily("moe_l2_serve_requests_generating", "requests the generation thread holds: taken "
                                "from the queue and neither finished nor, once cancelled, taken out of its batch",
                                value=len(self.generator.held))


class _PoolCollector:
    """The StreamedLM's expert counts at scrape time (none before the model is loaded or after it is closed)."""

    def __init__(self, provider):
        self.provider = provider

    def collect(self):
        lm = self.provider.lm
        if lm is None:
            return
        s = stats(lm.model)
        lookups = CounterMetricFamily("moe_l2_serve_expert_lookups",
                                      "experts the model's forwards looked up, by where their bytes came from: "
                                      "l0 (this process), l2 (held in moe-l2d's shared memory), daemon_disk (read "
                                      "from the model files by moe-l2d while the lookup waited), disk (read by "
                                      "this process)",
                                      labels=["tier"])
        for tier, count in (("l0", s.l0_hits), ("l2", s.l2_hits), ("daemon_disk", s.daemon_reads),
                            ("disk", s.disk_reads)):
            lookups.add_metric([tier], count)
        yield lookups
        yield CounterMetricFamily("moe_l2_serve_expert_disk_read_bytes", "bytes read from the model files",
                                  value=s.bytes_read)
        yield CounterMetricFamily("moe_l2_serve_expert_l2_copied_bytes", "bytes copied out of moe-l2d's L2",
                                  value=s.bytes_copied)
        yield GaugeMetricFamily("moe_l2_serve_l0_slots", "the most expert rows this process' L0 may hold, per MoE "
                                "layer (the largest layer's, with per-layer ceilings), or in all with a shared L0",
                                value=lm.pool.capacity)
        yield from _l0_rows(lm.pool)
        yield GaugeMetricFamily("moe_l2_serve_daemon_attached", "1 while attached to a moe-l2d, else 0",
                                value=int(s.daemon is not None))


def _l0_rows(pool):
    """The rows each L0 pool holds now and its ceiling: per MoE layer, or one pool (layer "all") when shared."""
    held = GaugeMetricFamily("moe_l2_serve_l0_rows", "expert rows an L0 pool holds now (it grows on demand up to "
                             "moe_l2_serve_l0_ceiling_rows)", labels=["layer"])
    ceiling = GaugeMetricFamily("moe_l2_serve_l0_ceiling_rows", "the most expert rows an L0 pool may hold",
                                labels=["layer"])
    if pool.shared_l0:
        pools = {"all": (pool.rows, pool.ceiling)}
    else:
        held_now = pool.rows_held()
        pools = {str(layer): (held_now[layer], rows) for layer, rows in pool.capacities.items()}
    for layer, (rows, most) in pools.items():
        held.add_metric([layer], rows)
        ceiling.add_metric([layer], most)
    yield held
    yield ceiling


class ServingMetrics:
    """One server's metrics, in a registry of its own."""

    def __init__(self, provider, generator):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moe_l2_serve_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("moe_l2_serve_requests_in_flight", "POST requests being answered", registry=r)
        queued = Gauge("moe_l2_serve_requests_queued", "requests waiting for the generation thread to take them",
                       registry=r)
        queued.set_function(generator.requests.qsize)
        self.cancelled = Counter("moe_l2_serve_requests_cancelled", "requests whose client hung up before their "
                                 "reply was complete (their generation is stopped)", registry=r)
        self.prompt_tokens = Counter("moe_l2_serve_prompt_tokens", "prompt tokens of the requests generated for "
                                     "(those the prompt cache had included)", registry=r)
        self.first_token_seconds = Counter("moe_l2_serve_first_token_seconds", "seconds from each request's "
                                           "arrival at the generation queue to its first token, summed", registry=r)
        self.generation_seconds = Counter("moe_l2_serve_generation_seconds", "seconds from each request's first "
                                          "token to its last, summed", registry=r)
        r.register(_GenerationCollector(generator))
        r.register(_PoolCollector(provider))

    def page(self) -> bytes:
        return generate_latest(self.registry)
