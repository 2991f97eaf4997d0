"""The output's lease: one holder at a time on local files and on S3 (moto), taken over only
when stale, lost by a run that stalled past its TTL."""

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

from batchrun.batch.job.lease import (Holder, LeaseLostError, OutputBusyError, OutputLease,
                                      current_holder, lease_url)
from batchrun.batch.storage.conditional import conditional_object


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def foreign_lease(pid, heartbeat_age, machine="elsewhere", ttl=60.0):
    now = time.time()
    return json.dumps({"owner": "x", "pid": pid, "host": "other-host", "machine": machine,
                       "started": now - 1000, "heartbeat": now - heartbeat_age,
                       "ttl": ttl}).encode()


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from tests.moto_s3 import moto_s3

    with moto_s3() as served:
        yield served


def test_lease_url_is_a_hidden_sibling():
    assert lease_url("s3://b/dir/out.jsonl") == "s3://b/dir/.out.jsonl.batchrun-lease"
    assert lease_url("out.jsonl") == ".out.jsonl.batchrun-lease"


def _output_on(store: str, tmp_path, request) -> tuple[str, dict | None]:
    """An output URL on `store` unique to the test, and its storage options."""
    if store == "s3":
        _, options = request.getfixturevalue("s3")
        return f"s3://bkt/{tmp_path.name}/out.jsonl", options
    return str(tmp_path / "out.jsonl"), None


@pytest.mark.parametrize("store", ["local", "s3"])
def test_one_holder_then_the_next(store, tmp_path, request):
    output, options = _output_on(store, tmp_path, request)
    first = OutputLease(output, options).acquire()
    with pytest.raises(OutputBusyError, match=r"another batchrun run is writing .*pid"):
        OutputLease(output, options).acquire()
    assert current_holder(output, options).owner == first.owner
    first.renew()
    first.check()
    first.release()
    assert current_holder(output, options) is None
    second = OutputLease(output, options).acquire()
    second.release()


@pytest.mark.parametrize("store", ["local", "s3"])
def test_racing_acquirers_get_it_once(store, tmp_path, request):
    output, options = _output_on(store, tmp_path, request)
    won, refused = [], []
    barrier = threading.Barrier(8)

    def contend():
        lease = OutputLease(output, options)
        barrier.wait()
        try:
            won.append(lease.acquire())
        except OutputBusyError:
            refused.append(lease)
    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    won[0].release()


def test_a_dead_process_lease_is_taken_over_at_once(tmp_path, caplog):
    output = str(tmp_path / "out.jsonl")
    from batchrun.batch.job.lease import _machine

    conditional_object(lease_url(output)).create(foreign_lease(dead_pid(), 1, _machine()))
    with caplog.at_level(logging.WARNING, logger="batchrun.batch"):
        lease = OutputLease(output).acquire()
    assert "taking over the lease" in caplog.text and "is gone" in caplog.text
    lease.release()


def test_a_live_lease_elsewhere_waits_for_its_ttl(tmp_path, caplog):
    output = str(tmp_path / "out.jsonl")
    store = conditional_object(lease_url(output))
    store.create(foreign_lease(123, heartbeat_age=5, ttl=10))
    with pytest.raises(OutputBusyError, match="taken over after 10 s"):
        OutputLease(output, ttl=10).acquire()
    found = store.read()
    store.replace(foreign_lease(123, heartbeat_age=11, ttl=10), found.token)
    with caplog.at_level(logging.WARNING, logger="batchrun.batch"):
        OutputLease(output, ttl=10).acquire().release()
    assert "its last heartbeat was 11 s ago (TTL 10 s)" in caplog.text


def test_an_unreadable_lease_is_taken_over_with_a_warning(tmp_path, caplog):
    output = str(tmp_path / "out.jsonl")
    conditional_object(lease_url(output)).create(b"\x00garbage")
    with caplog.at_level(logging.WARNING, logger="batchrun.batch"):
        OutputLease(output).acquire().release()
    assert "not a batchrun lease" in caplog.text


