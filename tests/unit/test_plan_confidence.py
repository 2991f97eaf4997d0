"""Which recorded runs calibrate `batchrun plan`, and the range it states
(batch/estimate/confidence.py)."""

import pytest

from batchrun.batch.estimate import confidence


def run(ok, steps=None, wall=40.0):
    engine = {} if steps is None else {"engine": {"steps": steps}}
    return {"summary": {"requests": {"total": ok, "ok": ok, "failed": 0}, "wall_time_s": wall,
                        **engine}}


def test_a_run_too_small_to_mean_anything_does_not_calibrate():
    assert confidence.too_small(run(1, 8)["summary"]) == "1 request, 8 engine steps"
    assert confidence.too_small(run(30, 20)["summary"]) == "30 requests, 20 engine steps"
    assert confidence.too_small(run(confidence.MIN_REQUESTS - 1)["summary"]) is not None
    assert confidence.too_small(run(30, 129)["summary"]) is None
    assert confidence.too_small(run(confidence.MIN_REQUESTS)["summary"]) is None  # no steps kept


def test_the_newest_big_run_calibrates_and_a_small_newer_one_is_named():
    big_old, big, small = run(160, 500, wall=100.0), run(30, 129), run(1, 8)
    usable, why = confidence.calibrating_runs([small, big, big_old])
    assert usable == [big, big_old]
    assert why == "the last run (1 request, 8 engine steps) is too small to calibrate"
    assert confidence.calibrating_runs([big, small]) == ([big], None)
    assert confidence.calibrating_runs([]) == ([], None)


def test_the_range_holds_every_runs_estimate_widened_by_the_machines_load():
    one = confidence.from_runs([40.0])
    assert (one.low, one.high) == pytest.approx((40 / confidence.RUN_MARGIN,
                                                 40 * confidence.RUN_MARGIN))
    assert one.confidence == "medium" and "1 run" in one.basis
    apart = confidence.from_runs([40.0, 80.0, 50.0])
    assert apart.low == pytest.approx(40 / confidence.RUN_MARGIN)
    assert apart.high == pytest.approx(80 * confidence.RUN_MARGIN)
    assert apart.confidence == "medium" and "differing by 100%" in apart.basis
    close = confidence.from_runs([40.0, 42.0, 44.0])
    assert close.confidence == "high" and "3 runs" in close.basis


def test_the_benchmark_alone_is_low_confidence_and_wide():
    got = confidence.from_benchmark(10.0, "no run of m on this machine yet")
    assert got.confidence == "low" and "no run of m" in got.basis
    assert got.low <= 3.5 and got.high >= 44.0  # the measured 0.35x-4.4x of it fits inside
