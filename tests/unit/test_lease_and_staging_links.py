"""The files a run keeps beside its output are never followed through symbolic links (the lease,
the staging folder and its parts), a lease's values are checked before they are trusted, and
--lease-ttl is bounded. On the fake engine: no model."""

import json
import logging
import math
import os
import time

import pytest
from click.testing import CliRunner

from batchrun.batch.job.lease import Holder, OutputLease, lease_url
from batchrun.batch.job.staging import Staging, StagingError
from batchrun.batch.storage import io
from batchrun.batch.storage.conditional import conditional_object
from batchrun.cli import main
from tests.fake_engine import load

LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "m", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}})


def run(*args):
    return CliRunner().invoke(main, ["run", *map(str, args), "--progress", "none"],
                              obj={"load_model": load})


@pytest.fixture
def job(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(LINE + "\n")
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    return src, tmp_path / "out.jsonl", victim


def test_a_lease_that_is_a_link_is_refused_and_its_target_untouched(job):
    src, out, victim = job
    os.symlink(victim, lease_url(str(out)))
    result = run(src, "-o", out)
    assert result.exit_code == 2, result.output
    assert "is a symbolic link" in result.output and "batchrun-lease" in result.output
    assert victim.read_text() == "keep me\n" and not out.exists()
    with pytest.raises(io.LinkRefused):  # the library refuses it too
        OutputLease(str(out)).acquire()
    assert victim.read_text() == "keep me\n"


@pytest.mark.parametrize("link", ["folder", "part"])
def test_a_staging_folder_or_part_that_is_a_link_is_refused(job, tmp_path, link):
    src, out, victim = job
    staging = tmp_path / "out.jsonl.batchrun-staging"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine\n")
    if link == "folder":  # a --restart would empty the folder it points to
        os.symlink(elsewhere, staging)
    else:
        staging.mkdir()
        os.symlink(victim, staging / "part-00001-000001.jsonl")
    result = run(src, "-o", out, "--restart")
    assert result.exit_code == 2, result.output
    assert "symbolic link" in result.output
    assert (elsewhere / "keep.txt").read_text() == "mine\n"
    assert victim.read_text() == "keep me\n"


def test_staging_files_are_created_and_read_without_following_links(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    staging = Staging(str(tmp_path / "staging"))
    os.makedirs(staging.root)
    os.symlink(victim, os.path.join(staging.root, "merge-01-00000.jsonl"))
    with pytest.raises(FileExistsError):
        staging._create("merge-01-00000.jsonl")
    with pytest.raises(io.LinkRefused):
        staging._open("merge-01-00000.jsonl")
    with pytest.raises(StagingError, match="symbolic link"):
        staging.parts()
    assert victim.read_text() == "keep me\n"


def lease_with(**values) -> bytes:
    now = time.time()
    lease = {"owner": "x", "pid": 4242, "host": "elsewhere", "machine": "other",
             "started": now - 10, "heartbeat": now, "ttl": 60.0, **values}
    return json.dumps(lease).encode()  # json writes NaN / Infinity as Python reads them


@pytest.mark.parametrize("values, why", [
    ({"heartbeat": math.nan}, "heartbeat nan is not a time"),
    ({"heartbeat": math.inf}, "heartbeat inf is not a time"),
    ({"heartbeat": time.time() + 3600}, "s in the future"),
    ({"ttl": 1e300}, "TTL 1e+300 s is outside"),
    ({"ttl": math.inf}, "TTL inf s is outside"),
    ({"ttl": -5}, "TTL -5 s is outside"),
    ({"pid": -1}, "pid -1 is not a process id"),
    ({"pid": 10**30}, "pid 1000000000000000000000000000000 is not a process id")])
def test_a_lease_with_values_no_live_run_writes_is_taken_over_with_a_warning(
        tmp_path, caplog, values, why):
    output = str(tmp_path / "out.jsonl")
    conditional_object(lease_url(output)).create(lease_with(**values))
    with caplog.at_level(logging.WARNING, logger="batchrun.batch"):
        OutputLease(output).acquire().release()
    assert "taking over the lease" in caplog.text and why in caplog.text, caplog.text


def test_a_sound_live_lease_is_still_respected(tmp_path):
    holder = Holder.parse(lease_with(heartbeat=time.time() + 2))  # a clock slightly ahead
    assert holder is not None and holder.stale_reason(60) is None


@pytest.mark.parametrize("ttl", ["0.001", "0", "1e9", "inf", "nan"])
def test_lease_ttl_outside_its_range_is_a_usage_error(job, ttl):
    src, out, _ = job
    result = run(src, "-o", out, "--lease-ttl", ttl)
    assert result.exit_code == 2 and "--lease-ttl" in result.output, result.output
    assert not out.exists()
