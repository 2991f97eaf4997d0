"""Stop, crash, resume, retry and duplicates, in-process on the fake engine."""

import json
import threading

import pytest

from batchrun.batch.job.lease import OutputLease
from batchrun.batch.job.loop import StopRequest
from batchrun.batch.job.runner import BatchConfigError, run_batch
from batchrun.batch.job.result import RequestCounts
from batchrun.batch.job.staging import Staging
from tests.helpers import job_plan
from tests.fake_engine import FakeEngine, fake_model
from tests.openai_batch_shape import error_of


def request(custom_id, content="Hello", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], **body}})


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def write_input(tmp_path, lines):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def config(tmp_path, src, **options):
    options.setdefault("progress", "none")
    options.setdefault("commit_every", 5)
    return job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), **options)


def stop_after_commits(n, stop):
    calls = []

    def on_progress(counts):
        calls.append(counts)
        if len(calls) == n:
            stop.set()
    return on_progress


LINES = [request(f"r{i}", max_tokens=1 + (i * 7) % 9) for i in range(60)]
STAGING = "out.jsonl.batchrun-staging"


def test_stop_then_resume_gives_every_line_exactly_once(tmp_path):
    src = write_input(tmp_path, LINES)
    stop = StopRequest()
    first = FakeEngine()
    result = run_batch(fake_model(first), config(tmp_path, src, max_in_flight=8, grace_period=0),
                       stop=stop, on_progress=stop_after_commits(2, stop))
    assert result.status == "interrupted"
    assert not (tmp_path / "out.jsonl").exists() and (tmp_path / STAGING).exists()
    assert first.aborted  # in-flight requests were dropped, not committed
    done_first = result.requests.total
    assert 0 < done_first < 60

    with pytest.raises(BatchConfigError, match="--resume"):
        run_batch(fake_model(), config(tmp_path, src))

    second = FakeEngine()
    result = run_batch(fake_model(second), config(tmp_path, src, resume=True))
    assert result.status == "completed"
    assert result.summary["resumed"] == done_first
    assert len(second.added) == 60 - done_first
    out = read(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(60)]
    assert result.requests == RequestCounts(60, 60, 0)
    assert not (tmp_path / STAGING).exists()


def test_graceful_stop_lets_in_flight_requests_finish(tmp_path):
    src = write_input(tmp_path, LINES)
    stop = StopRequest()
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, max_in_flight=8,
                                                  grace_period=60),
                       stop=stop, on_progress=stop_after_commits(1, stop))
    assert result.status == "interrupted"
    assert engine.aborted == [] and not engine.running
    assert result.requests.total == len(engine.added)


def test_a_threading_event_cancels_and_merge_on_stop_writes_what_is_done(tmp_path):
    src = write_input(tmp_path, LINES)
    cancel = threading.Event()
    counts = []

    def on_progress(c):
        counts.append(c)
        if len(counts) == 2:
            cancel.set()
    result = run_batch(fake_model(), config(tmp_path, src, grace_period=0, merge_on_stop=True),
                       stop=cancel, on_progress=on_progress)
    assert result.status == "interrupted"
    out = read(tmp_path / "out.jsonl")
    assert 0 < len(out) == result.requests.ok < 60
    ids = [o["custom_id"] for o in out]
    assert ids == sorted(ids, key=lambda c: int(c[1:]))  # input order
    assert not (tmp_path / STAGING).exists()
    assert counts[-1].completed == len(out) and counts[0].total == 60


def test_restart_discards_what_was_committed(tmp_path):
    src = write_input(tmp_path, LINES)
    stop = StopRequest()
    run_batch(fake_model(), config(tmp_path, src, grace_period=0), stop=stop,
              on_progress=stop_after_commits(1, stop))
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, restart=True))
    assert result.summary["resumed"] == 0 and len(engine.added) == 60


