"""summary_text: the paragraph a run prints at its end."""

from batchrun.batch.job.metrics import RunMetrics, summary_text


def _summary(ok, failed, resumed, job_ok, job_failed, wall=120.0):
    m = RunMetrics()
    m.ok, m.failed, m.prompt_tokens, m.completion_tokens = ok, failed, 2600, 1300
    result = m.summary()
    result.update(wall_time_s=wall, requests_per_s=(ok + failed) / wall,
                  output_tokens_per_s=1300 / wall, total_tokens_per_s=3900 / wall)
    result["requests"] = {"total": job_ok + job_failed, "ok": job_ok, "failed": job_failed}
    result["resumed"] = resumed
    result["this_run"] = {"ok": ok, "failed": failed}
    return result


def test_a_resumed_run_says_what_this_run_did():
    text = summary_text(_summary(ok=12, failed=1, resumed=17, job_ok=28, job_failed=2))
    assert text.startswith("13 requests this run (12 ok, 1 failed; +17 committed earlier, 30 in "
                           "the job) in 120.0 s: 0.11 req/s, 10.8 output tok/s")
    assert "30 requests (" not in text
    assert "\n" not in text and text.endswith(".")


def test_rates_are_over_this_runs_requests_even_if_the_dict_has_whole_job_ones():
    result = _summary(ok=13, failed=0, resumed=17, job_ok=30, job_failed=0, wall=10.0)
    result["requests_per_s"] = 3.0  # as if computed over the whole job
    assert "13 requests this run" in summary_text(result)
    assert ": 1.30 req/s" in summary_text(result)


def test_a_fresh_run_keeps_the_plain_wording():
    text = summary_text(_summary(ok=29, failed=1, resumed=0, job_ok=29, job_failed=1))
    assert text.startswith("30 requests (29 ok, 1 failed) in 120.0 s: 0.25 req/s")
    assert "this run" not in text and "earlier" not in text
