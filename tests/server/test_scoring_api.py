"""Scoring lines (echo + logprobs, max_tokens 0, prompt_logprobs) give the same bodies over HTTP,
through `batchrun run` and through the Batches API; bad ones are 400 records naming the field
while the job goes on. On the bundled model."""

import json
import math

import httpx
import pytest

from batchrun.batch.job.runner import run_batch
from tests.helpers import job_plan
from tests.server.conftest import API_KEY
from tests.helpers import file_records, poll_batch, upload_batch_file

pytestmark = pytest.mark.slow

URL = "/v1/completions"
GOOD = {
    "echo_ids": {"prompt": [[504, 3575, 282, 4649, 314], [504, 3575, 282, 4649, 314, 7042]],
                 "echo": True, "logprobs": 1, "max_tokens": 1},
    "echo_text": {"prompt": "Question: What is the capital of France?\nAnswer: Paris",
                  "echo": True, "logprobs": 2, "max_tokens": 0},
    "prompt_logprobs": {"prompt": "The capital of France is", "prompt_logprobs": 2,
                        "max_tokens": 2},
}
BAD = {
    "too_many_logprobs": ({"prompt": "Hi", "echo": True, "logprobs": 6, "max_tokens": 0},
                          "logprobs"),
    "echo_suffix": ({"prompt": "Hi", "echo": True, "suffix": "!", "max_tokens": 0}, "suffix"),
    "too_many_prompt_logprobs": ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
}


def body(fields):
    return {"model": "smollm2-135m", "temperature": 0, **fields}


def lines():
    good = [{"custom_id": k, "method": "POST", "url": URL, "body": body(v)}
            for k, v in GOOD.items()]
    bad = [{"custom_id": k, "method": "POST", "url": URL, "body": body(v)}
           for k, (v, _) in BAD.items()]
    return good[:1] + bad[:1] + good[1:] + bad[1:]


def comparable(response: dict) -> dict:
    """What must agree between paths: choices and usage (not ids or timestamps)."""
    return {"choices": response["choices"], "usage": response["usage"]}


def close(a, b, path=""):
    """Equal, floats to 1e-5 (steps batch different rows together on the three paths)."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-5), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def check_errors(errs):
    assert sorted(r["custom_id"] for r in errs) == sorted(BAD)
    for r in errs:
        assert r["response"]["status_code"] == 400
        assert r["response"]["body"]["error"]["param"] == BAD[r["custom_id"]][1]


@pytest.fixture(scope="module")
def batch_file_results(real_model, tmp_path_factory):
    """`batchrun run` on the lines, before the module's server takes the engine."""
    d = tmp_path_factory.mktemp("run")
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines()))
    run_batch(real_model, job_plan(input=str(src), output=str(d / "out.jsonl"), progress="none"))
    out = [json.loads(x) for x in (d / "out.jsonl").read_text().splitlines()]
    errs = [json.loads(x) for x in (d / "out.errors.jsonl").read_text().splitlines()]
    return out, errs


def test_http_batch_file_and_batches_api_agree(batch_file_results, api):
    out, errs = batch_file_results
    check_errors(errs)
    assert [r["custom_id"] for r in out] == list(GOOD)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    http = {}
    for k, v in GOOD.items():
        r = httpx.post(api.base_url + "/completions", json=body(v), headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        http[k] = r.json()
    for k, (v, param) in BAD.items():
        r = httpx.post(api.base_url + "/completions", json=body(v), headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param

    for r in out:
        close(comparable(r["response"]["body"]), comparable(http[r["custom_id"]]))

    client = api.client()
    batch = client.batches.create(input_file_id=upload_batch_file(client, lines()).id, endpoint=URL,
                                  completion_window="24h")
    batch = poll_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.failed == len(BAD)
    for r in file_records(client, batch.output_file_id):
        close(comparable(r["response"]["body"]), comparable(http[r["custom_id"]]))
    check_errors(file_records(client, batch.error_file_id))

    scored = http["echo_text"]["choices"][0]
    assert scored["text"] == GOOD["echo_text"]["prompt"]
    assert scored["logprobs"]["token_logprobs"][0] is None
    assert http["echo_text"]["usage"]["completion_tokens"] == 0
    two = http["echo_ids"]["choices"]
    assert len(two) == 2 and len(two[1]["logprobs"]["tokens"]) == 7  # 6 prompt + 1 generated
    # The shared five tokens score the same in both prompts.
    close(two[0]["logprobs"]["token_logprobs"][:5], two[1]["logprobs"]["token_logprobs"][:5])
    entries = http["prompt_logprobs"]["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(len(e) in (2, 3) for e in entries[1:])
