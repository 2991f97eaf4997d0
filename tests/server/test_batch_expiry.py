"""A batch whose completion_window passes ends `expired`, as OpenAI's: the lines done are in
the output file, every other line has a batch_expired error line, expired_at is set and the
server's metrics count it. (Its own module: its server must not share the engine with the
module-scoped `api`.)"""

import openai
import pytest

from tests.helpers import file_records, poll_batch, upload_batch_file
from tests.openai_batch_shape import check_line
from tests.server.conftest import engine_idle, serve, wait_for
from tests.server.test_batches_api import line

pytestmark = pytest.mark.slow


def test_a_tiny_completion_window_expires_the_batch(real_model, tmp_path):
    lines = [line(f"r{i}", f"Write a long story about the number {i}.", max_tokens=200)
             for i in range(12)]
    with serve(real_model, tmp_path, batch_max_in_flight=2) as srv:
        client = srv.client()
        f = upload_batch_file(client, lines)
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="soon")
        assert refused.value.body["param"] == "completion_window"
        hour = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="1h")
        assert hour.expires_at == hour.created_at + 3600
        client.batches.cancel(hour.id)

        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="3s")
        assert batch.expires_at == batch.created_at + 3
        batch = poll_batch(client, batch.id)
        assert batch.status == "expired", batch
        assert batch.expired_at and batch.expired_at >= batch.expires_at
        counts = batch.request_counts
        assert counts.total == 12 and counts.completed + counts.failed == 12
        assert counts.completed < 12

        done = file_records(client, batch.output_file_id) if counts.completed else []
        expired = file_records(client, batch.error_file_id)
        assert len(done) == counts.completed and len(expired) == counts.failed
        assert sorted(r["custom_id"] for r in done + expired) == sorted(f"r{i}" for i in range(12))
        for record in done + expired:
            check_line(record)
        for record in expired:  # OpenAI's BatchRequestOutput for an expired request
            assert record["response"] is None and record["error"]["code"] == "batch_expired"
            assert set(record) == {"id", "custom_id", "response", "error"}
        metrics = srv.state.metrics
        assert metrics.value("batchrun_batches_ended_total", status="expired") == 1
        assert metrics.value("batchrun_batch_requests_expired_total") == counts.failed
        assert wait_for(lambda: engine_idle(real_model.engine), timeout=20)
