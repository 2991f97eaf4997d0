"""Property-based fuzzing of request bodies and batch lines (hypothesis, hypothesis-jsonschema
over the request models' own JSON schema, plus hostile mutations of them).

Asserted for every generated body or line:
- the OpenAI adapter accepts it or refuses it with a RequestError (a 400 naming a field),
  never another exception;
- an accepted request runs to the end on a real engine (a tiny random model with the bundled
  model's tokenizer) without an error and without hurting the requests beside it, and its
  response validates as the `openai` package's own type;
- `validate`, `run` and `serve` give every line of a corpus the same verdict, for the same
  field.

BATCHRUN_FUZZ_EXAMPLES scales every budget (default 1, a few seconds each in CI);
`BATCHRUN_FUZZ_EXAMPLES=20 pytest tests/fuzz` runs twenty times as many.
"""

import json
import math
import os

import httpx
import orjson
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchrun.batch.job import validate as v
from batchrun.batch.storage.readers import open_sources
from batchrun.batch.job.runner import prepare_line, run_batch
from batchrun.options.engine import EngineConfig
from batchrun.llm import LoadedModel, build_engine, build_model
from batchrun.models.arch.llama import LlamaModel, ModelConfig
from batchrun.openai.wire import RequestError
from batchrun.openai.requests import ChatCompletionRequest, CompletionRequest
from batchrun.openai.bodies import engine_error
from batchrun.openai.serving import OpenAIServing
from batchrun.served_model import TokenizerModel
from tests.helpers import job_plan
from tests.server.conftest import API_KEY, serve
from tests.tiny_models import make_tiny
from tests.openai_batch_shape import error_of

SCALE = float(os.environ.get("BATCHRUN_FUZZ_EXAMPLES", "1"))
CONTEXT = 160  # small: an accepted request can generate at most this many tokens
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def budget(n: int):
    # No shrinking unless asked: a failing example is printed as found, within CI's time.
    phases = list(Phase) if os.environ.get("BATCHRUN_FUZZ_SHRINK") else \
        [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), phases=phases, database=None)


# --- issue 28's hostile bodies, tried first by every property (explicit examples) --------------

_ASK = [{"role": "user", "content": "What is the capital of France?"}]
ISSUE_28 = [
    (CHAT, {"messages": _ASK, "max_tokens": 8, "temperature": 1e-39}),  # greedy, not null
    (CHAT, {"messages": _ASK, "max_tokens": 8, "temperature": 5e-324}),
    (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 1e-38}),
    (CHAT, {"messages": _ASK, "max_tokens": 8, "repetition_penalty": 1e-300}),  # a 400
    (CHAT, {"messages": _ASK, "max_tokens": 8, "response_format": {  # {"$ref": "#"}: a 400
        "type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}}),
    (COMPLETIONS, {"prompt": ["x"] * 10_000, "max_tokens": 1}),  # past the 2048 prompts: a 400
]


# --- strategies ---------------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.floats(allow_nan=False)
                | st.integers(min_value=-(2 ** 80), max_value=2 ** 80)
                | st.text(max_size=12) | st.sampled_from(["²", "-1", "1" * 12, "", "\x00"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=8)
FIELDS = sorted(set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields))


def _no_stream(body):
    # Streaming is a transport choice (SSE over HTTP, refused in batch files), not a verdict.
    if isinstance(body, dict):
        body.pop("stream", None)
        body.pop("stream_options", None)
    return body


def _inclusive(schema):
    """hypothesis-jsonschema cannot draw floats above an exclusive 0 with this hypothesis;
    the boundary itself is then drawn too, which the models refuse (a fine case to fuzz)."""
    if isinstance(schema, dict):
        out = {k: _inclusive(v) for k, v in schema.items()}
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if key in out:
                out[bound] = out.pop(key)
        return out
    if isinstance(schema, list):
        return [_inclusive(v) for v in schema]
    return schema


SCHEMAS = {CHAT: from_schema(_inclusive(ChatCompletionRequest.model_json_schema())),
           COMPLETIONS: from_schema(_inclusive(CompletionRequest.model_json_schema()))}


@st.composite
def bodies(draw):
    url = draw(st.sampled_from([CHAT, COMPLETIONS]))
    body = draw(SCHEMAS[url])
    for _ in range(draw(st.integers(0, 2))):  # hostile mutations of a well-formed body
        field = draw(st.sampled_from(FIELDS + ["x_unknown"]))
        body[field] = draw(json_values)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = draw(st.integers(1, 24))  # keeps generation short
    return url, _no_stream(body)


@st.composite
def lines(draw, index):
    url, body = draw(bodies())
    envelope = {"custom_id": f"c{index}", "method": "POST", "url": url, "body": body}
    mutation = draw(st.integers(0, 9))
    if mutation == 0:
        envelope[draw(st.sampled_from(["custom_id", "method", "url", "body"]))] = \
            draw(json_values)
    elif mutation == 1:
        return draw(st.sampled_from(['{"custom_id": "x", ', "[" * 5000, "null", "\"text\""]))
    return json.dumps(envelope)


# --- a real engine, small --------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_models(tmp_path_factory, smol_tokenizer):
    """Two engines over one tiny random model that has the bundled model's vocabulary and
    chat template: one for the batch runner, one behind the HTTP server."""
    path = tmp_path_factory.mktemp("fuzz-model")
    make_tiny("llama", path, vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64,
              max_position_embeddings=CONTEXT)
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))

    def loaded():
        net = build_model(LlamaModel, cfg, path, torch.device("cpu"), torch.float32)
        engine = build_engine(net, smol_tokenizer, EngineConfig.default(
            block_size=16, num_blocks=256, max_model_len=CONTEXT), [2], torch.device("cpu"),
            torch.float32)
        return LoadedModel(engine=engine, tokenizer=smol_tokenizer, name="fuzz-model",
                           aliases=("smollm2-135m", "default"))
    return loaded(), loaded()


