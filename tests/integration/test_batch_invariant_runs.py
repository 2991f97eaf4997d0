"""--batch-invariant across runs: a job's records (greedy and seeded sampling, logprobs on) are
the same on one Ray replica, on two and in one process, and a run killed with SIGKILL and
resumed writes the records of an uninterrupted one. A tiny random Llama with the bundled
tokenizer, so the whole job takes seconds."""

import json
import signal
import subprocess
import sys
import time

import pytest

from batchrun.batch.job.runner import run_batch
from batchrun.options.engine import EngineConfig
from batchrun.options.ray import RayOptions
from tests.helpers import ENV, ROOT, job_plan
from tests.tiny_models import make_tiny

LINES = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama", path, vocab_size=len(smol_tokenizer))
    smol_tokenizer.save_pretrained(path)
    return path


def batch_lines() -> str:
    """Chats of different lengths: greedy, seeded top-p and seeded top-k, all with logprobs."""
    samplers = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 3},
                {"temperature": 1.2, "seed": 5}]
    return "".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"question {i} " + "why " * (i % 9)}],
                 "max_tokens": 4 + i % 6, "logprobs": True, "top_logprobs": 2,
                 **samplers[i % 3]}}) + "\n" for i in range(LINES))


def bodies(path) -> dict:
    """custom_id -> the response body's choices: tokens (as text) and logprobs."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["custom_id"]] = record["response"]["body"]["choices"]
    return out


def test_one_replica_two_replicas_and_one_process_give_the_same_records(tmp_path, folder):
    ray = pytest.importorskip("ray")
    from batchrun import llm
    from batchrun.commandkit import load_model
    from batchrun.distributed.client import RayEngineClient, RayModel
    from batchrun.footprint import tokenizer_model

    src = tmp_path / "in.jsonl"
    src.write_text(batch_lines())
    config = EngineConfig.default(batch_invariant=True)
    local = run_batch(llm.load(str(folder), config),
                      job_plan(input=str(src), output=str(tmp_path / "local.jsonl")))
    assert local.summary["batch_invariant"] is True
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for replicas in (1, 2):
            client = RayEngineClient(RayOptions(ray=True, replicas=replicas, cpus_per_replica=1),
                                     load_model, str(folder), config)
            try:
                model = RayModel(client, tokenizer_model(str(folder)))
                run_batch(model, job_plan(input=str(src),
                                          output=str(tmp_path / f"ray{replicas}.jsonl")))
            finally:
                client.shutdown()
    finally:
        ray.shutdown()
    expected = bodies(tmp_path / "local.jsonl")
    assert len(expected) == LINES
    for replicas in (1, 2):
        assert bodies(tmp_path / f"ray{replicas}.jsonl") == expected, f"{replicas} replicas"


def cli_run(src, out, folder, *extra):
    return [sys.executable, "-m", "batchrun", "run", str(src), "-o", str(out), "--model",
            str(folder), "--batch-invariant", "--progress", "none", "--max-in-flight", "4",
            "--commit-interval", "0.05", *extra]


def test_a_killed_and_resumed_run_writes_the_records_of_an_uninterrupted_one(tmp_path, folder):
    src = tmp_path / "in.jsonl"
    src.write_text(batch_lines())
    whole = tmp_path / "whole.jsonl"
    done = subprocess.run(cli_run(src, whole, folder), cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "out.jsonl"
    staging = tmp_path / "out.jsonl.batchrun-staging"
    proc = subprocess.Popen(cli_run(src, out, folder, "--resume"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not list(staging.glob("part-*")) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not out.exists() and list(staging.glob("part-*")), "the kill did not land mid-run"
    resumed = subprocess.run(cli_run(src, out, folder, "--resume"), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "out.metrics.json").read_text())
    assert metrics["resumed"] > 0 and metrics["batch_invariant"] is True
    assert bodies(out) == bodies(whole)
