"""A sweep reads its generations back from a run's output and error files: an error line is
OpenAI-shaped (the HTTP error in `response`, `error` null) or has only `error` (no custom_id)."""

import json

from batchrun.batch.storage.store import Storage
from batchrun.openai.wire import LineError, RequestError
from batchrun.openai.bodies import batch_error_line, batch_output_line
from batchrun.sweep.run import _read_records


def test_errors_of_both_shapes_and_results_are_told_apart(tmp_path):
    out = tmp_path / "m.jsonl"
    ok = batch_output_line("a", "req_1", {"choices": [{"text": "x"}]})
    ok["latency_s"] = 0.5
    out.write_text(json.dumps(ok) + "\n")
    http = batch_error_line(LineError(2, RequestError("body.temperature: too hot",
                                                      code="invalid_value", param="temperature"),
                                      "b"))
    unread = batch_error_line(LineError(3, RequestError("invalid JSON: x", code="invalid_json")))
    (tmp_path / "m.errors.jsonl").write_text(json.dumps(http) + "\n" + json.dumps(unread) + "\n")
    bodies, errors, latency = _read_records(str(out), Storage({}))
    assert bodies == {"a": {"choices": [{"text": "x"}]}} and latency == {"a": 0.5}
    assert errors == {"b": "line 2: body.temperature: too hot", None: "line 3: invalid JSON: x"}
