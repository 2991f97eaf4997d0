"""One request's failure inside a step (sampling, grammar, detokenising) fails that request;
the engine and every other request in the same steps run on to the same result."""

import pytest
import torch

from batchrun.engine import SamplingParams
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {f"r{i}": torch.randint(3, 512, (5 + 7 * i,), generator=torch.Generator()
                                  .manual_seed(i)).tolist() for i in range(5)}


def run_all(engine, params=GREEDY):
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    _, engine = tiny_engine("llama", tmp_path_factory.mktemp("clean"))
    return {rid: out.outputs[0].token_ids for rid, out in run_all(engine).items()}


def assert_others_unharmed(done, clean, victim):
    assert set(done) == set(PROMPTS)
    assert done[victim].error and "internal error" in done[victim].error
    for rid, out in done.items():
        if rid != victim:
            assert out.error is None and out.outputs[0].token_ids == clean[rid], rid


def test_a_sampling_failure_mid_step_fails_only_that_request(tmp_path, clean):
    _, engine = tiny_engine("llama", tmp_path)
    real = type(engine.sampler).__call__
    calls = {"n": 0}

    def flaky(self, logits, rows):
        calls["n"] += 1
        # The victim raises on its fourth step: the batch fails, then the victim alone does.
        if any(r.request_id == "r2" and r.num_output_tokens == 3 for r in rows):
            raise RuntimeError("injected sampler fault")
        return real(self, logits, rows)
    type(engine.sampler).__call__ = flaky
    try:
        done = run_all(engine)
    finally:
        type(engine.sampler).__call__ = real
    assert_others_unharmed(done, clean, "r2")
    assert "injected sampler fault" in done["r2"].error
    assert len(done["r2"].outputs[0].token_ids) == 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # its KV blocks were freed


def test_a_detokenizer_failure_fails_only_that_request(tmp_path, clean):
    _, engine = tiny_engine("llama", tmp_path)
    # A stop string gives every request a detokenizer (one that never matches).
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["\x00never\x00"])
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    victim = engine.groups["r3"].members[0].detokenizer
    real, seen = victim.add, []

    def add(token):
        seen.append(token)
        if len(seen) == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(token)
    victim.add = add
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert_others_unharmed(done, clean, "r3")
    assert engine.step() == [] and not engine.has_unfinished_requests()
    engine.add_request("after", PROMPTS["r0"], GREEDY)  # the engine still serves
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].token_ids == clean["r0"]
