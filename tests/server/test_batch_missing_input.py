"""A batch whose input file is deleted before or while it runs fails saying so, with no server
path in what the API shows (the manager on a file store, no engine: conftest's `manager`)."""

import json
from types import SimpleNamespace

from batchrun.batch.job.plan import make_plan
from batchrun.server import batch_job, batches
from tests.server.conftest import upload_line


def new_batch(manager):
    f = upload_line(manager)
    return manager.create({"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                           "completion_window": "24h"}), manager.state.files.root / f["id"]


def failure(manager, batch, tmp_path):
    got = manager.get(batch["id"])
    assert got["status"] == "failed"
    [error] = got["errors"]["data"]
    assert str(tmp_path) not in json.dumps(got)
    return error


def test_deleted_before_the_batch_ran(manager, tmp_path):
    batch, content = new_batch(manager)
    content.unlink()  # the record is still there: deleted between the lookup and the read
    manager._run(batch["id"])
    error = failure(manager, batch, tmp_path)
    assert (error["code"], error["message"]) == (
        "missing_file", f"input file {batch['input_file_id']} was deleted")


def test_deleted_while_the_runner_starts(manager, tmp_path, monkeypatch):
    batch, content = new_batch(manager)

    def options(state, input_path, work_dir, expires_at=None):
        from batchrun.options.job import InputOptions, JobOptions
        from batchrun.options.run import RunOptions

        return RunOptions(inputs=InputOptions(input=[str(input_path)]),
                          job=JobOptions(output=str(work_dir / "output.jsonl")))

    def run(self, state):
        content.unlink()
        make_plan(self.options)  # what run_job does first: it cannot find the input

    monkeypatch.setattr(batch_job, "run_options", options)
    monkeypatch.setattr(batches, "SyncEngineClient", lambda *a: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(batches._Running, "run", run)
    manager._run(batch["id"])
    error = failure(manager, batch, tmp_path)
    assert error["message"] == f"input file {batch['input_file_id']} was deleted"


def test_an_unexpected_failure_shows_no_server_path(manager, tmp_path, monkeypatch):
    batch, content = new_batch(manager)

    def broken(batch_id):
        raise OSError(f"cannot write {manager.root / batch_id / 'x'}")

    monkeypatch.setattr(manager, "_run", broken)
    manager._queue.put(batch["id"])
    manager._queue.put(None)
    manager._work()
    error = failure(manager, batch, tmp_path)
    assert error["message"].startswith("the batch failed: OSError: cannot write <data-dir>/")
