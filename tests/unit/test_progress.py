"""batchrun.batch.job.progress: the token-based ETA, one final line, logging while a bar is up."""

import contextlib
import io
import logging
import re
import sys
import time

import pytest

from batchrun.batch.job.metrics import RunMetrics
from batchrun.batch.job.progress import Counts, Reporter


def _metrics(seconds: float, ok: int, prompt: int, completion: int, failed: int = 0):
    m = RunMetrics()
    m.start = time.perf_counter() - seconds
    m.ok, m.failed, m.prompt_tokens, m.completion_tokens = ok, failed, prompt, completion
    return m


def test_no_eta_before_a_request_of_this_run_finished():
    r = Reporter("none", Counts(total=30, completed=17, resumed=17), _metrics(5, 0, 0, 0))
    assert r.eta() is None and r.line().endswith(", eta ?")


def test_eta_from_tokens_leaves_out_lines_of_earlier_attempts():
    # 17 lines committed earlier (instant), 3 of this run in 10 s at 1,000 tokens each: the
    # 10 lines left are 10,000 tokens at 300 tok/s, whatever the 17 resumed ones did.
    counts = Counts(total=30, completed=20, resumed=17)
    r = Reporter("none", counts, _metrics(10, ok=3, prompt=2400, completion=600))
    assert r.eta() == pytest.approx(10_000 / 300, rel=0.02)
    assert "eta 33s" in r.line()


def test_eta_expects_failed_lines_to_cost_nothing():
    counts = Counts(total=20, completed=5, failed=5)
    r = Reporter("none", counts, _metrics(10, ok=5, prompt=4000, completion=1000, failed=5))
    # 10 lines left, half of them expected to fail: 5 x 1,000 tokens at 500 tok/s
    assert r.eta() == pytest.approx(10, rel=0.02)


def test_final_log_line_is_printed_once(caplog):
    counts, metrics = Counts(total=3), RunMetrics()
    with caplog.at_level("INFO", logger="batchrun.progress"):
        r = Reporter("log", counts, metrics, log_interval=0)
        for _ in range(3):
            counts.completed += 1
            metrics.ok += 1
            r.advance()
        r.close()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "batchrun.progress"]
    assert len(lines) == 3
    assert sum("3/3 lines (100%)" in x for x in lines) == 1


def test_close_logs_the_final_line_when_the_interval_hid_it(caplog):
    counts, metrics = Counts(total=3), RunMetrics()
    with caplog.at_level("INFO", logger="batchrun.progress"):
        r = Reporter("log", counts, metrics, log_interval=3600)
        for _ in range(3):
            counts.completed += 1
            r.advance()
        r.close()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "batchrun.progress"]
    assert lines == [lines[0]] and "3/3 lines (100%), 3 ok, 0 failed" in lines[0]


@contextlib.contextmanager
def terminal(monkeypatch):
    """A fake stderr with the CLI's console handler on the root logger (set inside the test:
    pytest puts its own capture back on sys.stderr between a fixture's setup and the test)."""
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    handler = logging.StreamHandler(term)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield term, handler
    finally:
        root.removeHandler(handler)


def test_log_records_go_through_tqdm_while_the_bar_is_up(monkeypatch):
    with terminal(monkeypatch) as (term, handler):
        _bar_with_log_records(term, handler)


def _bar_with_log_records(term, handler):
    counts, metrics = Counts(total=3), RunMetrics()
    r = Reporter("bar", counts, metrics, file=term)
    assert handler not in logging.getLogger().handlers  # redirected while the bar is up
    logging.getLogger("batchrun.test").warning("stopping: admitting no more lines")
    for _ in range(3):
        counts.completed += 1
        r.advance()
    r.close()
    assert logging.getLogger().handlers.count(handler) == 1  # restored on close
    logging.getLogger("batchrun.test").warning("after the bar")
    out = term.getvalue()
    # The bar was cleared before the record and the record sits on a line of its own: not
    # glued to a frame ("...]WARNING"), and no stale "0/3" frame left on a line by itself.
    assert "\rWARNING batchrun.test: stopping: admitting no more lines\n" in out
    assert not re.search(r"[^\r\n]WARNING", out)
    finished_lines = [x.rsplit("\r", 1)[-1] for x in out.split("\n")]
    assert [x for x in finished_lines if "0/3" in x] == []
    # close() leaves the final frame and a newline; what is logged next starts a line
    assert re.search(r"\r100%[^\r\n]*3/3 \[[^\r\n]*\]\nWARNING batchrun.test: after the bar\n$", out)


def test_bar_shows_the_token_eta_and_its_final_frame_once(monkeypatch):
    with terminal(monkeypatch) as (term, _):
        _bar_with_resumed_lines(term)


