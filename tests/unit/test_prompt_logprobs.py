"""Prompt logprobs on a tiny random model against transformers' log_softmax of the same tokens:
cold, from the prefix cache, under chunked prefill, preemption, n > 1 and max_tokens=0."""

import math

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.prompt_logprobs import score_rows
from tests.helpers import tiny_engine

K = 3
SCORE = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=K)


def prompts(seed=5, lengths=(2, 9, 40, 63, 64, 130)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def shared_prefix_prompts():
    """A 37-token question with four answers of 1-6 tokens, and the question itself."""
    question = prompts(seed=9, lengths=(37,))[0]
    return [question + a for a in ([11], [12, 13], [14, 15, 16, 17, 18, 19], [20, 21, 22])] + \
        [question]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf, _ = tiny_engine("llama", tmp_path_factory.mktemp("ref"))
    return hf


def reference(hf, prompt: list[int]):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp  # row p scores token p + 1


def check(out, hf, prompt, k=K):
    pl = out.prompt_logprobs
    assert pl is not None and pl.token_ids == prompt
    assert len(pl.logprob) == len(prompt)
    assert pl.logprob[0] is None and pl.rank[0] is None and pl.top[0] is None
    ref = reference(hf, prompt)
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        assert abs(pl.logprob[j] - float(row[prompt[j]])) < 1e-4, f"token {j}"
        assert pl.rank[j] == int((row > row[prompt[j]]).sum()) + 1
        ids = [t for t, _ in pl.top[j]]
        assert len(ids) == k
        assert ids == row.topk(k).indices.tolist()
        for t, v in pl.top[j]:
            assert abs(v - float(row[t])) < 1e-4


def run_all(engine, batch, params=SCORE):
    return engine.generate(batch, params)


def test_cold_prompts_match_transformers(tmp_path, models):
    _, engine = tiny_engine("llama", tmp_path, enable_prefix_caching=False)
    batch = prompts()
    for prompt, out in zip(batch, run_all(engine, batch)):
        check(out, models, prompt)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_hits_give_the_cold_answer(tmp_path, models):
    _, engine = tiny_engine("llama", tmp_path)
    batch = shared_prefix_prompts()
    first = run_all(engine, batch)
    again = run_all(engine, batch)  # everything but each prompt's last block from the cache
    for prompt, a, b in zip(batch, first, again):
        check(a, models, prompt)
        check(b, models, prompt)
    assert sum(o.num_cached_tokens for o in first) > 0  # the four answers share the question
    assert all(o.num_cached_tokens >= 36 for o in again)


def test_a_cache_hit_from_a_generation_request_is_recomputed(tmp_path, models):
    """Blocks a plain request cached carry no prompt entries: the scoring request computes
    them itself instead of returning fewer entries."""
    _, engine = tiny_engine("llama", tmp_path)
    prompt = prompts()[3]
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    out = run_all(engine, [prompt])[0]
    check(out, models, prompt)
    assert out.num_cached_tokens == 0
    # Now scored blocks are cached: a hit, same answer; asking for more top entries than the
    # cache kept recomputes them.
    hit = run_all(engine, [prompt])[0]
    assert hit.num_cached_tokens == 60
    check(hit, models, prompt)
    wider = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=0,
                                                     prompt_logprobs=K + 2))[0]
    assert wider.num_cached_tokens == 0
    check(wider, models, prompt, K + 2)


def test_chunked_prefill_and_preemption(tmp_path, models):
    batch = prompts() + shared_prefix_prompts()
    _, chunked = tiny_engine("llama", tmp_path / "chunked", max_num_batched_tokens=7)
    for prompt, out in zip(batch, run_all(chunked, batch)):
        check(out, models, prompt)
    _, small = tiny_engine("llama", tmp_path / "small", num_blocks=48, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=K)
    outs = run_all(small, batch, params)
    assert small.stats.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        check(out, models, prompt)
        assert len(out.outputs[0].token_ids) == 12


def test_generation_after_scoring_and_n_choices(tmp_path, models):
    _, engine = tiny_engine("llama", tmp_path)
    prompt = prompts()[2]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=0, n=3)
    out = engine.generate([prompt], params)[0]
    check(out, models, prompt, k=0)
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    plain = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is None


def test_max_tokens_zero_with_n_and_a_full_context(tmp_path, models):
    _, engine = tiny_engine("llama", tmp_path)
    prompt = prompts(lengths=(256,))[0]  # the tiny model's whole context
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=0, n=2,
                                                   prompt_logprobs=1))[0]
    assert [c.token_ids for c in out.outputs] == [[], []]
    assert all(c.finish_reason == "length" for c in out.outputs)
    check(out, models, prompt, k=1)


def test_score_rows_works_in_row_chunks(monkeypatch):
    import batchrun.engine.prompt_logprobs as pl

    monkeypatch.setattr(pl, "SCORE_ROWS", 4)
    weight = torch.randn(50, 8)
    calls = []

    def logits(h):
        calls.append(h.shape[0])
        return h @ weight.T

    hidden = torch.randn(10, 8)
    targets = torch.randint(0, 50, (10,))
    lp, rank, ids, top = score_rows(logits, hidden, targets, 2)
    assert calls == [4, 4, 2]
    ref = torch.log_softmax(hidden @ weight.T, -1)
    assert torch.allclose(lp, ref.gather(1, targets[:, None])[:, 0], atol=1e-5)
    assert torch.equal(ids, ref.topk(2).indices)
    assert torch.allclose(top, ref.topk(2).values, atol=1e-5)
    assert not math.isnan(float(lp.sum()))
