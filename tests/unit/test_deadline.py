"""--deadline on a file job: what is done stays, every unfinished line gets OpenAI's
batch_expired error line, exit code 4, and --resume runs only the expired lines."""

import json
import logging
import re

import pytest

from batchrun.batch.job.runner import run_batch
from batchrun.options.durations import parse_deadline, parse_duration
from tests.fake_engine import FakeEngine, fake_model
from tests.openai_batch_shape import check_line
from tests.unit.test_batch_resume import STAGING, config, read, request, write_input

N = 40
LINES = [request(f"r{i}", max_tokens=8) for i in range(N)]


@pytest.mark.parametrize("text, seconds", [("24h", 86400), ("30m", 1800), ("1h30m", 5400),
                                           ("90s", 90), ("2d", 172800), ("0.5s", 0.5),
                                           ("15", 15)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_deadlines_are_durations_or_timestamps():
    assert parse_deadline("1h", 1000.0) == 4600.0
    assert parse_deadline("2026-01-01T00:00:00Z", 0.0) == 1767225600.0
    for bad in ("soon", "-5m", "0s", "1x"):
        with pytest.raises(ValueError):
            parse_deadline(bad, 0.0)


def expire_a_run(tmp_path):
    src = write_input(tmp_path, LINES)
    # 24 quick steps finish some lines; then a step takes 1 s, so the 2 s deadline passes with
    # most lines not done, however loaded the machine.
    engine = FakeEngine(slow_after=24, slow_step_s=1.0)
    result = run_batch(fake_model(engine), config(tmp_path, src, max_in_flight=4,
                                                  deadline="2s", commit_every=4))
    return src, result


def test_the_deadline_expires_what_is_not_done_and_resume_runs_only_that(tmp_path, caplog):
    src, result = expire_a_run(tmp_path)
    assert result.status == "expired"
    ok = read(tmp_path / "out.jsonl")
    errors = read(tmp_path / "out.errors.jsonl")
    for record in ok + errors:
        check_line(record)
    expired = [e for e in errors if (e["error"] or {}).get("code") == "batch_expired"]
    assert 0 < len(ok) < N and len(expired) == N - len(ok) == result.summary["expired"]
    assert sorted([r["custom_id"] for r in ok + expired], key=lambda c: int(c[1:])) == \
        [f"r{i}" for i in range(N)]
    line = expired[0]  # OpenAI's shape: no response, the error alone
    assert set(line) == {"id", "custom_id", "response", "error"} and line["response"] is None
    assert set(line["error"]) == {"code", "message"} and "deadline" in line["error"]["message"]
    metrics = json.loads((tmp_path / "out.metrics.json").read_text())
    assert metrics["status"] == "expired" and metrics["expired"] == len(expired)
    assert metrics["expired_at"] >= metrics["deadline"]
    assert (tmp_path / STAGING).exists()  # kept: --resume runs the expired lines

    engine = FakeEngine()
    with caplog.at_level(logging.INFO, logger="batchrun.batch"):
        again = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert again.status == "completed"
    assert len(engine.added) == len(expired)
    # the expired lines are committed, but not as done: the resume message tells them apart
    assert f"resuming: {len(ok)} lines already have a committed record in " in caplog.text
    assert f"; {len(expired)} lines expired at a deadline run again" in caplog.text
    assert [r["custom_id"] for r in read(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(N)]
    assert not [e for e in read(tmp_path / "out.errors.jsonl")
                if (e["error"] or {}).get("code") == "batch_expired"]
    assert not (tmp_path / STAGING).exists()


def test_the_cli_exit_code_is_4_and_a_passed_deadline_is_a_usage_error(tmp_path, monkeypatch,
                                                                        capsys, caplog):
    from batchrun.batch.shell.launch import execute
    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.run import RunOptions
    from batchrun.commandkit import UsageError
    from tests.fake_engine import load

    src = write_input(tmp_path, LINES)
    monkeypatch.setenv("BATCHRUN_FAKE_STEP_S", "0.02")

    def opts(deadline, **job):
        job = {"progress": "none", **job}
        return RunOptions(inputs=InputOptions(input=[str(src)]), job=JobOptions(
            output=str(tmp_path / "out.jsonl"), max_in_flight=4, deadline=deadline, **job))
    with pytest.raises(UsageError, match="has already passed"):
        execute(opts("2020-01-01T00:00:00Z"), load)
    with caplog.at_level(logging.INFO, logger="batchrun.progress"):
        assert execute(opts("0.4s", progress="log", log_interval=3600), load) == 4
    # The progress line counts the lines as the deadline's message does: expired ones apart.
    said = re.search(r"deadline passed: (\d+) lines ok and (\d+) failed are in the output; "
                     r"(\d+) lines not done got a batch_expired error line",
                     capsys.readouterr().err)
    final = [r.getMessage() for r in caplog.records if r.name == "batchrun.progress"][-1]
    ok, failed, expired = said.groups()
    assert int(expired) > 0 and f"{ok} ok, {failed} failed, {expired} expired" in final, final
    monkeypatch.setenv("BATCHRUN_FAKE_STEP_S", "0")
    assert execute(opts("1h", resume=True), load) == 0
    assert len(read(tmp_path / "out.jsonl")) == N
