"""/v1/embeddings on the bundled model against the same pooling over transformers' final hidden
states (hidden_states[-1], after the final norm), in float32: short, long, repeated and
prefix-sharing inputs, batched and alone; base64 and dimensions; the official openai client
against `batchrun serve`; a batch file mixing embedding and chat lines in one run."""

import json

import pytest
import torch
from click.testing import CliRunner
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from batchrun.batch.shell.commands import validate
from batchrun.batch.job.runner import run_batch
from batchrun.batch.job.result import RequestCounts
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.openai import OpenAIOptions
from tests.helpers import file_records, job_plan, poll_batch, upload_batch_file
from tests.server.conftest import serve
from tests.openai_batch_shape import error_of

STEM = ("The following passage describes the history of the lighthouse on the northern cape, "
        "which was built in 1871 after a series of shipwrecks along the rocky coast. ")
INPUTS = [
    "Hi",
    "What is the capital of France?",
    STEM + "Its first keeper was a retired sailor.",
    STEM + "Its lamp was electrified in 1932.",
    STEM,
    " ".join(f"Sentence number {i} talks about topic {i % 7} in some detail." for i in range(60)),
    "What is the capital of France?",  # repeated
]


def reference(hf, ids, kind):
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    v = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[kind]
    return torch.nn.functional.normalize(v, dim=0)


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b), dim=0))


def embed(model, body, **options):
    serving = OpenAIServing(model, ServingOptions.of(OpenAIOptions(**options)))
    prepared = serving.prepare("/v1/embeddings", body)
    return prepared.finalize(model.engine.generate(prepared.prompts, prepared.params)), prepared


def test_hidden_states_last_is_after_the_final_norm(real_model, hf_real_model):
    ids = real_model.tokenizer("Hello there")["input_ids"]
    with torch.no_grad():
        out = hf_real_model(torch.tensor([ids]), output_hidden_states=True)
        torch.testing.assert_close(hf_real_model.lm_head(out.hidden_states[-1]), out.logits)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_vectors_match_transformers_batched_and_alone(real_model, hf_real_model, kind):
    batched, prepared = embed(real_model, {"input": INPUTS}, pooling=kind)
    CreateEmbeddingResponse.model_validate(batched)
    alone = [embed(real_model, {"input": text}, pooling=kind)[0]["data"][0]["embedding"]
             for text in INPUTS]
    again, _ = embed(real_model, {"input": INPUTS}, pooling=kind)  # a warm prefix cache
    assert len(prepared.prompts[5]) > 500
    for i, ids in enumerate(prepared.prompts):
        want = reference(hf_real_model, ids, kind)
        for got in (batched["data"][i]["embedding"], alone[i], again["data"][i]["embedding"]):
            assert cosine(got, want) >= 0.99999, (kind, i)
        assert cosine(batched["data"][i]["embedding"], alone[i]) >= 0.999999
    assert batched["usage"]["prompt_tokens"] == sum(len(p) for p in prepared.prompts)


def test_token_id_inputs_equal_text_inputs(real_model):
    text, _ = embed(real_model, {"input": INPUTS[:3]})
    ids = [real_model.tokenizer(t)["input_ids"] for t in INPUTS[:3]]
    tokens, _ = embed(real_model, {"input": ids})
    single, _ = embed(real_model, {"input": ids[1]})
    for i in range(3):
        assert cosine(text["data"][i]["embedding"], tokens["data"][i]["embedding"]) > 0.999999
    assert cosine(single["data"][0]["embedding"], text["data"][1]["embedding"]) > 0.999999


def test_context_length_exceeded(real_model):
    from batchrun.openai.wire import RequestError

    with pytest.raises(RequestError) as e:
        embed(real_model, {"input": [1] * (real_model.max_model_len + 1)})
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "input")
    # Exactly max_model_len fits (prepared, not run: 8,192 tokens of prefill would cost ~25 s;
    # the engine's own limit is tested on tiny models).
    at_limit = OpenAIServing(real_model).prepare(
        "/v1/embeddings", {"input": [1] * real_model.max_model_len})
    assert [len(p) for p in at_limit.prompts] == [real_model.max_model_len]


