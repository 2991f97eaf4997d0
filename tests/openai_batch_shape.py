"""The shape of a batch output / error file line as OpenAI writes it (its API reference's
BatchRequestOutput; the openai package has no model of that line, only of the parts: ErrorObject
for an HTTP error body, BatchError for an error without one), checked strictly, and the error
of a line read back from it for the tests' assertions."""

import re

from openai.types import BatchError, ErrorObject
from pydantic import BaseModel, ConfigDict

# batchrun's one addition to a line: with --record-latency (sweeps) a result carries latency_s.
EXTRA_KEYS = {"latency_s"}


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    status_code: int
    request_id: str
    body: dict


class BatchRequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    custom_id: str | None
    response: _Response | None
    error: dict | None
    latency_s: float | None = None


def check_line(record: dict) -> BatchRequestOutput:
    """`record` as OpenAI writes a line, else AssertionError: `error` only for a failure without
    an HTTP answer (then no response), and an HTTP error's body exactly {"error": ErrorObject}."""
    line = BatchRequestOutput.model_validate(record)
    assert line.id.startswith("batch_req_"), record
    assert (line.response is None) != (line.error is None), \
        f"exactly one of response and error must be set: {record}"
    if line.error is not None:
        # A line that could not be parsed names its line and field; a request that never ran
        # (batch_expired) has code and message only, as OpenAI writes it.
        assert set(line.error) in ({"code", "message", "param", "line"}, {"code", "message"}), \
            record
        BatchError.model_validate(line.error)
        assert line.error["code"] and line.error["message"], record
    else:
        assert line.custom_id is not None, record
        if line.response.status_code != 200:
            assert set(line.response.body) == {"error"}, record
            assert set(line.response.body["error"]) == {"message", "type", "param", "code"}, record
            ErrorObject.model_validate(line.response.body["error"])
    return line


_LINE = re.compile(r"(?:^|: )line (\d+): ")


def error_of(record: dict) -> dict | None:
    """A checked line's error as {code, message, param, line, status_code}, None for a result.
    The line number of an HTTP error is read from its message ("line 11: ..."), where OpenAI's
    shape leaves it."""
    line = check_line(record)
    if line.error is not None:
        return {**line.error, "status_code": None}
    if line.response.status_code == 200:
        return None
    error = line.response.body["error"]
    number = _LINE.search(error["message"])
    return {"code": error["code"], "message": error["message"], "param": error["param"],
            "line": int(number.group(1)) if number else None,
            "status_code": line.response.status_code}
