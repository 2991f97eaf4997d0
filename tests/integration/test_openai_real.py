"""The OpenAI surface on the bundled real model: structured output, stop strings, seeds,
logprobs, and forced tool calls through `batchrun run --chat-template ... --tool-parser`."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchrun.openai.serving import OpenAIServing, ServingOptions
from tests import helpers
from tests.integration.json_trials import TEMPERATURES, TRIALS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
TEMPLATE = ROOT / "batchrun/openai/templates/chatml_tools.jinja"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def serving(real_model):
    return OpenAIServing(real_model, ServingOptions())


def run(real_model, serving, bodies):
    """Prepare, generate together in one engine run, finalize; bodies validated by openai."""
    prepared = [serving.prepare(CHAT, b) for b in bodies]
    outs = real_model.engine.generate([p.prompts[0] for p in prepared],
                                      [p.params for p in prepared])
    results = [p.finalize(o) for p, o in zip(prepared, outs)]
    for r in results:
        ChatCompletion.model_validate(r)
    return results


def content(result, i=0):
    return result["choices"][i]["message"]["content"]


def test_json_schema_twenty_varied_trials_all_parse_and_validate(real_model, serving):
    bodies = [{"messages": [{"role": "user", "content": f"{q} Answer in JSON."}],
               "max_tokens": 200, "temperature": TEMPERATURES[i % len(TEMPERATURES)], "seed": i,
               "response_format": {"type": "json_schema", "json_schema": {
                   "name": f"trial_{i}", "schema": schema, "strict": True}}}
              for i, (q, schema) in enumerate(TRIALS)]
    results = run(real_model, serving, bodies)
    valid = 0
    for (q, schema), r in zip(TRIALS, results):
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", f"truncated: {q!r}: {content(r)!r}"
        jsonschema.validate(json.loads(content(r)), schema)
        valid += 1
    print(f"\njson_schema: {valid}/{len(TRIALS)} parse and validate (max_tokens 200)")
    assert valid == 20


def test_json_object_gives_an_object(real_model, serving):
    (r,) = run(real_model, serving, [{"messages": FRANCE, "max_tokens": 60, "temperature": 0,
                                      "response_format": {"type": "json_object"}}])
    assert isinstance(json.loads(content(r)), dict)


def test_stop_strings_across_token_boundaries(real_model, serving):
    free, = run(real_model, serving, [{"messages": FRANCE, "max_tokens": 20, "temperature": 0}])
    text = content(free)
    assert "Paris" in text
    stop = "of France is"  # several tokens
    at = text.index(stop)
    stopped, listed = run(real_model, serving, [
        {"messages": FRANCE, "max_tokens": 20, "temperature": 0, "stop": stop},
        {"messages": FRANCE, "max_tokens": 20, "temperature": 0, "stop": ["zzz", "Paris"]}])
    assert content(stopped) == text[:at]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert content(listed) == text[:text.index("Paris")]


def test_seed_gives_the_same_tokens_whatever_shares_the_batch(real_model, serving):
    seeded = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}],
              "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 1234}
    others = [{"messages": [{"role": "user", "content": f"Tell me fact number {i} about cats."}],
               "max_tokens": 6 + 4 * i, "temperature": 1.0} for i in range(3)]
    alone, = run(real_model, serving, [seeded])
    mixed = run(real_model, serving, others[:2] + [seeded, {**seeded, "seed": 4321}] + others[2:])
    assert content(mixed[2]) == content(alone)
    assert content(mixed[3]) != content(alone)


def test_logprobs_in_openai_shape(real_model, serving):
    r, = run(real_model, serving, [{"messages": FRANCE, "max_tokens": 12, "temperature": 0,
                                    "logprobs": True, "top_logprobs": 3}])
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"]
    for e in entries:
        assert -9999.0 <= e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy took the best
        assert e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"])
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") in (e["token"], "\ufffd") \
            or e["token"].startswith("bytes:")
    assert "".join(e["token"] for e in entries).startswith(content(r))


# The real CLI (`python -m batchrun`, the bundled model), text output.
batchrun = functools.partial(helpers.batchrun, real=True, text=True, timeout=900)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}


def test_cli_forced_tool_calls_and_completions(tmp_path):
    weather = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    lines = [
        # One call: with parallel calls allowed, this 135M model at temperature 0 goes on
        # calling until max_tokens.
        ("required", CHAT, {"messages": weather, "tools": [WEATHER, TIME],
                            "tool_choice": "required", "parallel_tool_calls": False,
                            "max_tokens": 60, "temperature": 0}),
        # Greedy too: sampled at temperature 1, the zone string ran to max_tokens once.
        ("named", CHAT, {"messages": weather, "tools": [WEATHER, TIME], "max_tokens": 60,
                         "temperature": 0,
                         "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        ("complete", "/v1/completions", {"prompt": ["The capital of France is", "1, 2, 3,"],
                                         "n": 2, "max_tokens": 5, "logprobs": 2, "seed": 3}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": u, "body": b})
                           + "\n" for c, u, b in lines))
    proc = batchrun("run", src, "-o", tmp_path / "out.jsonl", "--chat-template", TEMPLATE,
                    "--tool-parser", "hermes", "-q")
    assert proc.returncode == 0, proc.stderr
    out = {o["custom_id"]: o["response"]["body"]
           for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert set(out) == {"required", "named", "complete"}, (tmp_path / "out.errors.jsonl").read_text()

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for cid, finish in (("required", "tool_calls"), ("named", "stop")):
        choice = ChatCompletion.model_validate(out[cid]).choices[0]
        assert choice.finish_reason == finish
        assert choice.message.tool_calls, out[cid]
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if cid == "named":
            assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]

    completion = Completion.model_validate(out["complete"])
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in completion.choices)
    assert completion.usage.completion_tokens == sum(len(c.logprobs.tokens)
                                                     for c in completion.choices)
