"""Job counts, and how they are shown: a tqdm bar on a terminal, plain log lines for schedulers
(no carriage returns), or nothing."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from batchrun.batch.metrics import RunMetrics

log = logging.getLogger("batchrun.progress")
MODES = ("auto", "bar", "log", "none")


@dataclass
class Counts:
    """Request counts of a whole job (earlier attempts included), as OpenAI's request_counts."""

    total: int | None  # input lines; None until known (all read, or counted up front)
    completed: int = 0
    failed: int = 0
    resumed: int = 0  # of completed + failed: committed by an earlier attempt

    @property
    def done(self) -> int:
        return self.completed + self.failed


def resolve_mode(mode: str | bool) -> str:
    if mode is True:
        mode = "auto"
    elif mode is False:
        mode = "none"
    if mode not in MODES:
        raise ValueError(f"progress must be one of {', '.join(MODES)}")
    if mode == "auto":
        return "bar" if sys.stderr.isatty() else "log"
    return mode


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Reporter:
    def __init__(self, mode: str | bool, counts: Counts, metrics: RunMetrics,
                 log_interval: float = 30.0):
        self.mode = resolve_mode(mode)
        self.counts, self.metrics = counts, metrics
        self.log_interval = log_interval
        self._last = time.perf_counter()
        self._bar: Any = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=counts.total, initial=counts.done, unit="req", file=sys.stderr,
                             dynamic_ncols=True, smoothing=0.05)

    def _rate(self) -> tuple[float, float]:
        elapsed = self.metrics.elapsed()
        if elapsed <= 0:
            return 0.0, 0.0
        return self.metrics.done / elapsed, self.metrics.completion_tokens / elapsed

    def line(self) -> str:
        c = self.counts
        req_s, tok_s = self._rate()
        text = f"{c.done}"
        if c.total is not None:
            text += f"/{c.total} lines ({c.done / c.total:.0%})" if c.total else "/0 lines"
        else:
            text += " lines"
        text += f", {c.completed} ok, {c.failed} failed"
        if c.resumed:
            text += f" ({c.resumed} from earlier attempts)"
        text += f"; {req_s:.1f} req/s, {tok_s:.1f} output tok/s"
        if c.total and req_s > 0 and c.done < c.total:
            text += f", eta {_duration((c.total - c.done) / req_s)}"
        return text

    def advance(self) -> None:
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._last > 0.5:
                self._last = now
                _, tok_s = self._rate()
                self._bar.set_postfix_str(f"{tok_s:.1f} out tok/s, {self.counts.failed} failed",
                                          refresh=False)
        elif self.mode == "log" and now - self._last >= self.log_interval:
            self._last = now
            log.info("progress: %s", self.line())

    def set_total(self, total: int) -> None:
        self.counts.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "log":
            log.info("progress: %s", self.line())