def test_a_run_whose_lease_was_taken_over_stops(tmp_path):
    output = str(tmp_path / "out.jsonl")
    stalled = OutputLease(output, ttl=0.5).acquire()
    stalled._stop.set()  # its heartbeat stalls (a paused VM, a swapped-out process)
    stalled._thread.join()
    time.sleep(0.6)
    holder = Holder.parse(conditional_object(lease_url(output)).read().data)
    assert holder.stale_reason(0.5) is not None
    taker = OutputLease(output, ttl=0.5)
    # Not stale by PID (this process lives): by age only, as another machine would see it.
    taker_store = taker.store
    found = taker_store.read()
    taker.token = taker_store.replace(foreign_lease(1, 0), found.token)
    stalled.renew()
    with pytest.raises(LeaseLostError, match="another run owns it now"):
        stalled.check()
    stalled.release()  # does not delete the new holder's lease
    assert conditional_object(lease_url(output)).read() is not None


def test_heartbeats_keep_a_long_run_fresh(tmp_path):
    output = str(tmp_path / "out.jsonl")
    # a TTL of seconds, not tenths: on a loaded 2-core machine a heartbeat thread can wait a
    # second for its turn (the suite once saw a 1 s gap with TTL 0.4)
    lease = OutputLease(output, ttl=2.0).acquire()
    time.sleep(4.5)  # more than twice the TTL: the heartbeat renewed it meanwhile
    with pytest.raises(OutputBusyError):
        OutputLease(output, ttl=2.0).acquire()
    lease.check()
    lease.release()


def test_a_second_run_on_a_held_output_is_refused_before_its_model_loads(tmp_path):
    from batchrun.batch.shell.launch import execute
    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.run import RunOptions
    from batchrun.commandkit import UsageError

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    output = str(tmp_path / "out.jsonl")
    loaded = []
    holder = OutputLease(output).acquire()
    opts = RunOptions(inputs=InputOptions(input=[str(src)]),
                      job=JobOptions(output=output, progress="none"))
    with pytest.raises(UsageError, match="another batchrun run is writing") as refused:
        execute(opts, lambda *a: loaded.append(a))
    assert refused.value.exit_code == 2 and loaded == []
    holder.release()


def test_a_store_without_conditional_writes_gets_a_best_effort_lease(caplog):
    output = "memory://lease-test/out.jsonl"
    with caplog.at_level(logging.WARNING, logger="batchrun.batch"):
        first = OutputLease(output).acquire()
    assert not first.store.atomic and "best effort" in caplog.text
    with pytest.raises(OutputBusyError):
        OutputLease(output).acquire()
    first.renew()
    first.check()
    first.release()
    OutputLease(output).acquire().release()


def test_a_run_that_loses_its_lease_stops_committing_and_publishes_nothing(tmp_path):
    from batchrun.batch.job.runner import run_batch
    from tests.fake_engine import fake_model
    from tests.unit.test_batch_resume import LINES, config, write_input

    src = write_input(tmp_path, LINES[:30])
    plan = config(tmp_path, src, max_in_flight=4, commit_every=3, hold_lease=True)
    output = str(tmp_path / "out.jsonl")
    commits = []

    def taken_over(counts):  # after the first commit, another run takes the lease over
        commits.append(counts)
        if len(commits) == 1:
            store = conditional_object(lease_url(output))
            store.replace(foreign_lease(1, 0), store.read().token)
            plan.lease._renewed -= plan.lease.ttl  # as if the process had stalled that long
    with pytest.raises(LeaseLostError, match="another run owns it now"):
        run_batch(fake_model(), plan, on_progress=taken_over)
    plan.lease.release()
    assert not (tmp_path / "out.jsonl").exists()
    parts = list((tmp_path / "out.jsonl.batchrun-staging").glob("part-*"))
    assert len(parts) == 1  # nothing committed after the lease was lost
    assert Holder.parse(conditional_object(lease_url(output)).read().data).owner == "x"
