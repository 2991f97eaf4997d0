"""Files + Batches API through the official openai client, on the bundled model."""

import io

import openai
import pytest

from tests.helpers import TERMINAL_BATCH, file_records, jsonl, poll_batch, upload_batch_file
from tests.openai_batch_shape import error_of
from tests.server.conftest import engine_idle, wait_for

pytestmark = pytest.mark.slow


def line(custom_id, content, max_tokens=6, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}], **body}}


def create(client, file_id, endpoint="/v1/chat/completions", **kw):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                 completion_window="24h", **kw)


def two_batches(client):
    """Two batches of one line each over the same uploaded file, created back to back."""
    f = upload_batch_file(client, [line("a", "Hi")])
    return create(client, f.id), create(client, f.id)


def running_batch(client, prompt, n, max_tokens):
    """A batch of `n` lines r0.. (`prompt` formatted with the line's number), once it runs."""
    lines = [line(f"r{i}", prompt.format(i), max_tokens=max_tokens) for i in range(n)]
    batch = create(client, upload_batch_file(client, lines).id)
    poll_batch(client, batch.id, until=("in_progress",) + TERMINAL_BATCH)
    return batch


def test_batch_runs_to_completion_with_output_and_error_files(api):
    client = api.client()
    lines = [line("capital", "What is the capital of France?", max_tokens=10),
             line("bad", "Hello", temperature=9),
             line("count", "Count to three.")]
    f = upload_batch_file(client, lines)
    assert f.purpose == "batch" and f.bytes == len(jsonl(lines)) and f.filename == "input.jsonl"
    assert client.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in client.files.list(purpose="batch").data]

    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    batch = poll_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 3
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    out = file_records(client, batch.output_file_id)
    assert [r["custom_id"] for r in out] == ["capital", "count"]  # input order
    assert "Paris" in out[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert out[0]["response"]["status_code"] == 200
    errs = file_records(client, batch.error_file_id)
    assert [r["custom_id"] for r in errs] == ["bad"]
    assert errs[0]["response"]["status_code"] == 400 and errs[0]["error"] is None
    assert error_of(errs[0])["param"] == "temperature" and error_of(errs[0])["line"] == 2
    assert all(error_of(r) is None for r in out)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    assert batch.id in [b.id for b in client.batches.list().data]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    assert engine_idle(api.state.model.engine)


def test_bad_batch_requests_are_refused(api):
    client = api.client()
    f = upload_batch_file(client, [line("a", "Hi")])
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations",
                              completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_a_line_for_another_endpoint_fails_validation(api):
    client = api.client()
    other = dict(line("b", "Hi"), url="/v1/completions")
    f = upload_batch_file(client, [line("a", "Hi"), other])
    batch = poll_batch(client, create(client, f.id).id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors.data[0].line == 2 and batch.errors.data[0].code == "invalid_url"


def test_cancel_keeps_what_finished_and_frees_the_engine(api):
    client = api.client()
    batch = running_batch(client, "Write a long story about the number {}.", 40, max_tokens=300)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = poll_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 40
    assert wait_for(lambda: engine_idle(api.state.model.engine), timeout=20)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_interactive_requests_run_while_a_batch_fills_the_engine(api):
    client = api.client()
    batch = running_batch(client, "Tell me a fact about the number {}.", 16, max_tokens=24)
    r = client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi."}])
    assert r.choices[0].message.content
    # The interactive answer did not wait for the whole batch.
    assert client.batches.retrieve(batch.id).status in ("in_progress", "finalizing", "completed")
    assert poll_batch(client, batch.id).status == "completed"


def _crash_first_run(monkeypatch, leave_request=False):
    """The first batch to run raises from inside the runner (with, if asked, a request of its
    own left in the engine); the later ones run."""
    from batchrun.engine import SamplingParams
    from batchrun.server import batch_job

    real_run_job = batch_job.run_job
    crashed = []

    def run_job(model, client, config, stop, on_progress):
        if crashed:
            return real_run_job(model, client, config, stop, on_progress)
        crashed.append(True)
        if leave_request:
            client.add_request("left-behind", [5, 6, 7],
                               SamplingParams(max_tokens=2000, ignore_eos=True))
        raise RuntimeError("the runner tripped")

    monkeypatch.setattr(batch_job, "run_job", run_job)


def test_a_batch_that_crashes_fails_alone(api, monkeypatch):
    import httpx

    _crash_first_run(monkeypatch, leave_request=True)
    client = api.client()
    first, second = two_batches(client)
    first = poll_batch(client, first.id)
    assert first.status == "failed" and first.failed_at
    assert first.errors.data[0].code == "internal_error"
    assert "the runner tripped" in first.errors.data[0].message
    # Its request is gone from the shared engine (it would run 2000 tokens otherwise).
    engine = api.state.model.engine
    assert wait_for(lambda: "left-behind" not in engine.groups, timeout=5)
    assert poll_batch(client, second.id).status == "completed"
    assert httpx.get(api.url + "/health").status_code == 200
    assert wait_for(lambda: engine_idle(engine), timeout=20)


def test_a_batch_worker_survives_a_failure_it_cannot_record(api, monkeypatch, caplog):
    _crash_first_run(monkeypatch)
    manager = api.state.batches
    real_fail = manager._fail

    def fail(batch_id, code, message):
        monkeypatch.setattr(manager, "_fail", real_fail)
        raise OSError("disk full")

    monkeypatch.setattr(manager, "_fail", fail)
    client = api.client()
    first, second = two_batches(client)
    assert poll_batch(client, second.id).status == "completed"
    assert f"could not mark batch {first.id} failed" in caplog.text


def test_the_batch_reports_usage_summed_over_its_outputs(api):
    client = api.client()
    lines = [line("a", "Name a colour.", max_tokens=5), line("b", "Name a fruit.", max_tokens=7),
             line("bad", "Hello", temperature=9)]
    batch = poll_batch(client, create(client, upload_batch_file(client, lines).id).id)
    assert batch.status == "completed"
    bodies = [r["response"]["body"] for r in file_records(client, batch.output_file_id)]
    usage = batch.usage  # parsed by the client as openai.types.BatchUsage
    assert isinstance(usage, openai.types.BatchUsage)
    assert usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies) > 0
    assert usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies) > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == sum(
        b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_metadata_is_limited_as_openai_limits_it(api):
    client = api.client()
    f = upload_batch_file(client, [line("a", "Hi")])
    for metadata, param in (({f"k{i}": "v" for i in range(17)}, "metadata"),
                            ({"k" * 65: "v"}, "metadata"), ({"k": "v" * 513}, "metadata"),
                            ({"k": 1}, "metadata.k")):
        with pytest.raises(openai.BadRequestError) as e:
            create(client, f.id, metadata=metadata)
        assert e.value.body["param"].startswith(param), (metadata, e.value.body)
    ok = {f"key{i:02d}": "v" * 512 for i in range(16)}
    assert create(client, f.id, metadata=ok).metadata == ok


def test_output_files_expire_when_the_batch_says(api):
    client = api.client()
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a", "Hi")]))),
                            purpose="batch", expires_after={"anchor": "created_at",
                                                            "seconds": 7200})
    assert f.expires_at == f.created_at + 7200
    default = upload_batch_file(client, [line("a", "Hi")])
    assert default.expires_at == default.created_at + 30 * 24 * 3600  # OpenAI's default
    batch = create(client, f.id, output_expires_after={"anchor": "created_at", "seconds": 3600})
    batch = poll_batch(client, batch.id)
    out = client.files.retrieve(batch.output_file_id)
    assert out.expires_at == out.created_at + 3600
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at",
                                                          "seconds": 3600}):
        with pytest.raises(openai.BadRequestError) as e:
            create(client, f.id, output_expires_after=bad)
        assert e.value.body["param"].startswith("output_expires_after")
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                                expires_after=bad)
        assert e.value.body["param"].startswith("expires_after")
    # Past its time the file is gone, from the listing, the API and the disk.
    store = api.state.files
    assert store.delete_expired(now=out.expires_at - 1) == []
    assert out.id in store.delete_expired(now=out.expires_at + 1)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(out.id)
    assert not (store.root / out.id).exists()
