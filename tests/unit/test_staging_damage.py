"""Damaged staging: a committed part truncated, bit-flipped, missing or garbage, a garbage
manifest, damage found while merging, a merge short of records. Never a published output with
a line that is not JSON, never exit 0 with records missing; a warning names the file."""

import json
import logging

import pytest

from batchrun.batch.job.loop import StopRequest
from batchrun.batch.job.runner import run_batch
from batchrun.batch.job.staging import DamagedStagingError, Staging
from tests.fake_engine import FakeEngine, fake_model
from tests.unit.test_batch_resume import (LINES, STAGING, config, read, stop_after_commits,
                                          write_input)

N = 30


def interrupted(tmp_path):
    """An interrupted run over N lines with a few committed parts: (src, parts, committed)."""
    src = write_input(tmp_path, LINES[:N])
    stop = StopRequest()
    result = run_batch(fake_model(), config(tmp_path, src, max_in_flight=4, grace_period=0,
                                            commit_every=3),
                       stop=stop, on_progress=stop_after_commits(4, stop))
    assert result.status == "interrupted"
    parts = sorted((tmp_path / STAGING).glob("part-*.jsonl"))
    assert len(parts) >= 3
    return src, parts, result.requests.total


def records_in(part):
    return len(json.loads(part.read_bytes().split(b"\n", 1)[0])["positions"])


def resume_and_check(tmp_path, src, reran_expected, caplog, named=None):
    engine = FakeEngine()
    with caplog.at_level(logging.WARNING, logger="batchrun.batch"):
        result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert result.status == "completed"
    out = read(tmp_path / "out.jsonl")  # every line parses
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(N)]
    assert len(engine.added) == reran_expected
    assert not (tmp_path / STAGING).exists()
    if named is not None:
        assert named in caplog.text
    return result


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_truncated_part_is_discarded_and_its_lines_run_again(tmp_path, caplog):
    src, parts, done = interrupted(tmp_path)
    part = parts[1]
    lost = records_in(part)
    part.write_bytes(part.read_bytes()[:-40])
    resume_and_check(tmp_path, src, N - done + lost, caplog, named=str(part))
    assert "is damaged" in caplog.text and "run again" in caplog.text


@pytest.mark.parametrize("where", ["body", "header"])
def test_a_bit_flip_is_caught(tmp_path, caplog, where):
    src, parts, done = interrupted(tmp_path)
    part = parts[0]
    lost = records_in(part)
    header_len = part.read_bytes().index(b"\n")
    # In the body: a byte inside a record's JSON; in the header: a digit of a position.
    offset = part.read_bytes().rindex(b"echo") + 1 if where == "body" else \
        part.read_bytes().index(b"positions") + 14
    assert (offset > header_len) == (where == "body")
    flip(part, offset)
    resume_and_check(tmp_path, src, N - done + lost, caplog, named=str(part))


def test_a_missing_part_means_its_lines_run_again(tmp_path, caplog):
    src, parts, done = interrupted(tmp_path)
    lost = records_in(parts[-1])
    parts[-1].unlink()
    resume_and_check(tmp_path, src, N - done + lost, caplog)


def test_a_garbage_part_is_discarded_naming_it(tmp_path, caplog):
    src, parts, done = interrupted(tmp_path)
    garbage = tmp_path / STAGING / "part-00001-000999.jsonl"
    garbage.write_bytes(b"\x00\xff not a part\n1 1 {}\n")
    resume_and_check(tmp_path, src, N - done, caplog, named=str(garbage))


def test_a_garbage_manifest_is_rewritten_and_the_parts_still_count(tmp_path, caplog):
    src, parts, done = interrupted(tmp_path)
    (tmp_path / STAGING / "manifest.json").write_bytes(b"{garbage")
    resume_and_check(tmp_path, src, N - done, caplog, named="manifest.json is damaged")


def test_a_missing_manifest_still_resumes(tmp_path, caplog):
    src, parts, done = interrupted(tmp_path)
    (tmp_path / STAGING / "manifest.json").unlink()
    resume_and_check(tmp_path, src, N - done, caplog, named="manifest.json is missing")


def test_damage_found_while_merging_publishes_nothing(tmp_path, monkeypatch, caplog):
    src = write_input(tmp_path, LINES[:N])
    original = Staging.merge

    def damaged_then_merge(self, *args, **kwargs):
        part = sorted((tmp_path / STAGING).glob("part-*.jsonl"))[0]
        part.write_bytes(part.read_bytes()[:-40])
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Staging, "merge", damaged_then_merge)
    with pytest.raises(DamagedStagingError, match="rerun with --resume"):
        run_batch(fake_model(), config(tmp_path, src, commit_every=4))
    monkeypatch.undo()
    assert not (tmp_path / "out.jsonl").exists()
    engine = FakeEngine()
    result = run_batch(fake_model(engine), config(tmp_path, src, resume=True))
    assert result.status == "completed" and 0 < len(engine.added) <= 4
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(N)]


def test_a_merge_short_of_records_is_exit_1_with_the_counts(tmp_path, monkeypatch, capsys):
    from batchrun.batch.shell.launch import execute
    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.run import RunOptions
    from tests.fake_engine import load

    src = write_input(tmp_path, LINES[:N])
    original = Staging.merge

    def loses_one(self, write_ok, write_error, last_lines=None):
        seen = []

        def keep(text):
            seen.append(text)
            if len(seen) != 5:
                write_ok(text)
        counts = original(self, keep, write_error, last_lines)
        counts[1] -= 1
        return counts
    monkeypatch.setattr(Staging, "merge", loses_one)
    opts = RunOptions(inputs=InputOptions(input=[str(src)]),
                      job=JobOptions(output=str(tmp_path / "out.jsonl"), progress="none"))
    assert execute(opts, load) == 1
    err = capsys.readouterr().err
    assert f"has {N - 1} records for {N} input lines" in err
    assert (tmp_path / STAGING).exists()  # kept: a resume merges again
    assert json.loads((tmp_path / "out.metrics.json").read_text())["status"] == "incomplete"