def test_resume_over_a_shrunk_input_keeps_no_record_past_its_end(tmp_path):
    src = write_input(tmp_path, LINES)
    stop = StopRequest()
    first = run_batch(fake_model(), config(tmp_path, src, grace_period=0, commit_every=1),
                      stop=stop, on_progress=stop_after_commits(45, stop))
    assert first.requests.total > 30  # some committed lines lie past the new end
    src.write_text("\n".join(LINES[:30]) + "\n")
    result = run_batch(fake_model(), config(tmp_path, src, resume=True))
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(30)]
    assert result.requests.total == 30


def interrupted_run(tmp_path, lines, n_commits=3):
    """A run stopped after a few commits (one record each); returns the committed custom_ids."""
    src = write_input(tmp_path, lines)
    stop = StopRequest()
    run_batch(fake_model(), config(tmp_path, src, grace_period=0, commit_every=1),
              stop=stop, on_progress=stop_after_commits(n_commits, stop))
    staging = Staging(str(tmp_path / STAGING))
    committed = [json.loads(line.split(" ", 2)[2])["custom_id"] for name in staging.parts()
                 for line in (tmp_path / STAGING / name).read_text().splitlines()[1:]]
    return src, committed


def test_a_line_edited_in_place_is_run_again_on_resume(tmp_path):
    src, committed = interrupted_run(tmp_path, LINES)
    victim = int(committed[0][1:])
    lines = list(LINES)
    # Same custom_id and byte length: only the content tells the two apart.
    lines[victim] = lines[victim].replace('"Hello"', '"Howdy"')
    assert len(lines[victim]) == len(LINES[victim])
    src.write_text("\n".join(lines) + "\n")
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    rerun = {rid for rid, _, _ in engine.added}
    assert len(rerun) == 60 - len(committed) + 1  # the uncommitted lines and the edited one
    out = {o["custom_id"]: o for o in read(tmp_path / "out.jsonl")}
    assert len(out) == 60 and result.requests.total == 60
    howdy = [ord(c) % 256 for c in "user:Howdy\nassistant:"]
    assert [p for _, p, _ in engine.added if p == howdy]  # the new content ran
    assert result.summary["resumed"] == len(committed) - 1


def test_on_changed_input_fail_refuses_naming_the_line(tmp_path):
    from batchrun.batch.job.loop import ChangedInputError

    src, committed = interrupted_run(tmp_path, LINES)
    victim = int(committed[0][1:])
    lines = list(LINES)
    lines[victim] = lines[victim].replace('"Hello"', '"Howdy"')
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(ChangedInputError, match=f"line {victim + 1} changed"):
        run_batch(fake_model(), config(tmp_path, src, resume=True, on_changed_input="fail"))
    assert (tmp_path / STAGING).exists()  # nothing committed is lost


def test_resume_without_staging_starts_afresh(tmp_path):
    src = write_input(tmp_path, LINES[:5])
    result = run_batch(fake_model(), config(tmp_path, src, resume=True))
    assert result.status == "completed" and len(read(tmp_path / "out.jsonl")) == 5


def test_engine_crash_keeps_what_finished_and_resume_completes(tmp_path):
    src = write_input(tmp_path, LINES)
    crashing = FakeEngine(fail_on_step=12)
    with pytest.raises(RuntimeError, match="blew up"):
        run_batch(fake_model(crashing), config(tmp_path, src, max_in_flight=8))
    assert crashing.aborted and not crashing.running
    committed = Staging(str(tmp_path / STAGING)).scan().count
    assert committed > 0
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert result.summary["resumed"] == committed and len(engine.added) == 60 - committed
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(60)]


def test_crash_after_the_output_was_published_resumes_to_the_same_files(tmp_path, monkeypatch):
    src = write_input(tmp_path, LINES[:10] + ["not json"])

    remove = Staging.remove

    def boom(self):
        if (tmp_path / "out.jsonl").exists():
            raise OSError("disk went away")
        remove(self)
    monkeypatch.setattr(Staging, "remove", boom)
    with pytest.raises(OSError):
        run_batch(fake_model(), config(tmp_path, src))
    first = read(tmp_path / "out.jsonl")
    monkeypatch.undo()
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert engine.added == [] and result.summary["already_completed"]
    assert read(tmp_path / "out.jsonl") == first and not (tmp_path / STAGING).exists()
    assert len(read(tmp_path / "out.errors.jsonl")) == 1


