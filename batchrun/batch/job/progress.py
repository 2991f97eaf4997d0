"""Job counts, and how they are shown: a tqdm bar on a terminal, plain log lines for schedulers
(no carriage returns), or nothing."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, IO

from batchrun.batch.job.metrics import RunMetrics

log = logging.getLogger("batchrun.progress")
MODES = ("auto", "bar", "log", "none")
# The bar's own rate and ETA are replaced by the token-based ones in its postfix: tqdm counts
# the lines an earlier attempt committed (they pass in a blink) as work done at this run's pace.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


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


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Reporter:
    """Shows `counts` as they move. The ETA is token-based: time on these engines goes with
    the tokens run through the model (prompt + completion), not with the number of requests, so
    the estimate is (expected tokens of the lines left) / (tokens processed per second this
    run), where a line left is expected to cost the average prompt + completion tokens of the
    lines finished so far (metrics records them as each request finishes). Lines committed by an
    earlier attempt count as done but not as work done at this run's pace.

    Counting only finished requests runs high early (the short ones finish first: "eta 3m22s"
    at 1/24 lines of a run that took 44 s). So when the runner gives `work` (the tokens the
    engine has run through the model this run: engine.stats.computed_tokens) and reports each
    admitted line's prompt and requested completion tokens (`admitted`), the work in flight
    counts too: a line is expected to cost its prompt tokens less the engine's cache hit rate,
    plus its requested completion tokens times the share the finished requests generated (all
    of it until a quarter of the admitted lines finished), and
        eta = (lines left x cost per line - work done on the lines in flight) / work per second.
    """

    def __init__(self, mode: str | bool, counts: Counts, metrics: RunMetrics,
                 log_interval: float = 30.0, file: IO[str] | None = None,
                 work: Callable[[], tuple[int, float]] | None = None):
        """`work()`: (tokens computed by the engine since this run started, its cache hit
        rate)."""
        self.mode = resolve_mode(mode)
        self.counts, self.metrics = counts, metrics
        self.work = work
        self.admitted_lines = self.admitted_prompt = self.admitted_requested = 0
        self.log_interval = log_interval
        self._last = time.perf_counter()
        self._logged: tuple | None = None  # the counts the last log line showed
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        if self.mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=counts.total, initial=counts.done, unit="req",
                             file=file if file is not None else sys.stderr,
                             dynamic_ncols=True, bar_format=BAR_FORMAT)
            # While the bar is up, console log records go through tqdm.write: they clear the
            # bar, print on their own line and redraw it (no "^CWARNING ..." glued to the bar,
            # no stale copy of it left above a message).
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())

    # --- figures ----------------------------------------------------------------------------

    def _finished_tokens(self) -> int:
        return self.metrics.prompt_tokens + self.metrics.completion_tokens

    def _rate(self) -> tuple[float, float]:
        elapsed = self.metrics.elapsed()
        if elapsed <= 0:
            return 0.0, 0.0
        return self.metrics.done / elapsed, self.metrics.completion_tokens / elapsed

    def admitted(self, prompt_tokens: int, requested_tokens: int) -> None:
        """A line went to the engine with these prompt and requested completion tokens."""
        self.admitted_lines += 1
        self.admitted_prompt += prompt_tokens
        self.admitted_requested += requested_tokens

    def _eta_from_work(self) -> float | None:
        c, m = self.counts, self.metrics
        done, hit = self.work()
        elapsed = m.elapsed()
        if done <= 0 or elapsed <= 0 or not self.admitted_lines or not c.total:
            return None
        finished = m.ok + m.failed
        share = 1.0
        if m.ok >= max(1, self.admitted_lines // 4) and m.requested_completion_tokens:
            share = min(1.0, m.completion_tokens / m.requested_completion_tokens)
        cost = (self.admitted_prompt * (1 - hit) + self.admitted_requested * share) / \
            self.admitted_lines
        ok_share = m.ok / finished if finished else 1.0
        finished_work = m.prompt_tokens - m.cached_tokens + m.completion_tokens
        in_flight_work = max(0, done - finished_work)
        left = c.total - c.done
        remaining = max(0.0, left * ok_share * cost - in_flight_work)
        return remaining / (done / elapsed)

    def eta(self) -> float | None:
        """Seconds left, from tokens; None until there is work to measure."""
        if self.work is not None:
            eta = self._eta_from_work()
            if eta is not None:
                return eta
        c, m = self.counts, self.metrics
        if not c.total or m.ok == 0:
            return None
        left = c.total - c.done
        if left <= 0:
            return 0.0
        elapsed = m.elapsed()
        processed = self._finished_tokens()
        if elapsed <= 0 or processed <= 0:
            return None
        per_line = self._finished_tokens() / m.ok
        # Lines that fail (bad JSON, validation) cost no engine time: expect the same share of
        # the lines left to.
        work_share = m.ok / m.done
        return left * work_share * per_line / (processed / elapsed)

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
        eta = self.eta()
        if eta is not None and c.total and c.done < c.total:
            text += f", eta {format_duration(eta)}"
        return text

    def _postfix(self) -> str:
        _, tok_s = self._rate()
        text = f"{tok_s:.1f} out tok/s, {self.counts.failed} failed"
        c, eta = self.counts, self.eta()
        if eta is not None and c.total and c.done < c.total:
            text += f", eta {format_duration(eta)}"
        return text

    # --- events -----------------------------------------------------------------------------

    def _log_line(self) -> None:
        c = self.counts
        self._logged = (c.total, c.completed, c.failed)
        log.info("progress: %s", self.line())

    def advance(self) -> None:
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._last > 0.5:
                self._last = now
                self._bar.set_postfix_str(self._postfix(), refresh=False)
        elif self.mode == "log" and now - self._last >= self.log_interval:
            self._last = now
            self._log_line()

    def set_total(self, total: int) -> None:
        self.counts.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        """The final state, shown once: the bar's last frame (then a newline), or one log line
        unless the last one already showed these counts."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            try:
                bar.set_postfix_str(self._postfix(), refresh=False)
                bar.close()
            finally:
                if self._redirect is not None:
                    self._redirect.close()
                    self._redirect = None
        elif self.mode == "log":
            c = self.counts
            if self._logged != (c.total, c.completed, c.failed):
                self._log_line()
