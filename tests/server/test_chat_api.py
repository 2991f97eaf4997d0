"""/v1/chat/completions and /v1/models through the official openai client, on the bundled model."""

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(api):
    models = api.client().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    assert api.client().models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.NotFoundError):
        api.client().models.retrieve("gpt-4o")


def test_chat_non_stream(api):
    r = api.client().chat.completions.create(model="smollm2-135m", messages=CAPITAL,
                                             max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == "smollm2-135m"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream_and_ends_with_usage(api):
    client = api.client()
    ref = client.chat.completions.create(model="smollm2-135m", messages=CAPITAL, max_tokens=12,
                                         temperature=0)
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=CAPITAL, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == ref.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats(api):
    chunks = list(api.client().chat.completions.create(
        model="smollm2-135m", messages=CAPITAL, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    used = [c.usage.completion_tokens for c in chunks]
    assert used[0] == 0 and used == sorted(used) and used[-1] == 6  # the answer is longer than 6


def test_stop_string_never_leaks_into_the_stream(api):
    client = api.client()
    kw = dict(model="smollm2-135m", messages=CAPITAL, max_tokens=12, temperature=0,
              stop=[" Paris"])
    ref = client.chat.completions.create(**kw)
    deltas = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(stream=True, **kw) if c.choices]
    assert ref.choices[0].message.content == "The capital of France is"
    assert "".join(deltas) == ref.choices[0].message.content
    assert not any("Par" in d for d in deltas)


def test_async_client_concurrent_streams(api):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="smollm2-135m", max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}])
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        async with api.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))

    texts = asyncio.run(main())
    assert len(texts) == 6 and all(texts)


def test_n2_stream_has_two_choices(api):
    chunks = list(api.client().chat.completions.create(
        model="smollm2-135m", messages=CAPITAL, max_tokens=8, temperature=0.8, seed=1, n=2,
        stream=True))
    assert len({c.id for c in chunks}) == 1
    texts, finishes = {0: "", 1: ""}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert set(finishes) == {0, 1} and all(texts.values())


def test_validation_errors_are_400_in_openai_shape(api):
    client = api.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=CAPITAL, temperature=5)
    assert e.value.body["param"] == "temperature"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=CAPITAL, max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert e.value.body["code"] == "model_not_found"


def test_bad_json_and_unknown_route(api):
    import httpx

    headers = {"Authorization": "Bearer sk-batchrun-test"}
    r = httpx.post(api.base_url + "/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(api.base_url + "/nothing-here", headers=headers)
    assert r.status_code == 404 and "error" in r.json()


def test_deeply_nested_bodies_are_400_not_500(api):
    import httpx

    headers = {"Authorization": "Bearer sk-batchrun-test"}
    depth = 20000
    bodies = [b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth,
              b'{"model": "smollm2-135m", "messages": ' + b"[" * depth + b"]" * depth + b"}"]
    for path in ("/chat/completions", "/completions", "/batches"):
        for body in bodies:
            r = httpx.post(api.base_url + path, content=body, headers=headers)
            assert r.status_code == 400, (path, r.text[:200])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_json" and "depth" in error["message"]
    # Under the parser's limit, deep values meet the request validation instead.
    messages = [{"role": "user", "content": "Hi", "name": [[[[[["x"]]]]]]}]
    r = httpx.post(api.base_url + "/chat/completions", headers=headers,
                   json={"model": "smollm2-135m", "messages": messages, "metadata": [[[1]]]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(api.url + "/health").status_code == 200


def test_text_completions_with_two_prompts_stream_and_not(api):
    client = api.client()
    prompts = ["The capital of France is", "One, two, three,"]
    r = client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=5,
                                  temperature=0)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert 0 < r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 0
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=5,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in r.choices}
