"""Pooled embeddings (engine/pooling.py) on a tiny random model against the same pooling over
transformers' final hidden states: alone, batched, repeated, sharing a prefix, from the prefix
cache, under chunked prefill and preemption, beside generation requests."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.pooling import PoolingParams
from tests.helpers import tiny_engine


def embed(kind="last", normalize=True):
    return SamplingParams(max_tokens=0, pooling=PoolingParams(kind, normalize))


def prompts(seed=3, lengths=(1, 2, 9, 40, 63, 64, 130)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def shared_prefix_prompts():
    stem = prompts(seed=8, lengths=(37,))[0]
    return [stem + tail for tail in ([11], [12, 13], [14, 15, 16, 17, 18, 19])] + [stem]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    model, _ = tiny_engine("llama", tmp_path_factory.mktemp("ref"))
    return model


def reference(hf, prompt, kind, normalize=True):
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    states = out.hidden_states[-1][0].float()  # after the final norm
    v = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[kind]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def check(got, want):
    got = torch.tensor(got)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.99999
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_final_hidden_state_is_what_the_lm_head_reads(hf):
    ids = torch.tensor([prompts()[3]])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        torch.testing.assert_close(hf.lm_head(out.hidden_states[-1]), out.logits)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_alone_and_batched_match_transformers(tmp_path, hf, kind):
    _, engine = tiny_engine("llama", tmp_path)
    ps = prompts()
    alone = [engine.generate([p], embed(kind))[0] for p in ps]
    batched = engine.generate(ps, embed(kind))
    for p, a, b in zip(ps, alone, batched):
        want = reference(hf, p, kind)
        check(a.embedding, want)
        check(b.embedding, want)
        assert a.outputs[0].token_ids == [] and a.error is None
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_repeated_and_shared_prefix_inputs(tmp_path, hf, kind):
    """The same input twice and inputs sharing a 37-token stem, in one batch and then again
    (warm prefix cache): every vector equals a lone run's. `last` takes cached blocks, mean
    and cls take none."""
    _, engine = tiny_engine("llama", tmp_path)
    ps = shared_prefix_prompts()
    ps = ps + [ps[0]]
    first = engine.generate(ps, embed(kind))
    second = engine.generate(ps, embed(kind))
    for p, a, b in zip(ps, first, second):
        want = reference(hf, p, kind)
        check(a.embedding, want)
        check(b.embedding, want)
    cached = sum(o.num_cached_tokens for o in second)
    assert (cached > 0) if kind == "last" else (cached == 0)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_chunked_prefill_and_preemption(tmp_path, hf, kind):
    ps = prompts(lengths=(9, 40, 63, 130, 77, 50))
    _, chunked = tiny_engine("llama", tmp_path / "chunked", max_num_batched_tokens=7)
    for p, o in zip(ps, chunked.generate(ps, embed(kind))):
        check(o.embedding, reference(hf, p, kind))
    _, small = tiny_engine("llama", tmp_path / "small", num_blocks=48, max_num_batched_tokens=64)
    gen = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = small.generate(ps + ps, [gen] * len(ps) + [embed(kind)] * len(ps))
    assert small.stats.num_preemptions > 0
    for p, o in zip(ps, outs[len(ps):]):
        check(o.embedding, reference(hf, p, kind))


def test_mixed_with_generation_and_unnormalised(tmp_path, hf):
    _, engine = tiny_engine("llama", tmp_path)
    ps = prompts(lengths=(12, 30))
    gen = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    alone = engine.generate(ps, gen)
    outs = engine.generate(ps + ps, [gen, gen, embed("mean", False), embed("last", False)])
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in alone]
    assert outs[0].embedding is None
    check(outs[2].embedding, reference(hf, ps[0], "mean", normalize=False))
    check(outs[3].embedding, reference(hf, ps[1], "last", normalize=False))


def test_token_logits_under_chunked_prefill_equal_transformers(tmp_path, hf):
    """PoolingParams(token_ids=...): the LM head's logits of those tokens at the last position
    (what --score-tokens reads), also when the prompt is computed in chunks."""
    ids = (7, 300, 11)
    params = SamplingParams(max_tokens=0, pooling=PoolingParams("last", False, token_ids=ids))
    ps = prompts(lengths=(9, 40, 63))
    _, chunked = tiny_engine("llama", tmp_path, max_num_batched_tokens=7)
    for p, o in zip(ps, chunked.generate(ps, params)):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1, list(ids)]
        torch.testing.assert_close(torch.tensor(o.embedding), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not both"):
        PoolingParams("last", False, head=True, token_ids=ids)


def test_pooling_needs_prefill_only(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    with pytest.raises(ValueError, match="max_tokens=0"):
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=3, pooling=PoolingParams()))
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("max")