def _bar_with_resumed_lines(term):
    counts = Counts(total=30, completed=17, resumed=17)
    metrics = _metrics(10, ok=3, prompt=2400, completion=600)
    counts.completed += 3
    r = Reporter("bar", counts, metrics, file=term)
    r._last = 0.0  # the postfix refreshes at the next advance
    counts.completed += 1
    metrics.ok += 1
    metrics.prompt_tokens += 1000
    r.advance()
    r._bar.refresh()
    frame = term.getvalue().rsplit("\r", 1)[-1]
    # 9 left x 1,000 tokens at 400 tok/s; tqdm's own rate would count the 17 resumed lines
    assert re.search(r"eta 2[12]s", frame), frame
    while counts.done < 30:
        counts.completed += 1
        r.advance()
    r.close()
    out = term.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1
    assert "30/30" in out.rsplit("\r", 1)[-1] and "eta" not in out.rsplit("\r", 1)[-1]


def test_eta_counts_the_work_in_flight_before_any_request_finished():
    # 100 lines, all admitted (prompt 100, 100 requested tokens each), none finished after
    # 10 s, 5,000 tokens computed: 100 x 200 - 5,000 left at 500 tokens/s = 30 s.
    r = Reporter("none", Counts(total=100), _metrics(10, 0, 0, 0),
                 work=lambda: (5000, 5000, 0.0))
    for _ in range(100):
        r.admitted(100, 100)
    assert r.eta() == pytest.approx(30.0, rel=0.01)


def test_eta_from_work_takes_cache_hits_and_early_stops_into_account():
    # Half the prompt tokens come from the cache; the 40 finished lines (of 100 admitted)
    # generated a quarter of what they asked for: a line costs 50 + 25 tokens. The 60 in
    # flight have 1,500 of their 3,000 uncached prompt tokens run, nothing generated yet.
    m = _metrics(10, ok=40, prompt=4000, completion=1000)
    m.cached_tokens, m.requested_completion_tokens = 2000, 4000
    prefilled = 2000 + 1500
    done = prefilled + (1000 - 40)  # decode rows: each line's first token came with its prefill
    r = Reporter("none", Counts(total=100, completed=40), m,
                 work=lambda: (done, prefilled, 0.5))
    for _ in range(100):
        r.admitted(100, 100)
    assert r.eta() == pytest.approx((1500 + 60 * 25) / (done / 10), rel=0.01)


def test_without_engine_work_the_eta_falls_back_to_finished_requests():
    r = Reporter("none", Counts(total=20, completed=10), _metrics(10, 10, 1000, 1000),
                 work=lambda: (0, 0, 0.0))
    assert r.eta() == pytest.approx(10.0, rel=0.01)


# 40 lines admitted at once (prompt 60, max_tokens 128), stopping at these lengths: the short
# ones finish first, as in any real run.
LENGTHS = [6, 9, 12, 15, 18, 22, 26, 30, 35, 40, 45, 50, 60, 70, 80, 90, 100, 110, 120, 128] * 2


def _simulated_run(step_s=0.5, token_s=0.02, prompt=60, requested=128):
    """(time, tokens computed, prompt tokens computed, line that finished or None) after each
    step of an engine whose step takes step_s + token_s per token (the prefill of every line,
    and its first token, in the first), and the end."""
    t, computed, running, events = 0.0, 0, {i: 0 for i in range(len(LENGTHS))}, []
    prefilled = len(LENGTHS) * prompt
    first = True
    while running:
        tokens = len(running) * (prompt if first else 1)
        t, computed, first = t + step_s + token_s * tokens, computed + tokens, False
        for i in list(running):
            running[i] += 1
            if running[i] >= LENGTHS[i]:
                del running[i]
                events.append((t, computed, prefilled, i))
        events.append((t, computed, prefilled, None))
    return events, t


# The engine's cache hit rate comes from the few requests that finished: it may be far off.
@pytest.mark.parametrize("reported_hit", [0.0, 0.9])
def test_the_eta_follows_the_time_left_to_the_end_and_does_not_drop_to_zero_early(reported_hit):
    events, end = _simulated_run()
    now, work = [0.0], [(0, 0, 0.0)]
    m, counts = RunMetrics(), Counts(total=len(LENGTHS))
    m.start = 0.0
    r = Reporter("none", counts, m, work=lambda: work[0], clock=lambda: now[0])
    for _ in LENGTHS:
        r.admitted(60, 128)
    assert r.eta() is None and r.line().endswith(", eta ?")  # no rate to divide by yet
    ratios = []
    for t, computed, prefilled, line in events:
        now[0], work[0] = t, (computed, prefilled, reported_hit)
        if line is not None:
            m.ok, m.prompt_tokens = m.ok + 1, m.prompt_tokens + 60
            m.completion_tokens += LENGTHS[line]
            m.requested_completion_tokens += 128
            counts.completed += 1
        eta = r.eta()
        assert eta is not None
        if end - t > 5:
            ratios.append(eta / (end - t))
    # Before: "eta 0s" from the 12th of 40 lines on, with 80 of the run's 154 s left.
    assert 0.5 <= min(ratios) and max(ratios) <= 2.0, ratios


def test_the_bar_clock_runs_between_completions(monkeypatch):
    with terminal(monkeypatch) as (term, _):
        r = Reporter("bar", Counts(total=3), RunMetrics(), file=term)
        time.sleep(2.3)  # no line finishes: the bar is still redrawn every second
        r.close()
    frames = {f.split("[", 1)[1][:5] for f in term.getvalue().split("\r") if "[" in f}
    assert {"00:01", "00:02"} <= frames, frames
