"""Job counts, and how they are shown: a tqdm bar on a terminal, plain log lines for schedulers
(no carriage returns), or nothing."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, IO

from batchrun.batch.job.metrics import RunMetrics

log = logging.getLogger("batchrun.progress")
MODES = ("auto", "bar", "log", "none")
# The bar's own rate and ETA are replaced by the token-based ones in its postfix: tqdm counts
# the lines an earlier attempt committed (they pass in a blink) as work done at this run's pace.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
BAR_REFRESH_S = 1.0
# The ETA divides by the engine's tokens per second over this much of the recent past (it
# slows down as fewer lines are left to batch), measured over at least MIN_RATE_SPAN_S.
RATE_WINDOW_S = 20.0
MIN_RATE_SPAN_S = 1.0


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
    """Shows `counts` as they move: a bar redrawn every second (its elapsed clock runs between
    completions), or a log line every `log_interval`.

    The ETA is token-based: time on these engines goes with the tokens run through the model
    (prompt + completion), not with the number of requests. When the runner gives `work` (the
    tokens the engine has run through the model this run, the prompt tokens among them, and its
    cache hit rate: engine.stats) and reports each admitted line's prompt and requested
    completion tokens (`admitted`),

        eta = (work left on the lines in flight + the lines not yet admitted) / recent tokens/s

    where the rate is measured over the last RATE_WINDOW_S (the engine slows down as fewer
    lines are left to batch). A completion's length is estimated from the lines that finished
    and the tokens the lines still running have generated so far (a length that stops with a
    constant chance per token, censored by the running ones: generated tokens / finished
    lines): counting only the lines that finished takes the short ones, which finish first, for
    the typical line, and the estimate fell to "eta 0s" at 60% of a run with 100 s left. A line
    in flight is expected to generate that many more tokens (at most its max_tokens), a line
    not yet admitted its prompt (less the cache hit rate) plus that length. "eta ?" until
    there is a rate to divide by.

    Without `work` (or before the engine reported any) the ETA comes from finished requests:
    (lines left x tokens per finished line) / tokens per second.
    """

    def __init__(self, mode: str | bool, counts: Counts, metrics: RunMetrics,
                 log_interval: float = 30.0, file: IO[str] | None = None,
                 work: Callable[[], tuple[int, int, float]] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """`work()`: (tokens computed by the engine since this run started, prompt tokens among
        them, its cache hit rate). `clock`: the clock metrics.start was taken on."""
        self.mode = resolve_mode(mode)
        self.counts, self.metrics = counts, metrics
        self.work, self.clock = work, clock
        self.admitted_lines = self.admitted_prompt = self.admitted_requested = 0
        self.log_interval = log_interval
        self._last = time.perf_counter()
        self._logged: tuple | None = None  # the counts the last log line showed
        # (time, tokens computed) samples of this run, the oldest within the rate's window
        self._samples: deque[tuple[float, int]] = deque([(metrics.start, 0)])
        self._prefilled, self._hit = 0, 0.0
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

    def _sample(self) -> None:
        """Read the engine's work now (the loop's thread only: `work` reads engine stats; the
        bar's timer thread only redraws)."""
        if self.work is None:
            return
        done, self._prefilled, self._hit = self.work()
        now, samples = self.clock(), self._samples
        if done < samples[-1][1]:  # a counter that went back: start the window again
            samples.clear()
        samples.append((now, done))
        while len(samples) > 2 and samples[1][0] <= now - RATE_WINDOW_S:
            samples.popleft()

    def _work_rate(self) -> float | None:
        (t0, w0), (t1, w1) = self._samples[0], self._samples[-1]
        if t1 - t0 < MIN_RATE_SPAN_S or w1 <= w0:
            return None
        return (w1 - w0) / (t1 - t0)

    def _eta_from_work(self) -> float | None:
        c, m = self.counts, self.metrics
        rate = self._work_rate()
        if rate is None or not self.admitted_lines or not c.total:
            return None
        done, prefilled, hit = self._samples[-1][1], self._prefilled, self._hit
        in_flight = max(0, self.admitted_lines - m.ok)
        # The lines in flight: their prompts not yet run (the cache hit rate taken off), and
        # the tokens they generated (decode work, less the finished lines' decode rows: each
        # line's first token comes with its prefill).
        prompt_if = max(0, self.admitted_prompt - m.prompt_tokens) * (1 - hit)
        prefill_left = max(0.0, prompt_if - max(0, prefilled - (m.prompt_tokens - m.cached_tokens)))
        requested_if = max(0, self.admitted_requested - m.requested_completion_tokens)
        generated_if = max(0, done - prefilled - max(0, m.completion_tokens - m.ok))
        per_line_requested = self.admitted_requested / self.admitted_lines
        # Tokens a line generates: generated / finished lines (the cap until a line finished).
        length = per_line_requested if not m.ok else (m.completion_tokens + generated_if) / m.ok
        left_if = prefill_left + (
            min(in_flight * length, max(0.0, requested_if - generated_if)) if in_flight else 0.0)
        finished = m.ok + m.failed
        ok_share = m.ok / finished if finished else 1.0
        waiting = max(0, c.total - c.done - in_flight)
        per_line = (self.admitted_prompt / self.admitted_lines * (1 - hit)
                    + min(length, per_line_requested))
        return (left_if + waiting * ok_share * per_line) / rate

    def eta(self) -> float | None:
        """Seconds left, from tokens; None until there is work to measure."""
        if self.work is not None:
            self._sample()
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

    def _eta_text(self) -> str:
        c = self.counts
        if not c.total or c.done >= c.total:
            return ""
        eta = self.eta()
        return f", eta {format_duration(eta) if eta is not None else '?'}"

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
        return text + f"; {req_s:.1f} req/s, {tok_s:.1f} output tok/s" + self._eta_text()

    def _postfix(self) -> str:
        _, tok_s = self._rate()
        return f"{tok_s:.1f} out tok/s, {self.counts.failed} failed" + self._eta_text()

    # --- events -----------------------------------------------------------------------------

    def _log_line(self) -> None:
        c = self.counts
        self._logged = (c.total, c.completed, c.failed)
        log.info("progress: %s", self.line())

    def advance(self) -> None:
        """A line finished."""
        if self._bar is not None:
            with self._lock:
                self._bar.update(1)
        self.tick()

    def tick(self) -> None:
        """The job loop's heartbeat (also between completions): the engine's work is sampled
        and the ETA refreshed every half second, a log line written every log_interval."""
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
                self._bar.total = total
                self._bar.refresh()

    def close(self) -> None:
        """The final state, shown once: the bar's last frame (then a newline), or one log line
        unless the last one already showed these counts."""
        self._closed.set()
        if self._ticker is not None:
            self._ticker.join()
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
