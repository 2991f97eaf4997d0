"""Counters of a batch run and the metrics summary written at its end."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Mapping

from batchrun.engine.client import EngineClient, EngineStats
from batchrun.engine.outputs import RequestOutput


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _plain(stats: EngineStats) -> dict[str, Any]:
    """Engine stats (batchrun.engine.client.EngineClient.stats) as JSON-friendly data."""
    return dataclasses.asdict(stats)


class Reservoir:
    """A uniform sample of at most `size` values (Algorithm R): percentiles over millions of
    requests at constant memory; exact while fewer than `size` values came."""

    def __init__(self, size: int = 10_000, seed: int = 0):
        self.size, self.seen = size, 0
        self.values: list[float] = []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            i = self._rng.randrange(self.seen)
            if i < self.size:
                self.values[i] = value


class RunMetrics:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ok = 0
        self.requested_completion_tokens = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttfts = Reservoir()

    @property
    def done(self) -> int:
        return self.ok + self.failed

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def record_ok(self, output: RequestOutput, requested: int = 0) -> None:
        """`requested`: the completion tokens the request asked for (max_tokens x choices):
        what `batchrun plan` counts, against what was generated."""
        self.ok += 1
        self.requested_completion_tokens += requested
        self.prompt_tokens += len(output.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        self.cached_tokens += output.num_cached_tokens
        m = output.metrics
        if m is not None and m.first_token_time is not None:
            self.ttfts.add(m.first_token_time - m.arrival_time)

    def record_failed(self) -> None:
        self.failed += 1

    def summary(self, engine: EngineClient | None = None, **extra: Any) -> dict[str, Any]:
        wall = self.elapsed()
        per_s = (lambda n: n / wall) if wall > 0 else (lambda n: 0.0)
        result: dict[str, Any] = {
            **extra,
            "requests": {"total": self.done, "ok": self.ok, "failed": self.failed},
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "requested_completion_tokens": self.requested_completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "wall_time_s": wall,
            "requests_per_s": per_s(self.done),
            "output_tokens_per_s": per_s(self.completion_tokens),
            "total_tokens_per_s": per_s(self.prompt_tokens + self.completion_tokens),
            "ttft_s": {"p50": percentile(self.ttfts.values, 50),
                      "p90": percentile(self.ttfts.values, 90)},
        }
        if engine is not None:
            result["engine"] = _plain(engine.stats)
        return result


def summary_text(m: Mapping[str, Any]) -> str:
    """One paragraph for stderr, about what this run did: after a resume, the lines an earlier
    attempt committed are named apart and left out of the rates."""
    r = m["requests"]
    ttft = m["ttft_s"]
    this = m.get("this_run")
    wall = m["wall_time_s"]
    if m.get("resumed") and this is not None:
        ran = this["ok"] + this["failed"]
        req_s = ran / wall if wall > 0 else 0.0
        text = (f"{ran} requests this run ({this['ok']} ok, {this['failed']} failed; "
                f"+{m['resumed']} committed earlier, {r['total']} in the job) in ")
    else:
        req_s = m["requests_per_s"]
        text = f"{r['total']} requests ({r['ok']} ok, {r['failed']} failed) in "
    text += (f"{wall:.1f} s: {req_s:.2f} req/s, "
             f"{m['output_tokens_per_s']:.1f} output tok/s, "
             f"{m['total_tokens_per_s']:.1f} total tok/s; {m['prompt_tokens']} prompt tokens "
             f"({m['cache_hit_rate']:.0%} from the prefix cache), "
             f"{m['completion_tokens']} completion tokens")
    if ttft["p50"] is not None:
        text += f"; time to first token p50 {ttft['p50']:.2f} s, p90 {ttft['p90']:.2f} s"
    return text + "."
