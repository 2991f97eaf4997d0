"""Which recorded runs may calibrate `batchrun plan`'s time estimate, and how sure it is.

A run calibrates only when it did enough work for its wall time to be the engine's work rather
than its fixed costs (the first steps' warm-up, adding and finishing requests): at least
MIN_REQUESTS completed requests over at least MIN_STEPS engine steps. Measured on this
project's 2-core machine, the bundled model: a one-request run took 6.3 s for 8 steps where
sample_data/chat.jsonl's 30 requests took 40.1 s for 129; calibrated on the small run, the
sample was estimated 1.8x too long (and 10x on other files).

How sure: a run-calibrated estimate is as good as the runs agree, and a machine's load moves a
run's time by RUN_MARGIN either way. The micro-benchmark is a few seconds of a 2-layer copy
that counts every requested token where a run stops at EOS, and a few seconds of a shared
machine's load swing it: on this project's 2-core machine, with other test runs going, its
estimate of sample_data/chat.jsonl was 10 s, 26 s, 48 s and 115 s against runs of 40-44 s
(the measured run 0.35x-4.4x of it; 0.9x-1.75x on an idle Xeon), so its range is that wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_REQUESTS = 16
MIN_STEPS = 50
RUN_MARGIN = 1.3
# The measured run over the micro-benchmark's estimate was 0.35x-4.4x.
BENCHMARK_LOW, BENCHMARK_HIGH = 0.3, 4.5


def too_small(summary: dict[str, Any]) -> str | None:
    """Why a run's metrics summary is too small to calibrate ("1 request, 8 steps"), or None."""
    requests = summary.get("requests", {})
    try:
        ok = int(requests.get("ok", 0) if isinstance(requests, dict) else requests)
        steps = (summary.get("engine") or {}).get("steps")
        steps = None if steps is None else int(steps)
    except (TypeError, ValueError, AttributeError):
        return "unreadable metrics"
    if ok >= MIN_REQUESTS and (steps is None or steps >= MIN_STEPS):
        return None
    what = f"{ok} request{'s' if ok != 1 else ''}"
    return what + (f", {steps} engine steps" if steps is not None else "")


def calibrating_runs(records: list[dict]) -> tuple[list[dict], str | None]:
    """(the records big enough to calibrate, newest first; why the newest run was passed over
    when it was: "the last run, 1 request, is too small to calibrate")."""
    usable = [r for r in records if too_small(r["summary"]) is None]
    why = None
    if records and (not usable or usable[0] is not records[0]):
        why = f"the last run ({too_small(records[0]['summary'])}) is too small to calibrate"
    return usable, why


@dataclass(frozen=True)
class TimeRange:
    low: float
    high: float
    confidence: str  # low | medium | high
    basis: str  # why, in words


def from_runs(estimates: list[float]) -> TimeRange:
    """The range of the estimates each calibrating run gives (newest first), widened by the
    machine's load."""
    low, high = min(estimates) / RUN_MARGIN, max(estimates) * RUN_MARGIN
    n = len(estimates)
    margin = f"a machine's load moves a run's time ±{RUN_MARGIN - 1:.0%}"
    if n == 1:
        return TimeRange(low, high, "medium",
                         f"1 run of at least {MIN_REQUESTS} requests calibrates it; {margin}")
    spread = max(estimates) / min(estimates) - 1 if min(estimates) > 0 else 0.0
    level = "high" if n >= 3 and spread <= 0.25 else "medium"
    return TimeRange(low, high, level, f"{n} runs of at least {MIN_REQUESTS} requests "
                     f"calibrate it, differing by {spread:.0%}; {margin}")


def from_benchmark(seconds: float, why_not_a_run: str) -> TimeRange:
    """The micro-benchmark's wide range; `why_not_a_run` says why no run calibrated it."""
    return TimeRange(seconds * BENCHMARK_LOW, seconds * BENCHMARK_HIGH, "low",
                     f"a few-second micro-benchmark ({why_not_a_run}); it counts every requested "
                     f"token and sees only a moment of the machine's load; a run of at least "
                     f"{MIN_REQUESTS} requests calibrates the next plan")