class HealedEngine(FakeEngine):
    """The KV pool is big enough now: KVFAIL requests succeed."""

    def step(self):
        outs = super().step()
        for o in outs:
            o.error = None
        return outs


def commit_all_then_crash(tmp_path, src, monkeypatch):
    """A run whose every line is committed but that dies before the merge."""
    import batchrun.batch.job.runner as runner

    def crash(*args):
        raise RuntimeError("killed before the merge")
    monkeypatch.setattr(runner, "_finalize", crash)
    with pytest.raises(RuntimeError, match="before the merge"):
        run_batch(fake_model(), config(tmp_path, src))
    monkeypatch.undo()


def test_retry_failed_reruns_only_retryable_errors(tmp_path, monkeypatch):
    lines = [request("a", max_tokens=1), request("kv", content="KVFAIL", max_tokens=1),
             request("hot", temperature=9), request("b", max_tokens=2)]
    src = write_input(tmp_path, lines)
    commit_all_then_crash(tmp_path, src, monkeypatch)
    engine = HealedEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert engine.added == [] and result.requests.failed == 2

    # Same again, now with --retry-failed: the engine error is retried, the 400 is not.
    commit_all_then_crash(tmp_path, src, monkeypatch)
    engine = HealedEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True, retry_failed=True))
    assert len(engine.added) == 1
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == ["a", "kv", "b"]
    errors = read(tmp_path / "out.errors.jsonl")
    assert [e["custom_id"] for e in errors] == ["hot"]
    assert result.requests == RequestCounts(4, 3, 1)


def test_a_stop_after_the_last_line_was_read_and_finished_completes_the_job(tmp_path):
    src = write_input(tmp_path, LINES[:4])
    stop = StopRequest()
    result = run_batch(fake_model(), config(tmp_path, src, commit_every=1, grace_period=60),
                       stop=stop, on_progress=stop_after_commits(1, stop))
    assert result.status == "completed" and len(read(tmp_path / "out.jsonl")) == 4


def test_duplicate_custom_ids_are_line_errors_and_the_first_line_owns_the_id(tmp_path):
    lines = [request("a", max_tokens=1), request("b", temperature=9), request("a", max_tokens=1),
             request("b", max_tokens=1), request("c", max_tokens=1), request("a", max_tokens=1)]
    src = write_input(tmp_path, lines)
    run_batch(fake_model(), config(tmp_path, src))
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == ["a", "c"]
    errors = read(tmp_path / "out.errors.jsonl")
    assert [(error_of(e)["line"], error_of(e)["code"]) for e in errors] == [
        (2, "invalid_value"), (3, "duplicate_custom_id"), (4, "duplicate_custom_id"),
        (6, "duplicate_custom_id")]
    assert errors[1]["custom_id"] == "a" and errors[1]["response"]["status_code"] == 400
    assert "already used by an earlier line" in error_of(errors[1])["message"]


def test_several_inputs_are_one_job_and_errors_name_their_file(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "1.jsonl").write_text(request("a", max_tokens=1) + "\nbad\n")
    (tmp_path / "in" / "2.jsonl").write_text(request("a", max_tokens=1) + "\n"
                                             + request("b", max_tokens=3) + "\n")
    cfg = job_plan(input=[str(tmp_path / "in")], output=str(tmp_path / "out.jsonl"),
                    progress="none")
    result = run_batch(fake_model(), cfg)
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == ["a", "b"]
    errors = read(tmp_path / "out.errors.jsonl")
    assert [error_of(e)["line"] for e in errors] == [2, 1]
    assert error_of(errors[0])["message"].startswith(str(tmp_path / "in" / "1.jsonl") + ": line 2")
    assert error_of(errors[1])["code"] == "duplicate_custom_id"
    assert result.requests == RequestCounts(4, 2, 2)


