"""`batchrun run --ray`: the same job over engine replicas on a local Ray instance gives the
single-process output; a replica killed mid-job loses nothing and duplicates nothing; bad
lines are error records; a killed driver resumes from its commits."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from batchrun.batch.job.runner import run_batch  # noqa: E402
from batchrun.distributed.client import RayEngineClient, RayModel  # noqa: E402
from batchrun.options.engine import EngineConfig  # noqa: E402
from batchrun.options.ray import RayOptions  # noqa: E402
from tests.fake_engine import FakeEngine, fake_model  # noqa: E402
from tests.helpers import job_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"
OPTIONS = RayOptions(ray=True, replicas=2, cpus_per_replica=0.5)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def fake_load(model, engine_config):
    return fake_model(FakeEngine(record=False), name=model or "smollm2-135m")


def slow_load(model, engine_config):
    return fake_model(FakeEngine(step_s=0.01, record=False), name=model or "smollm2-135m")


def on_ray(load, options=OPTIONS):
    client = RayEngineClient(options, load, None, EngineConfig())
    return client, RayModel(client, fake_model(name="smollm2-135m"))


def records(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def strip(recs, fake=True):
    """Records without their random ids."""
    out = []
    for r in recs:
        r = dict(r, id=None)
        if r.get("response"):
            body = dict(r["response"]["body"] or {}, id=None, created=None)
            if fake:
                body["system_fingerprint"] = None  # the fake engine has no config to hash
            if body.get("usage"):  # what the prefix cache held depends on earlier requests
                body["usage"] = dict(body["usage"], prompt_tokens_details=None)
            r["response"] = dict(r["response"], request_id=None, body=body)
        out.append(r)
    return out


def test_two_replicas_give_the_single_process_output_bad_lines_included(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text((SAMPLES / "chat.jsonl").read_text() + (SAMPLES / "malformed.jsonl").read_text())
    local = run_batch(fake_model(FakeEngine(record=False), name="smollm2-135m"),
                      job_plan(input=str(src), output=str(tmp_path / "local.jsonl")))
    client, model = on_ray(fake_load)
    try:
        remote = run_batch(model, job_plan(input=str(src), output=str(tmp_path / "ray.jsonl")))
    finally:
        client.shutdown()
    assert remote.requests == local.requests and local.requests.failed > 0
    for suffix in (".jsonl", ".errors.jsonl"):
        assert strip(records(tmp_path / f"ray{suffix}")) == \
            strip(records(tmp_path / f"local{suffix}"))
    assert len(remote.summary["replicas"]) == 2
    # Read at the end of the run, the replicas' counts add up to every request that ran.
    assert sum(r["requests_finished"] for r in remote.summary["replicas"]) == remote.requests.ok


def test_a_replica_killed_mid_job_loses_no_line_and_duplicates_none(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"question {i} " * (i % 7)}],
                 "max_tokens": 5 + i % 10}}) + "\n" for i in range(400)))
    client, model = on_ray(slow_load)
    killed = threading.Event()

    def on_progress(counts):
        if counts.done >= 60 and not killed.is_set():
            killed.set()
            ray.kill(client.replicas[0])

    try:
        # 16 lines in flight at a time: the kill lands mid-job, with requests on both replicas
        result = run_batch(model, job_plan(input=str(src), output=str(tmp_path / "out.jsonl"),
                                           commit_interval=0.05, max_in_flight=16),
                           on_progress=on_progress)
    finally:
        client.shutdown()
    assert killed.is_set() and client.restarts >= 1
    assert result.status == "completed" and result.requests.ok == 400
    ids = [r["custom_id"] for r in records(tmp_path / "out.jsonl")]
    assert ids == [f"r{i}" for i in range(400)]  # each once, in input order


def test_the_greedy_output_of_the_bundled_model_is_the_local_one(tmp_path, real_model):
    from batchrun.commandkit import load_model

    src = tmp_path / "in.jsonl"
    lines = (SAMPLES / "chat.jsonl").read_text().splitlines()[:6]
    src.write_text("".join(json.dumps({**json.loads(x), "body": {
        **json.loads(x)["body"], "temperature": 0, "max_tokens": 12}}) + "\n" for x in lines))
    run_batch(real_model, job_plan(input=str(src), output=str(tmp_path / "local.jsonl")))
    client = RayEngineClient(OPTIONS, load_model, None, EngineConfig())
    try:
        from batchrun.footprint import tokenizer_model

        model = RayModel(client, tokenizer_model(None))
        run_batch(model, job_plan(input=str(src), output=str(tmp_path / "ray.jsonl")))
    finally:
        client.shutdown()
    assert strip(records(tmp_path / "ray.jsonl"), fake=False) == \
        strip(records(tmp_path / "local.jsonl"), fake=False)


def test_a_killed_driver_resumes_from_its_commits(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8}}) + "\n"
        for i in range(300)))
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), BATCHRUN_FAKE_STEP_S="0.02")
    cmd = [sys.executable, "-m", "tests.fake_batchrun", "run", str(src), "-o", str(out),
           "--ray", "--replicas", "2", "--cpus-per-replica", "0.5", "--commit-interval", "0.05",
           "--max-in-flight", "8", "-q"]  # 8 in flight: the run lasts long enough to kill
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    staging = tmp_path / "out.jsonl.batchrun-staging"
    deadline = time.monotonic() + 120
    while not list(staging.glob("part-*")) and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait(30)
    assert not out.exists() and list(staging.glob("part-*"))
    done = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["custom_id"] for r in records(out)] == [f"r{i}" for i in range(300)]


# Gemma 3: its image rows attend both ways (visible_until travels with the request); SmolVLM
# renders like LLaVA and is left to test_vision_batch's serve test (a Ray case costs ~20-50 s).
@pytest.mark.parametrize("family,replicas", [("llava", 2), ("gemma3", 1)])
def test_image_lines_on_replicas_give_the_single_process_output(tmp_path, smol_tokenizer,
                                                                family, replicas):
    """The driver fetches and renders the images; the processor's tensors travel with each
    request to the replica that runs it (tiny random LLaVA on two replicas, Gemma 3 on one;
    data: URLs of several sizes, a repeated image, two images in one line, a broken
    image failing alone)."""
    import base64
    import io

    from batchrun import llm
    from batchrun.footprint import tokenizer_model
    from tests.tiny_vlms import image, make_tiny_vlm

    path = tmp_path / family
    make_tiny_vlm(family, path, smol_tokenizer)

    def data_url(img):
        out = io.BytesIO()
        img.save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    red, blue, green = image(40, 30, 1), image(32, 48, 2), image(50, 50, 3)
    lines = {"red": [red], "blue": [blue], "red-again": [red], "two": [green, blue],
             "green": [green], "broken": ["data:image/png;base64,iVBORw0KGgo="], "text": []}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
        "body": {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": f"Describe picture {cid}."}] + [
            {"type": "image_url", "image_url": {"url": x if isinstance(x, str) else data_url(x)}}
            for x in images]}]}}) + "\n" for cid, images in lines.items()))
    config = EngineConfig.default(block_size=4, num_blocks=512, threads=1)
    local = run_batch(llm.load(str(path), config),
                      job_plan(input=str(src), output=str(tmp_path / "local.jsonl")))
    options = OPTIONS if replicas == 2 else RayOptions(ray=True, replicas=1, cpus_per_replica=1)
    client = RayEngineClient(options, llm.load, str(path), config)
    try:
        model = RayModel(client, tokenizer_model(str(path)))
        remote = run_batch(model, job_plan(input=str(src), output=str(tmp_path / "ray.jsonl")))
    finally:
        client.shutdown()
    assert local.requests.ok == len(lines) - 1 and local.requests.failed == 1
    assert remote.requests == local.requests
    for suffix in (".jsonl", ".errors.jsonl"):
        assert strip(records(tmp_path / f"ray{suffix}"), fake=False) == \
            strip(records(tmp_path / f"local{suffix}"), fake=False)
    assert all(r["requests_finished"] > 0 for r in remote.summary["replicas"])
