"""Job counts, and how they are shown: a tqdm bar on a terminal, plain log lines for schedulers
(no carriage returns), or nothing."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, IO

from batchrun.batch.job.metrics import RunMetrics

log = logging.getLogger("batchrun.progress")
MODES = ("auto", "bar", "log", "none")
# The bar's own rate and ETA are replaced by the ones in its postfix: tqdm counts the lines an
# earlier attempt committed (they pass in a blink) as work done at this run's pace.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
BAR_REFRESH_S = 1.0
# The ETA's rate is measured over at least this long: the lines that finish in the same engine
# step would otherwise make it instant.
MIN_RATE_SPAN_S = 1.0


@dataclass
class Counts:
    """Request counts of a whole job (earlier attempts included), as OpenAI's request_counts."""

    total: int | None  # input lines; None until known (all read, or counted up front)
    completed: int = 0
    failed: int = 0
    resumed: int = 0  # of completed + failed: committed by an earlier attempt
    expired: int = 0  # of failed: not run before the deadline (a batch_expired error line)

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
    """Shows `counts` as they move: a bar redrawn every second (its elapsed clock runs between
    completions), or a log line every `log_interval`. The bar's position is the counts' (set
    from them, never counted on its own), so its last frame is what the run reports.

    The ETA comes from the rate of this run's completed requests since its first: lines left x
    (time since this run's first completed line / lines completed since), the lines expected to
    fail (as many as have, in share) costing nothing. None, and no ETA shown, until a second
    line of this run completed, MIN_RATE_SPAN_S after the first: before that there is no rate,
    only a guess. Timed from the first completion, not from the start, because the start holds
    the prefill of every line admitted at once and the wait for the shortest answer (counted as
    one line's time, it put the ETA 7-20x too high early on).

    Once every line is in the engine (nothing waits) the run ends when the lines in flight do,
    and they are the long ones: lines finish shortest first, so the completion rate runs ahead
    (a 30-line file all admitted at once read 7x low). With `engine_work` (the engine's steps
    and decode tokens this run) and the requested tokens of each admitted line (`admitted`),
    the ETA is then at least a line's expected length (generated tokens, of finished and
    running lines, per finished line: a length that stops with a constant chance per token) at
    most what the running lines have left of their max_tokens, in decode steps at this run's
    seconds per step. In simulated runs the ETA stays within 0.7-2.5x of the time left but for
    the last seconds (tests/unit/test_progress.py). An ETA from the engine's tokens per second
    over the last 20 s, before, was 3-7x too low on a busy machine (the prefill's cheap tokens
    set the rate) and showed "eta 35s" with nothing done.
    """

    def __init__(self, mode: str | bool, counts: Counts, metrics: RunMetrics,
                 log_interval: float = 30.0, file: IO[str] | None = None,
                 engine_work: Callable[[], tuple[int, int]] | None = None):
        """`engine_work()`: (engine steps, decode tokens computed) since this run started."""
        self.mode = resolve_mode(mode)
        self.counts, self.metrics = counts, metrics
        self.engine_work = engine_work
        self.admitted_lines = self.admitted_requested = 0
        self.log_interval = log_interval
        self._last = time.perf_counter()
        self._logged: tuple | None = None  # the counts the last log line showed
        # (elapsed, ok, engine steps) at this run's first completed line
        self._first: tuple[float, int, int] | None = None
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._closed = threading.Event()
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
            # The bar's elapsed clock moves only when it is redrawn: redraw it every second,
            # so a long wait for the next completion does not look like a hang.
            self._ticker = threading.Thread(target=self._tick_bar, name="batchrun-progress",
                                            daemon=True)
            self._ticker.start()

    # --- figures ----------------------------------------------------------------------------

    def _rate(self) -> tuple[float, float]:
        elapsed = self.metrics.elapsed()
        if elapsed <= 0:
            return 0.0, 0.0
        return self.metrics.done / elapsed, self.metrics.completion_tokens / elapsed

    def admitted(self, requested_tokens: int) -> None:
        """A line went to the engine asking for this many completion tokens."""
        self.admitted_lines += 1
        self.admitted_requested += requested_tokens

    def _note_first(self) -> None:
        if self._first is None and self.metrics.ok:
            steps = self.engine_work()[0] if self.engine_work is not None else 0
            self._first = (self.metrics.elapsed(), self.metrics.ok, steps)

    def eta(self) -> float | None:
        """Seconds left, from this run's completed requests since its first (and the lines in
        flight once nothing waits); None until a second one."""
        c, m = self.counts, self.metrics
        self._note_first()
        if not c.total or self._first is None:
            return None
        since, ok = m.elapsed() - self._first[0], m.ok - self._first[1]
        if ok <= 0 or since < MIN_RATE_SPAN_S:
            return None
        left = max(0, c.total - c.done)
        return max(left * (m.ok / m.done) * since / ok, self._drain(since))

    def _drain(self, since: float) -> float:
        """Seconds the lines in flight need when no line waits (0 while some do): see the
        class docstring."""
        c, m, first = self.counts, self.metrics, self._first
        in_flight = self.admitted_lines - m.ok
        if self.engine_work is None or first is None or c.total is None or in_flight <= 0 \
                or c.total - c.done > in_flight:
            return 0.0
        steps, decoded = self.engine_work()
        if steps <= first[2]:
            return 0.0
        # What the lines in flight generated: the decode steps' tokens but the finished lines'
        # (each line's first token comes with its prefill).
        running = max(0, decoded - (m.completion_tokens - m.ok))
        length = (m.completion_tokens + running) / m.ok
        cap = (self.admitted_requested - m.requested_completion_tokens - running) / in_flight
        return max(0.0, min(length, cap)) * since / (steps - first[2])

    def _eta_text(self) -> str:
        c = self.counts
        if not c.total or c.done >= c.total:
            return ""
        eta = self.eta()
        return "" if eta is None else f", eta {format_duration(eta)}"

    def line(self) -> str:
        c = self.counts
        req_s, tok_s = self._rate()
        text = f"{c.done}"
        if c.total is not None:
            text += f"/{c.total} lines ({c.done / c.total:.0%})" if c.total else "/0 lines"
        else:
            text += " lines"
        text += f", {c.completed} ok, " + self._failed_text()
        if c.resumed:
            text += f" ({c.resumed} from earlier attempts)"
        return text + f"; {req_s:.1f} req/s, {tok_s:.1f} output tok/s" + self._eta_text()

    def _failed_text(self) -> str:
        """Failed lines in the summary's categories: the deadline's batch_expired apart."""
        c = self.counts
        text = f"{c.failed - c.expired} failed"
        return text + (f", {c.expired} expired" if c.expired else "")

    def _postfix(self) -> str:
        _, tok_s = self._rate()
        return f"{tok_s:.1f} out tok/s, {self._failed_text()}" + self._eta_text()

    # --- events -----------------------------------------------------------------------------

    def _log_line(self) -> None:
        c = self.counts
        self._logged = (c.total, c.completed, c.failed)
        log.info("progress: %s", self.line())

    def _sync_bar(self) -> None:
        """The bar's position and total from the counts (under the lock)."""
        bar, c = self._bar, self.counts
        if c.total is not None:
            bar.total = c.total
        bar.update(c.done - bar.n)

    def advance(self) -> None:
        """A line finished (the counts already say so)."""
        self._note_first()
        if self._bar is not None:
            with self._lock:
                self._sync_bar()
        self.tick()

    def tick(self) -> None:
        """The job loop's heartbeat (also between completions): the ETA refreshed every half
        second, a log line written every log_interval."""
        now = time.perf_counter()
        if self._bar is not None:
            if now - self._last > 0.5:
                self._last = now
                with self._lock:
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
        elif self.mode == "log" and now - self._last >= self.log_interval:
            self._last = now
            self._log_line()

    def _tick_bar(self) -> None:
        while not self._closed.wait(BAR_REFRESH_S):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()

    def set_total(self, total: int) -> None:
        self.counts.total = total
        if self._bar is not None:
            with self._lock:
                self._sync_bar()
                self._bar.refresh()

    def close(self) -> None:
        """The final state, shown once: the bar's last frame, at the counts the run reports
        (then a newline), or one log line unless the last one already showed these counts."""
        self._closed.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            bar = self._bar
            try:
                self._sync_bar()
                bar.set_postfix_str(self._postfix(), refresh=False)
            finally:
                self._bar = None
                try:
                    bar.close()
                finally:
                    if self._redirect is not None:
                        self._redirect.close()
                        self._redirect = None
        elif self.mode == "log":
            c = self.counts
            if self._logged != (c.total, c.completed, c.failed):
                self._log_line()
