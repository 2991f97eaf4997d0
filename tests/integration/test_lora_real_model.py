"""LoRA adapters made with peft on the bundled model: greedy output under each, mixed with the
base in the same steps, equals transformers + peft; the CLI and the server select them by the
request's `model`."""

import json

import pytest
from click.testing import CliRunner

from batchrun.engine import SamplingParams
from tests.integration.prompts import PARITY_CHATS, encode
from tests.lora_adapters import make_adapters, reference
from tests.parity import ParityReport, assert_greedy_match
from tests.openai_batch_shape import error_of

pytest.importorskip("peft")
pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def tuned(real_model, hf_real_model, tmp_path_factory):
    """(the bundled model with three peft adapters served on it, {name: (path, peft model)})."""
    from batchrun import llm
    from batchrun.options.engine import EngineConfig

    adapters = make_adapters(hf_real_model, tmp_path_factory.mktemp("adapters"))
    loaded = llm.load(None, EngineConfig.default(
        lora={n: p for n, (p, _) in adapters.items()}, max_loras=3, max_lora_rank=16))
    return loaded, adapters


def test_greedy_output_under_each_adapter_equals_peft_in_a_mixed_batch(tuned, hf_real_model):
    loaded, adapters = tuned
    names = [None, *adapters]
    prompts = [encode(loaded.tokenizer, chat) for chat in PARITY_CHATS[:6]]
    jobs = [(p, names[i % 4]) for i, p in enumerate(prompts * 2)]  # every prompt under two
    slots_per_step = []
    real = loaded.engine.adapters.set_segments
    loaded.engine.adapters.set_segments = lambda s: (slots_per_step.append({x[2] for x in s}),
                                                     real(s))
    try:
        outs = loaded.engine.generate(
            [p for p, _ in jobs], [SamplingParams(temperature=0, max_tokens=MAX_NEW, lora=n)
                                   for _, n in jobs])
    finally:
        loaded.engine.adapters.set_segments = real
    report = ParityReport()
    differs, base = 0, {}
    for i, ((prompt, name), out) in enumerate(zip(jobs, outs)):
        model = hf_real_model if name is None else adapters[name][1]
        ref, logits = reference(model, prompt, MAX_NEW, eos=2)
        assert_greedy_match(out.outputs[0].token_ids, ref, logits, f"{i} {name}", report)
        if name is not None:
            key = tuple(prompt)
            if key not in base:
                base[key] = reference(hf_real_model, prompt, MAX_NEW, eos=2)[0]
            differs += ref != base[key]
    print(f"\nLoRA greedy parity: {report.compared} requests, {report.ties} ties "
          f"{report.tie_positions}")
    assert differs >= 7  # the adapters change the answers
    assert max(len(s) for s in slots_per_step) == 3  # three adapters and the base in one step
    assert loaded.engine.kv.num_free_blocks == loaded.engine.kv.num_blocks


def test_a_batch_file_selects_adapters_by_model_and_an_unknown_one_is_its_lines_error(
        tuned, tmp_path):
    from batchrun.cli import main

    loaded, adapters = tuned
    lines = []
    for i, model in enumerate(["tune0", "smollm2-135m", "tune2", "no-such-tune", "tune1"]):
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": {
                                     "model": model, "max_tokens": 8, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Hi there!"}]}}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    seen = {}

    def load(model, engine_config):
        seen["lora"] = engine_config.lora
        return loaded
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "-q",
            "--max-loras", "3", "--max-lora-rank", "16"]
    for name, (path, _) in adapters.items():
        args += ["--lora", f"{name}={path}"]
    result = CliRunner().invoke(main, args, obj={"load_model": load})
    assert result.exit_code == 0, result.output
    assert seen["lora"].adapters == {n: p for n, (p, _) in adapters.items()}
    out = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").open()]
    assert [e["custom_id"] for e in errors] == ["r3"]
    assert "'no-such-tune'" in error_of(errors[0])["message"]
    bodies = {k: r["response"]["body"] for k, r in out.items()}
    assert [bodies[k]["model"] for k in ("r0", "r1", "r2", "r4")] == \
        ["tune0", "smollm2-135m", "tune2", "tune1"]
    texts = {bodies[k]["choices"][0]["message"]["content"] for k in ("r0", "r1", "r2", "r4")}
    assert len(texts) >= 3  # the adapters answer differently


def test_the_server_lists_adapters_with_their_parent_and_runs_on_them(tuned, tmp_path):
    import httpx

    from tests.server.conftest import API_KEY, serve

    loaded, adapters = tuned
    with serve(loaded, tmp_path / "server") as api:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        cards = httpx.get(api.url + "/v1/models", headers=auth).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [
            ("smollm2-135m", None), *((n, "smollm2-135m") for n in adapters)]
        assert cards[1]["root"] == adapters["tune0"][0]
        body = {"model": "tune1", "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi there!"}]}
        r = httpx.post(api.url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tune1"
        r = httpx.post(api.url + "/v1/chat/completions", json={**body, "model": "tune7"},
                       headers=auth, timeout=60)
        assert r.status_code == 404 and "'tune7'" in r.json()["error"]["message"]
