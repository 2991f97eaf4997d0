"""Prometheus metrics of the server, on prometheus_client.

Each server has a registry of its own (not prometheus_client's global one), so several servers
in one process (the tests) each count only their own requests. Counters and histograms are
updated from the event loop (HTTP) and the engine thread (finished requests); prometheus_client
locks them. The engine's gauges are read from its snapshot when /metrics is scraped.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchrun.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)

# (name, help, read(async_engine, snapshot)) of each engine gauge.
ENGINE_GAUGES = (
    ("batchrun_num_requests_running", "Sequences in the running batch.",
     lambda ae, snap: snap.running),
    ("batchrun_num_requests_waiting", "Sequences waiting to be scheduled.",
     lambda ae, snap: snap.waiting),
    ("batchrun_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
     lambda ae, snap: snap.kv_usage),
    ("batchrun_prefix_cache_hit_rate",
     "Prompt tokens found in the prefix cache over all prompt tokens, since start.",
     lambda ae, snap: ae.engine.stats.cache_hit_rate),
    ("batchrun_num_preemptions", "Preemptions since start.",
     lambda ae, snap: ae.engine.stats.num_preemptions),
    ("batchrun_engine_alive", "1 while the engine loop runs, 0 once it died.",
     lambda ae, snap: 1 if ae.is_alive else 0),
)


class EngineCollector(Collector):
    """The engine gauges, read at scrape time from one snapshot of the engine behind `ae`."""

    def __init__(self, ae):
        self.ae = ae

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, help_, _ in ENGINE_GAUGES:
            yield GaugeMetricFamily(name, help_)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.ae.snapshot  # replaced whole by the engine thread: one consistent read
        for name, help_, read in ENGINE_GAUGES:
            yield GaugeMetricFamily(name, help_, value=float(read(self.ae, snap)))


class ServerMetrics:
    """Everything /metrics shows. `source` is "api" for HTTP requests, "batch" for Batches work.

    prometheus_client names a counter's sample <name>_total (and adds <name>_created), so the
    counters below are declared without the suffix and expose the same names as before."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.http_requests = Counter("batchrun_http_requests",
                                     "HTTP requests answered, by route and status code.",
                                     ("method", "route", "status"), registry=reg)
        self.http_duration = Histogram("batchrun_http_request_duration_seconds",
                                       "From the request's arrival to the response's last byte.",
                                       ("method", "route"), buckets=LATENCY_BUCKETS, registry=reg)
        self.finished = Counter("batchrun_requests_finished",
                                "Engine requests finished, by source and finish reason.",
                                ("source", "finish_reason"), registry=reg)
        self.prompt_tokens = Counter("batchrun_prompt_tokens",
                                     "Prompt tokens of finished requests.", ("source",),
                                     registry=reg)
        self.cached_tokens = Counter("batchrun_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache.", ("source",),
                                     registry=reg)
        self.generation_tokens = Counter("batchrun_generation_tokens",
                                         "Generated tokens of finished requests.", ("source",),
                                         registry=reg)
        self.ttft = Histogram("batchrun_time_to_first_token_seconds",
                              "From arrival in the engine to the first generated token.",
                              ("source",), buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("batchrun_inter_token_latency_seconds",
                             "Mean time between generated tokens, one observation per request.",
                             ("source",), buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("batchrun_request_latency_seconds",
                             "From arrival in the engine to the last token.", ("source",),
                             buckets=LATENCY_BUCKETS, registry=reg)

        self.batches_ended = Counter("batchrun_batches_ended",
                                     "Batches of the Batches API that ended, by final status "
                                     "(completed, failed, cancelled, expired).", ("status",),
                                     registry=reg)
        self.batch_lines_expired = Counter("batchrun_batch_requests_expired",
                                           "Batch requests given a batch_expired error line "
                                           "because their batch's completion_window passed.",
                                           registry=reg)

    def attach_engine(self, ae) -> None:
        """Gauges of the engine behind `ae` (an AsyncEngine)."""
        self.registry.register(EngineCollector(ae))

    def record_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_duration.labels(method, route).observe(seconds)

    def record_finished(self, out: RequestOutput, source: str) -> None:
        reasons = {c.finish_reason or "unknown" for c in out.outputs}
        for reason in reasons:
            self.finished.labels(source, "error" if out.error else reason).inc()
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens.labels(source).inc(len(out.prompt_token_ids))
        self.cached_tokens.labels(source).inc(out.num_cached_tokens)
        self.generation_tokens.labels(source).inc(generated)
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        self.ttft.labels(source).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.labels(source).observe(max(0.0, m.finished_time - m.arrival_time))
            longest = max(len(c.token_ids) for c in out.outputs)
            if longest > 1:
                self.itl.labels(source).observe(
                    max(0.0, m.finished_time - m.first_token_time) / (longest - 1))

    def value(self, name: str, **labels: str) -> float:
        """One sample's value by its exposed name (batchrun_..._total), 0 where none yet."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        """The exposition text of this server's registry (served as CONTENT_TYPE)."""
        return generate_latest(self.registry)
