"""`batchrun run --chat-template / --tool-parser / --reasoning-parser` reach the adapter (fake
engine, so this runs in a second); the real-model run is in tests/integration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from batchrun.openai.serving import ServingOptions
from tests.openai_batch_shape import error_of

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "batchrun/openai/templates/chatml_tools.jinja"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def run(tmp_path, *options, tools=True):
    src = tmp_path / "in.jsonl"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if tools:
        body["tools"] = [TOOL]
    src.write_text(json.dumps({"custom_id": "a", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.fake_batchrun", "run", src, "-o",
                           tmp_path / "out.jsonl", "-q", "--restart", *map(str, options)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    read = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    return proc, read


def test_tools_need_a_template_that_renders_them(tmp_path):
    proc, read = run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    (error,) = read("out.errors.jsonl")
    assert error_of(error)["param"] == "tools" and "--chat-template" in error_of(error)["message"]


def test_chat_template_and_parsers_are_taken(tmp_path):
    # The fake engine's tokenizer does not run templates: the template's effect on the prompt
    # is shown on the real model (tests/integration/test_openai_real.py).
    proc, read = run(tmp_path, "--chat-template", TEMPLATE, "--tool-parser", "hermes",
                     "--reasoning-parser", "qwen3", tools=False)
    assert proc.returncode == 0, proc.stderr
    (line,) = read("out.jsonl")
    body = line["response"]["body"]
    assert body["choices"][0]["message"]["reasoning_content"] is None  # the parser ran
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_bad_options_are_usage_errors(tmp_path):
    proc, _ = run(tmp_path, "--chat-template", tmp_path / "missing.jinja")
    assert proc.returncode == 2 and "chat template file not found" in proc.stderr
    proc, _ = run(tmp_path, "--tool-parser", "nope")
    assert proc.returncode == 2 and "--tool-parser" in proc.stderr


def test_job_spec_takes_the_openai_options(tmp_path):
    from batchrun.batch.shell import jobspec

    (tmp_path / "t.jinja").write_text("{{ messages }}")
    spec = tmp_path / "job.toml"
    spec.write_text('input = "in.jsonl"\noutput = "out.jsonl"\nchat_template = "t.jinja"\n'
                    'tool_parser = "hermes"\nreasoning_parser = "qwen3"\n')
    opts = jobspec.load(str(spec))
    assert opts.openai.chat_template == str(tmp_path / "t.jinja")
    assert ServingOptions.of(opts.openai).chat_template == "{{ messages }}"
    assert (opts.openai.tool_parser, opts.openai.reasoning_parser) == ("hermes", "qwen3")


def test_validate_checks_tools_against_the_chat_template(tmp_path, smol_tokenizer):
    src = tmp_path / "tools.jsonl"
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    src.write_text(json.dumps({"custom_id": "a", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n")
    cmd = [sys.executable, "-m", "tests.fake_batchrun", "validate", str(src), "--check-prompts"]
    bare = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 3 and "--chat-template" in bare.stdout
    ok = subprocess.run(cmd + ["--chat-template", str(TEMPLATE)], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
