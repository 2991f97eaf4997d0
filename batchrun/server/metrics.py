"""Prometheus metrics of the server, in the text exposition format (no client library needed).

Counters and histograms are updated from the event loop (HTTP) and the engine thread (finished
requests), so each takes a lock; gauges are read from the engine's snapshot when scraped.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Callable

from batchrun.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help, labels
        self.values: dict[tuple[str, ...], float] = {}
        self.lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self.lock:
            self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self.lock:
            items = sorted(self.values.items())
        if not items and not self.labelnames:
            items = [((), 0.0)]
        lines += [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...],
                 labels: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help, labels
        self.buckets = tuple(buckets) + (math.inf,)
        self.series: dict[tuple[str, ...], list] = {}  # labels -> [bucket counts, sum, count]
        self.lock = threading.Lock()

    def observe(self, value: float, *labels: str) -> None:
        with self.lock:
            s = self.series.setdefault(labels, [[0] * len(self.buckets), 0.0, 0])
            s[0][bisect.bisect_left(self.buckets, value)] += 1
            s[1] += value
            s[2] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self.lock:
            items = sorted((k, [list(v[0]), v[1], v[2]]) for k, v in self.series.items())
        for key, (counts, total, count) in items:
            running = 0
            for bound, c in zip(self.buckets, counts):
                running += c
                le = f'le="{_num(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {running}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total)}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {count}")
        return lines


class Gauge:
    def __init__(self, name: str, help: str, read: Callable[[], float]):
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge",
                f"{self.name} {_num(self.read())}"]


class ServerMetrics:
    """Everything /metrics shows. `source` is "api" for HTTP requests, "batch" for Batches work."""

    def __init__(self):
        self.http_requests = Counter("batchrun_http_requests_total",
                                     "HTTP requests answered, by route and status code.",
                                     ("method", "route", "status"))
        self.finished = Counter("batchrun_requests_finished_total",
                                "Engine requests finished, by source and finish reason.",
                                ("source", "finish_reason"))
        self.prompt_tokens = Counter("batchrun_prompt_tokens_total",
                                     "Prompt tokens of finished requests.", ("source",))
        self.cached_tokens = Counter("batchrun_cached_prompt_tokens_total",
                                     "Prompt tokens served from the prefix cache.", ("source",))
        self.generation_tokens = Counter("batchrun_generation_tokens_total",
                                         "Generated tokens of finished requests.", ("source",))
        self.ttft = Histogram("batchrun_time_to_first_token_seconds",
                              "From arrival in the engine to the first generated token.",
                              LATENCY_BUCKETS, ("source",))
        self.itl = Histogram("batchrun_inter_token_latency_seconds",
                             "Mean time between generated tokens, one observation per request.",
                             ITL_BUCKETS, ("source",))
        self.e2e = Histogram("batchrun_request_latency_seconds",
                             "From arrival in the engine to the last token.", LATENCY_BUCKETS,
                             ("source",))
        self._parts: list = [self.http_requests, self.finished, self.prompt_tokens,
                             self.cached_tokens, self.generation_tokens, self.ttft, self.itl,
                             self.e2e]

    def attach_engine(self, ae) -> None:
        """Gauges of the engine behind `ae` (an AsyncEngine)."""
        stats = ae.engine.stats
        self._parts += [
            Gauge("batchrun_num_requests_running", "Sequences in the running batch.",
                  lambda: ae.snapshot.running),
            Gauge("batchrun_num_requests_waiting", "Sequences waiting to be scheduled.",
                  lambda: ae.snapshot.waiting),
            Gauge("batchrun_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
                  lambda: ae.snapshot.kv_usage),
            Gauge("batchrun_prefix_cache_hit_rate",
                  "Prompt tokens found in the prefix cache over all prompt tokens, since start.",
                  lambda: stats.cache_hit_rate),
            Gauge("batchrun_num_preemptions", "Preemptions since start.",
                  lambda: stats.num_preemptions),
            Gauge("batchrun_engine_alive", "1 while the engine loop runs, 0 once it died.",
                  lambda: 1 if ae.is_alive else 0),
        ]

    def record_finished(self, out: RequestOutput, source: str) -> None:
        reasons = {c.finish_reason or "unknown" for c in out.outputs}
        for reason in reasons:
            self.finished.inc(1, source, "error" if out.error else reason)
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens.inc(len(out.prompt_token_ids), source)
        self.cached_tokens.inc(out.num_cached_tokens, source)
        self.generation_tokens.inc(generated, source)
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time), source)
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time), source)
            longest = max(len(c.token_ids) for c in out.outputs)
            if longest > 1:
                self.itl.observe(max(0.0, m.finished_time - m.first_token_time) / (longest - 1),
                                 source)

    def render(self) -> str:
        lines: list[str] = []
        for part in self._parts:
            lines += part.render()
        return "\n".join(lines) + "\n"