def test_openai_limits_on_one_request(real_model):
    from batchrun.openai.wire import RequestError

    serving = OpenAIServing(real_model)
    with pytest.raises(RequestError) as e:  # 2,048 inputs at most
        serving.prepare("/v1/embeddings", {"input": ["x"] * 2049})
    assert e.value.param == "input" and "2048" in str(e.value)
    # 300,000 tokens summed over the inputs at most (checked before any engine work)
    per_input = real_model.max_model_len
    many = [[1] * per_input] * (300_000 // per_input + 1)
    with pytest.raises(RequestError) as e:
        serving.prepare("/v1/embeddings", {"input": many})
    assert (e.value.code, e.value.param) == ("max_tokens_per_request", "input")
    assert "300000" in str(e.value)
    fits = serving.prepare("/v1/embeddings", {"input": [[1] * per_input] * (300_000 // per_input)})
    assert len(fits.prompts) == 300_000 // per_input


def test_openai_client_against_serve(real_model, tmp_path):
    want, _ = embed(real_model, {"input": INPUTS[:4]}, pooling="mean")
    with serve(real_model, tmp_path, pooling="mean") as running:
        client = running.client()
        default = client.embeddings.create(model="smollm2-135m", input=INPUTS[:4])  # base64
        floats = client.embeddings.create(model="smollm2-135m", input=INPUTS[:4],
                                          encoding_format="float")
        short = client.embeddings.create(model="smollm2-135m", input=INPUTS[:4], dimensions=64)
        import openai

        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="smollm2-135m", input=[])
        assert e.value.body["param"] == "input"
        batch, records = _embeddings_batch(client, INPUTS[:4])
    assert batch.status == "completed" and batch.request_counts.completed == 2
    assert batch.usage.input_tokens == want["usage"]["prompt_tokens"] and \
        batch.usage.output_tokens == 0
    assert [r["custom_id"] for r in records] == ["first-two", "last-two"]
    for r, offset in zip(records, (0, 2)):
        got = CreateEmbeddingResponse.model_validate(r["response"]["body"])
        for i, item in enumerate(got.data):
            assert cosine(item.embedding, want["data"][offset + i]["embedding"]) > 0.999999
    assert default.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    for i in range(4):
        w = want["data"][i]["embedding"]
        assert cosine(floats.data[i].embedding, w) > 0.999999
        assert cosine(default.data[i].embedding, w) > 0.999999
        # base64 carries the very float32 values of the float response
        assert list(map(float, default.data[i].embedding)) == pytest.approx(
            floats.data[i].embedding, abs=1e-6)
        truncated = torch.nn.functional.normalize(torch.tensor(w[:64]), dim=0)
        assert len(short.data[i].embedding) == 64
        assert cosine(short.data[i].embedding, truncated) > 0.999999
        assert abs(float(torch.tensor(short.data[i].embedding).norm()) - 1) < 1e-5


def _embeddings_batch(client, inputs):
    """An /v1/embeddings batch of two lines (two inputs each) through the Batches API, done,
    and its output records."""
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "smollm2-135m", "input": part, "encoding_format": "float"}}
             for cid, part in (("first-two", inputs[:2]), ("last-two", inputs[2:4]))]
    f = upload_batch_file(client, lines, "emb.jsonl")
    batch = poll_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                                     completion_window="24h").id)
    return batch, file_records(client, batch.output_file_id)


def test_batch_file_mixes_embeddings_and_chat(real_model, tmp_path):
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_tokens": 12, "temperature": 0}},
        {"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": INPUTS[:3], "model": "smollm2-135m"}},
        {"custom_id": "emb-b64", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": INPUTS[3], "encoding_format": "base64", "dimensions": 32}},
        {"custom_id": "emb-bad", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "x", "dimensions": 0}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(validate, [str(src), "--json"])
    problems = [json.loads(x) for x in result.stdout.splitlines() if x.strip()]
    assert [(error_of(p)["line"], error_of(p)["param"]) for p in problems] == [(4, "dimensions")]
    summary = run_batch(real_model, job_plan(input=str(src), output=str(tmp_path / "out.jsonl"),
                                             progress="none"))
    assert summary.requests == RequestCounts(4, 3, 1)
    out = {o["custom_id"]: o["response"]["body"]
           for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert "Paris" in ChatCompletion.model_validate(out["chat-1"]).choices[0].message.content
    CreateEmbeddingResponse.model_validate(out["emb-1"])
    want, _ = embed(real_model, {"input": INPUTS[:4]})
    for i in range(3):
        assert cosine(out["emb-1"]["data"][i]["embedding"], want["data"][i]["embedding"]) > 0.999999
    import base64
    import numpy as np

    v = np.frombuffer(base64.b64decode(out["emb-b64"]["data"][0]["embedding"]), dtype="<f4")
    truncated = torch.nn.functional.normalize(torch.tensor(want["data"][3]["embedding"][:32]),
                                              dim=0)
    assert v.shape == (32,) and cosine(v.tolist(), truncated) > 0.999999
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], error_of(e)["param"], error_of(e)["line"]) for e in errors] == \
        [("emb-bad", "dimensions", 4)]
