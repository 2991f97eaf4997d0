"""The whole batch pipeline (reader -> OpenAIServing -> engine -> parsers -> output file) with a
tools-capable template given as --chat-template would, and a scripted model that writes
recorded tool calls and thoughts. Every output body validates against the openai types."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchrun.batch.job.runner import run_batch
from batchrun.openai.render import load_chat_template
from batchrun.openai.serving import OpenAIServing, ServingOptions
from batchrun.options.openai import OpenAIOptions
from tests.helpers import job_plan
from tests.scripted_model import script, scripted_model
from tests.openai_batch_shape import error_of

TEMPLATE = "batchrun/openai/templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THOUGHT = "<think>\nShort question, short answer.\n</think>\n\nFour."


def chat(content, **fields):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 64, **fields}


LINES = [  # (custom_id, url, body, scripted answer)
    ("tool", "/v1/chat/completions", chat("Weather in Oslo?", tools=[WEATHER]), CALL),
    ("think", "/v1/chat/completions", chat("What is 2 + 2?"), THOUGHT),
    ("two", "/v1/chat/completions", chat("Pick a city for the weather, twice.", tools=[WEATHER],
                                         n=2, tool_choice="required"), CALL),
    ("complete", "/v1/completions", {"prompt": ["Roses are", "The sky is blue and"],
                                     "max_tokens": 8}, None),
    ("streamed", "/v1/chat/completions", chat("hi", stream=True), None),
    ("moderate", "/v1/moderations", {"input": "x"}, None),
]


def test_batch_file_with_tools_reasoning_and_completions(tmp_path, smol_tokenizer):
    model = scripted_model(smol_tokenizer)
    template = load_chat_template(TEMPLATE)
    serving = OpenAIServing(model, ServingOptions.of(OpenAIOptions(chat_template=template,
                                                                   reasoning_parser="qwen3")))
    answers = {}
    for cid, url, body, answer in LINES:
        if answer is not None:
            prompt = serving.prepare(url, body).prompts[0]
            answers[cid] = script(model, prompt, answer, keep=True)
    for prompt, text in zip(serving.prepare(*LINES[3][1:3]).prompts, [" red", " so is"]):
        script(model, prompt, text, keep=True)
    assert len(model.engine.runner.model.scripts) == 5  # distinct prompt lengths

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": url,
                                       "body": body}) + "\n" for cid, url, body, _ in LINES))
    config = job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), progress="none",
                       chat_template=template, reasoning_parser="qwen3")
    result = run_batch(model, config)
    assert result.requests.ok == 4 and result.requests.failed == 2
    assert result.summary["this_run"] == {"ok": 4, "failed": 2}  # the two-prompt line counts once

    out = {o["custom_id"]: o["response"]["body"]
           for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for cid in ("tool", "think", "two"):
        ChatCompletion.model_validate(out[cid])
    Completion.model_validate(out["complete"])

    tool = out["tool"]["choices"][0]
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["content"] is None
    assert json.loads(tool["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    think = out["think"]
    assert think["choices"][0]["message"]["reasoning_content"] == "Short question, short answer."
    assert think["choices"][0]["message"]["content"] == "Four."
    assert think["usage"]["completion_tokens_details"]["reasoning_tokens"] > 5
    two = out["two"]
    assert [c["finish_reason"] for c in two["choices"]] == ["tool_calls", "tool_calls"]
    assert two["usage"]["completion_tokens"] == 2 * len(answers["two"])
    assert [c["text"] for c in out["complete"]["choices"]] == [" red", " so is"]
    completion_tokens = sum(b["usage"]["completion_tokens"] for b in out.values())
    assert result.summary["completion_tokens"] == completion_tokens  # a line once, all prompts

    errors = {e["custom_id"]: error_of(e) for e in map(
        json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert errors["streamed"]["param"] == "stream"
    assert errors["moderate"]["code"] == "unsupported_endpoint"
