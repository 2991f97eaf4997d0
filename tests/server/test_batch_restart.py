"""A server stopped mid-batch resumes the batch when it starts again on the same data dir.
(Its own module: the servers here must not share the engine with the module-scoped `api`.)"""

import json

import pytest

from tests.server.conftest import engine_idle, serve, wait_for
from tests.helpers import file_records, poll_batch, upload_batch_file
from tests.server.test_batches_api import create, line

pytestmark = pytest.mark.slow


def test_a_restarted_server_resumes_a_batch(real_model, tmp_path):
    lines = [line(f"r{i}", f"Tell me about the number {i}.", max_tokens=16) for i in range(16)]
    with serve(real_model, tmp_path, batch_max_in_flight=2) as srv:
        client = srv.client()
        batch = create(client, upload_batch_file(client, lines).id)
        assert wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2,
                        timeout=60)
    assert engine_idle(real_model.engine)
    stored = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())
    assert stored["status"] == "in_progress"
    with serve(real_model, tmp_path, batch_max_in_flight=8) as srv:
        client = srv.client()
        done = poll_batch(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 16
        out = file_records(client, done.output_file_id)
        assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(16)]


def test_a_server_starts_past_corrupt_state_files(real_model, tmp_path):
    from tests.server.test_stored_state import batch, file_object

    (tmp_path / "batches").mkdir()
    (tmp_path / "files").mkdir()
    (tmp_path / "batches" / "batch_good.json").write_text(json.dumps(batch("batch_good")))
    (tmp_path / "batches" / "batch_cut.json").write_text(json.dumps(batch("batch_cut"))[:30])
    (tmp_path / "files" / "file-in").write_text("{}\n")
    (tmp_path / "files" / "file-in.json").write_text(json.dumps(file_object("file-in")))
    (tmp_path / "files" / "file-cut.json").write_text("{")
    with serve(real_model, tmp_path) as srv:
        client = srv.client()
        assert [b.id for b in client.batches.list().data] == ["batch_good"]
        assert [f.id for f in client.files.list().data] == ["file-in"]
        assert client.files.content("file-in").text == "{}\n"
    assert (tmp_path / "batches" / "batch_cut.json.corrupt").exists()
    assert (tmp_path / "files" / "file-cut.json.corrupt").exists()