def test_parts_are_bounded_by_commit_every(tmp_path):
    src = write_input(tmp_path, LINES)
    stop = StopRequest()
    run_batch(fake_model(), config(tmp_path, src, commit_every=7, commit_interval=1e9), stop=stop,
              on_progress=stop_after_commits(5, stop))
    for part in (tmp_path / STAGING).glob("part-*.jsonl"):
        assert len(part.read_text().splitlines()) - 1 <= 7


def test_empty_input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    result = run_batch(fake_model(), config(tmp_path, src))
    assert result.requests == RequestCounts(0, 0, 0)
    assert (tmp_path / "out.jsonl").read_text() == ""
    assert (tmp_path / "out.errors.jsonl").read_text() == ""


def test_resuming_a_completed_job_does_nothing_until_its_input_changes(tmp_path):
    src = write_input(tmp_path, LINES[:6])
    first = run_batch(fake_model(), config(tmp_path, src, resume=True))
    assert first.status == "completed" and "already_completed" not in first.summary
    engine = FakeEngine()
    again = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert engine.added == [] and again.summary["already_completed"] is True
    assert again.requests == first.requests

    src.write_text("\n".join(LINES[:7]) + "\n")  # new input: the job runs again
    engine = FakeEngine()
    third = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert len(engine.added) == 7 and "already_completed" not in third.summary
    engine = FakeEngine()
    run_batch(fake_model(engine), config(tmp_path, src, restart=True))
    assert len(engine.added) == 7


def test_killed_while_removing_staging_after_completing(tmp_path, monkeypatch):
    src = write_input(tmp_path, LINES[:8])
    remove = Staging.remove

    def half_removed(self):
        parts = sorted((tmp_path / STAGING).glob("part-*"))
        if parts and (tmp_path / "out.metrics.json").exists():
            parts[0].unlink()  # rmtree got this far
            raise KeyboardInterrupt
        remove(self)
    monkeypatch.setattr(Staging, "remove", half_removed)
    with pytest.raises(KeyboardInterrupt):
        run_batch(fake_model(), config(tmp_path, src, commit_every=3))
    monkeypatch.undo()
    first = read(tmp_path / "out.jsonl")
    assert len(first) == 8 and (tmp_path / STAGING).exists()
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert result.summary["already_completed"] and engine.added == []
    assert read(tmp_path / "out.jsonl") == first and not (tmp_path / STAGING).exists()


def test_a_fresh_run_drops_the_old_completion_marker(tmp_path):
    src = write_input(tmp_path, LINES[:8])
    run_batch(fake_model(), config(tmp_path, src))
    stop = StopRequest()
    run_batch(fake_model(), config(tmp_path, src, restart=True, max_in_flight=2, grace_period=0),
              stop=stop, on_progress=stop_after_commits(1, stop))
    assert json.loads((tmp_path / "out.metrics.json").read_text())["status"] == "interrupted"
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert "already_completed" not in result.summary and 0 < len(engine.added) < 8


def test_one_run_at_a_time_per_output(tmp_path):
    src = write_input(tmp_path, LINES[:4])
    other = OutputLease(str(tmp_path / "out.jsonl")).acquire()  # another run writes it
    with pytest.raises(BatchConfigError, match="another batchrun run"):
        run_batch(fake_model(), config(tmp_path, src, resume=True))
    with pytest.raises(BatchConfigError, match="another batchrun run"):
        config(tmp_path, src, resume=True)
    other.release()
    result = run_batch(fake_model(), config(tmp_path, src, resume=True))
    assert result.status == "completed" and not (tmp_path / STAGING).exists()
    assert not (tmp_path / ".out.jsonl.batchrun-lease").exists()  # released at the end
