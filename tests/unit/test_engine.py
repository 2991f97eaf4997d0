"""Engine behaviour on a tiny random model: scheduling, paging, caching, stopping, sampling."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.errors import PromptTooLongError
from tests.parity import assert_greedy_match
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts(seed=3, lengths=(5, 17, 40, 3, 64, 9, 30, 12)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, engine = tiny_engine("llama", tmp_path_factory.mktemp("ref"), max_num_batched_tokens=4096,
                            enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in engine.generate(prompts(), GREEDY)]


def run(tmp_path, **overrides):
    _, engine = tiny_engine("llama", tmp_path, **overrides)
    outs = engine.generate(prompts(), GREEDY)
    return engine, [o.outputs[0].token_ids for o in outs]


def assert_same(ours, ref):
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_greedy_match(a, b, None, f"prompt {i}")


def test_chunked_prefill_equals_unchunked(tmp_path, reference):
    engine, outs = run(tmp_path, max_num_batched_tokens=8)
    assert_same(outs, reference)
    assert engine.stats.steps > 20


def test_small_kv_pool_preempts_and_still_matches(tmp_path, reference):
    # 40 blocks of 4 tokens: far less than the 8 requests need together.
    engine, outs = run(tmp_path, num_blocks=40, max_num_batched_tokens=64)
    assert engine.stats.num_preemptions > 0
    assert_same(outs, reference)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_request_that_can_never_fit_fails_cleanly(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, num_blocks=4)
    engine.add_request("big", list(range(3, 40)), GREEDY)
    engine.add_request("small", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outs = {}
    for _ in range(50):
        for o in engine.step():
            outs[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert outs["big"].error and "KV blocks" in outs["big"].error
    assert outs["small"].error is None and len(outs["small"].outputs[0].token_ids) == 4
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_hits_and_matches(tmp_path, reference):
    _, engine = tiny_engine("llama", tmp_path)
    shared = prompts()[4]  # 64 tokens = 16 full blocks
    first = engine.generate([shared + [7, 8]], GREEDY)[0]
    second = engine.generate([shared + [9, 10, 11]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    _, cold = tiny_engine("llama", tmp_path / "cold", enable_prefix_caching=False)
    ref = cold.generate([shared + [9, 10, 11]], GREEDY)[0]
    assert ref.num_cached_tokens == 0
    assert_greedy_match(second.outputs[0].token_ids, ref.outputs[0].token_ids, None, "cached")


def test_last_prompt_token_is_never_cached(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    p = prompts()[2][:40]  # exactly 10 blocks
    engine.generate([p], GREEDY)
    again = engine.generate([p], GREEDY)[0]
    assert again.num_cached_tokens == 36


def test_stop_conditions(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    p = prompts()[1]
    free = engine.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(toks) == 12

    by_id = engine.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks[5]]))[0]
    first = toks.index(toks[5])
    assert by_id.outputs[0].token_ids == toks[:first + 1]
    assert by_id.outputs[0].finish_reason == "stop" and by_id.outputs[0].stop_reason == toks[5]

    stop = f"<{toks[3]}><{toks[4]}>"  # spans two tokens
    by_str = engine.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    full_text = "".join(f"<{t}>" for t in toks)
    assert by_str.outputs[0].text == full_text[:full_text.index(stop)]
    assert by_str.outputs[0].finish_reason == "stop" and by_str.outputs[0].stop_reason == stop


def test_context_length_limits(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, max_model_len=64)
    with pytest.raises(PromptTooLongError):
        engine.add_request("a", list(range(3, 67)), GREEDY)
    with pytest.raises(PromptTooLongError):
        engine.add_request("b", list(range(3, 50)), SamplingParams(max_tokens=30))
    out = engine.generate([list(range(3, 50))], SamplingParams(temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 64 - 47
    assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_independent_of_batch(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    p = prompts()
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = engine.generate([p[0]], seeded)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = engine.generate(p[1:4] + [p[0]] + p[4:], [other] * 3 + [seeded] + [other] * 4)
    assert mixed[3].outputs[0].token_ids == alone
    unseeded = [engine.generate([p[0]], other)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1


def test_abort_frees_blocks(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    engine.add_request("x", prompts()[4], GREEDY)
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    out = engine.abort_request("x")
    assert out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_streaming_outputs_are_cumulative_and_hold_back_stop_prefixes(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    p = prompts()[1]
    toks = engine.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0] \
        .outputs[0].token_ids
    stop = f"<{toks[6]}><{toks[7]}>"
    engine.add_request("s", p, SamplingParams(temperature=0, max_tokens=12, stop=[stop]), stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    texts = [o.outputs[0].text for o in seen]
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all(stop not in t and not t.endswith(f"<{toks[6]}>") for t in texts)
    assert texts[-1] == "".join(f"<{t}>" for t in toks[:6])
    assert seen[-1].outputs[0].finish_reason == "stop"


def test_priority_admits_interactive_work_first(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, max_num_seqs=1, group_by_prefix=False)
    p = prompts()
    for i in range(3):
        engine.add_request(f"batch{i}", p[i], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           priority=1)
    engine.step()  # batch0 is running now
    engine.add_request("live", p[3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step()]
    assert order == ["batch0", "live", "batch1", "batch2"]


def test_preemption_takes_lowest_priority_first(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, num_blocks=24, max_num_batched_tokens=256)
    p = prompts()
    engine.add_request("live", p[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("batch", p[5][:20], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       priority=1)
    preempted = []
    while engine.has_unfinished_requests():
        plan_before = engine.scheduler.num_preemptions
        engine.step()
        if engine.scheduler.num_preemptions > plan_before:
            preempted.append(engine.scheduler.waiting.peek().request_id)
    assert preempted and set(preempted) == {"batch"}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_n_choices_share_one_prefill(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    p = prompts()[4][:42]  # 10 full blocks + a partial one, copied on fork
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = engine.generate([p], seeded)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert engine.stats.prefill_tokens == len(p)  # the prompt was computed once, not three times
    choices = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(choices)) == 3 and all(len(c) == 10 for c in choices)
    again = engine.generate([p], seeded)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == choices
    single = engine.generate([p], SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert tuple(single.outputs[0].token_ids) == choices[0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_n_greedy_choices_match_and_streams_carry_indices(tmp_path):
    _, engine = tiny_engine("llama", tmp_path)
    p = prompts()[1]
    single = engine.generate([p], GREEDY)[0].outputs[0].token_ids
    engine.add_request("g", p, SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True), stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    final = seen[-1]
    assert final.finished and [c.token_ids for c in final.outputs] == [single, single]
    assert {o.outputs[0].index for o in seen[:-1]} == {0, 1}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_n_choices_under_kv_pressure(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, num_blocks=30, max_num_batched_tokens=64)
    p = prompts()
    params = SamplingParams(n=4, temperature=0, max_tokens=20, ignore_eos=True)
    outs = engine.generate([p[2], p[6]], params)
    _, roomy = tiny_engine("llama", tmp_path / "roomy")
    ref = roomy.generate([p[2], p[6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert engine.stats.num_preemptions > 0
    for out, r in zip(outs, ref):
        for choice in out.outputs:
            assert_greedy_match(choice.token_ids, r.outputs[0].token_ids, None, f"choice {choice.index}")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_grouping_admits_shared_prefixes_together(tmp_path):
    gen = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(3, 512, (48,), generator=gen).tolist() for _ in range(3)]
    reqs = [prefixes[i % 3] + torch.randint(3, 512, (5,), generator=gen).tolist() for i in range(12)]
    _, engine = tiny_engine("llama", tmp_path, max_num_seqs=2, num_blocks=40)
    outs = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    order = sorted(range(12), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert sum(1 for a, b in zip(order, order[1:]) if a % 3 != b % 3) == 2  # one run per prefix
    # Only the first request of each prefix computes it, even those admitted in the same step.
    assert sorted(o.num_cached_tokens for o in outs) == [0] * 3 + [48] * 9


def test_same_prefix_submitted_together_is_computed_once(tmp_path):
    _, engine = tiny_engine("llama", tmp_path, max_num_batched_tokens=16)
    shared = prompts()[4]  # 64 tokens: four 16-token chunks
    outs = engine.generate([shared + [7], shared + [8], shared + [9]], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64]
    assert engine.stats.prefill_tokens == 65 + 1 + 1