def settle(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


# --- properties ---------------------------------------------------------------------------

@budget(120)
@given(body=bodies())
@example(body=ISSUE_28[0]).via("issue 28")
@example(body=ISSUE_28[1]).via("issue 28")
@example(body=ISSUE_28[2]).via("issue 28")
@example(body=ISSUE_28[3]).via("issue 28")
@example(body=ISSUE_28[4]).via("issue 28")
@example(body=ISSUE_28[5]).via("issue 28")
def test_the_adapter_accepts_or_refuses_every_body_with_a_400(body, smol_tokenizer):
    url, payload = body
    model = TokenizerModel(smol_tokenizer, "m", aliases=("smollm2-135m",), max_model_len=CONTEXT)
    try:
        _adapter(model).prepare(url, payload)
    except RequestError as exc:  # 400, or 404 for a model this server does not have
        assert exc.status_code in (400, 404) and exc.code and exc.message


_adapters = {}


def _adapter(model):
    key = id(model.tokenizer)
    if key not in _adapters:
        _adapters[key] = OpenAIServing(model)
    return _adapters[key]


@budget(12)
@given(batch=st.lists(bodies(), min_size=1, max_size=6))
@example(batch=ISSUE_28).via("issue 28")
def test_accepted_bodies_run_to_the_end_side_by_side(batch, fuzz_models):
    model = fuzz_models[0]
    serving = OpenAIServing(model)
    engine = model.engine
    work = []
    for i, (url, payload) in enumerate(batch):
        try:
            prepared = serving.prepare(url, payload)
        except RequestError:
            continue
        ids = [f"f{i}-{k}" for k in range(len(prepared.prompts))]
        for rid, prompt in zip(ids, prepared.prompts):
            engine.add_request(rid, prompt, prepared.params)
        work.append((prepared, ids))
    done = settle(engine)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for prepared, ids in work:
        outputs = [done[rid] for rid in ids]
        assert all(engine_error(o) is None for o in outputs), [o.error for o in outputs]
        response = prepared.finalize(outputs)
        (ChatCompletion if prepared.kind == "chat" else Completion).model_validate(response)


def _verdict_of_record(record: dict) -> tuple:
    return ("error", error_of(record)["code"], error_of(record).get("param"))


def _issue_28_corpus():
    rows = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})
            for i, (url, body) in enumerate(ISSUE_28)]
    return tuple(rows + ['{"custom_id": "x", ', "null"])


@budget(4)
@given(corpus=st.tuples(*[lines(i) for i in range(8)]))
@example(corpus=_issue_28_corpus()).via("issue 28")
def test_validate_run_and_serve_agree_on_every_line(corpus, fuzz_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    src = tmp / "in.jsonl"
    src.write_text("\n".join(corpus) + "\n")
    batch_model, served_model = fuzz_models

    validated = {}
    serving = OpenAIServing(batch_model)
    v.validate(open_sources([str(src)]), lambda text, n: prepare_line(text, n, serving),
               lambda item, exc: validated.__setitem__(item.line, ("error", exc.code, exc.param)))

    result = run_batch(batch_model, job_plan(input=str(src), output=str(tmp / "out.jsonl"),
                                              progress="none"))
    assert result.status == "completed"
    ran, statuses = {}, {}
    for text in (tmp / "out.errors.jsonl").read_text().splitlines():
        record = json.loads(text)
        ran[error_of(record)["line"]] = _verdict_of_record(record)
        if record["response"] is not None:  # the HTTP answer an API would have given
            statuses[error_of(record)["line"]] = record["response"]["status_code"]
    for n in range(1, len(corpus) + 1):
        validated.setdefault(n, ("ok",))
        ran.setdefault(n, ("ok",))
    assert ran == validated
    assert len((tmp / "out.jsonl").read_text().splitlines()) == \
        sum(1 for verdict in ran.values() if verdict == ("ok",))

    with serve(served_model, tmp / "server") as running, httpx.Client(
            base_url=running.url, headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60) as http:
        for n, text in enumerate(corpus, start=1):
            envelope = _envelope(text)
            if envelope is None or validated[n][1:2] == ("duplicate_custom_id",):
                continue  # what only a batch file has: its envelope, its other lines
            response = http.post(envelope["url"], content=json.dumps(envelope["body"]),
                                 headers={"Content-Type": "application/json"})
            if validated[n] == ("ok",):
                assert response.status_code == 200, (n, response.text)
            else:
                error = response.json()["error"]
                assert response.status_code == statuses[n], (n, response.text)
                assert ("error", error["code"], error["param"]) == validated[n], n


def _envelope(text: str):
    """The line's url and body, if its envelope is one a server request could be."""
    try:
        obj = orjson.loads(text)
    except ValueError:
        return None
    ok = (isinstance(obj, dict) and obj.get("url") in (CHAT, COMPLETIONS)
          and isinstance(obj.get("body"), dict) and isinstance(obj.get("custom_id"), str)
          and obj.get("method") == "POST" and not any(
              isinstance(x, float) and not math.isfinite(x) for x in obj["body"].values()))
    return obj if ok else None
