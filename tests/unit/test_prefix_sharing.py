"""PrefixSharing: exact counts on constructed prompts, and against the engine's own counts."""

import random
import time

import pytest
import torch

from batchrun.batch.estimate.prefix_sharing import PrefixSharing
from batchrun.engine import SamplingParams
from tests.unit.test_native_model import tiny_engine


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_shared_system_prompt_counts_full_blocks_only():
    ps = PrefixSharing(block_size=16)
    system = toks(50, 1)  # 3 full blocks + 2 tokens
    assert ps.add(system + toks(20, 2)) == 0
    assert ps.add(system + toks(20, 3)) == 48  # the partial 4th block differs after token 50
    assert ps.add(system + toks(20, 3)) == 64  # identical: 70 tokens, 4 full blocks, the 5th partial
    assert (ps.requests, ps.prompt_tokens, ps.cached_tokens) == (3, 210, 112)
    assert ps.hit_rate == pytest.approx(112 / 210)


def test_identical_block_aligned_prompt_still_computes_its_last_block():
    ps = PrefixSharing(block_size=4)
    p = toks(40, 4)  # exactly 10 blocks
    assert ps.add(p) == 0
    assert ps.add(p) == 36  # as the engine: the last token is never served from the cache
    assert ps.add(p[:39]) == 36
    assert ps.add(p + [7]) == 40  # 41 tokens: all 10 full blocks may match
    assert ps.add(p[:4]) == 0  # one block: (4 - 1) // 4 = 0 blocks may match
    assert ps.add(p[:5]) == 4


def test_chained_identity_and_short_prompts():
    ps = PrefixSharing(block_size=4)
    a = toks(16, 5)
    ps.add(a)
    b = [999] + a[1:]  # first block differs: nothing after it can match either
    assert ps.add(b + [1]) == 0
    assert ps.add(a[:3]) == 0  # shorter than a block
    assert ps.add([]) == 0
    assert ps.requests == 4


def test_lru_eviction_with_tiny_capacity():
    ps = PrefixSharing(block_size=4, capacity_blocks=3)
    a, b = toks(8, 6) + [1], toks(8, 7) + [1]  # 2 full blocks + 1 tail block each
    ps.add(a)
    assert ps.cached_blocks == 3
    assert ps.add(a) == 8  # still there
    ps.add(b)  # a's blocks go, least recently used first
    assert ps.add(a) == 0
    assert ps.evictions > 0 and ps.cached_blocks <= 3


def test_tail_blocks_are_evicted_before_the_shared_prefix():
    ps = PrefixSharing(block_size=4, capacity_blocks=4)
    system = toks(8, 8)
    ps.add(system + toks(4, 9) + [1])  # blocks: S0 S1 X + tail; LRU oldest first: tail X S1 S0
    ps.add(toks(4, 10) + [1])  # one new block + tail: evicts the old tail and X
    assert ps.add(system + toks(4, 9) + [1]) == 8


def test_disabled_and_zero_capacity_cache_nothing():
    p = toks(64, 11)
    for ps in (PrefixSharing(enabled=False), PrefixSharing(capacity_blocks=0)):
        ps.add(p)
        assert ps.add(p) == 0 and ps.prompt_tokens == 128


def test_memory_is_bounded_by_capacity():
    ps = PrefixSharing(block_size=16, capacity_blocks=100)
    for i in range(500):
        ps.add(toks(64, 100 + i))
    assert ps.cached_blocks == 100


def test_speed_is_recorded_not_asserted(capsys):
    """Prints the replay speed for the report; no timed assertion (shared machines)."""
    system = toks(200, 12)
    prompts = [system + toks(100, 1000 + i) for i in range(5000)]
    ps = PrefixSharing(block_size=16, capacity_blocks=6000)
    start = time.perf_counter()
    for p in prompts:
        ps.add(p, 128)
    per_100k = (time.perf_counter() - start) * 100_000 / len(prompts)
    with capsys.disabled():
        print(f"\nPrefixSharing: {per_100k:.2f} s per 100k prompts of 300 tokens")
    assert ps.hit_rate == pytest.approx(192 * (len(prompts) - 1) / (300 * len(prompts)))


def engine_workload():
    """Prompts with a shared system prompt, few-shot blocks, duplicates and block-aligned ones."""
    rng = random.Random(13)
    system, shots = toks(37, 20), [toks(22, 21), toks(30, 22)]
    out = []
    for i in range(24):
        kind = rng.randrange(4)
        if kind == 0:
            p = system + toks(rng.randrange(1, 30), 200 + i)
        elif kind == 1:
            p = system + shots[i % 2] + toks(rng.randrange(1, 12), 300 + i)
        elif kind == 2 and out:
            p = list(out[rng.randrange(len(out))])  # a duplicate line
        else:
            p = toks(4 * rng.randrange(2, 12), 400 + i)  # block-aligned, unrelated
        out.append(p)
    out.append(list(out[-1]))
    return out


PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("num_blocks", [None, 24, 18])
def test_matches_the_engine_run_in_order(tmp_path, num_blocks):
    """One request at a time through the real engine: the replay gives its exact counts, with a
    roomy pool and with one so small that blocks get evicted."""
    overrides = {} if num_blocks is None else {"num_blocks": num_blocks}
    _, engine = tiny_engine("llama", tmp_path, **overrides)  # block_size 4
    prompts = engine_workload()
    ps = PrefixSharing(block_size=4, capacity_blocks=engine.kv.num_blocks)
    estimated = [ps.add(p, PARAMS.max_tokens) for p in prompts]
    measured = [engine.generate([p], PARAMS)[0].num_cached_tokens for p in prompts]
    assert estimated == measured
    assert ps.cached_tokens == engine.stats.cached_tokens
    assert sum(measured) > 0
    if num_blocks is not None:
        assert ps.evictions > 0


def test_close_to_the_engine_run_all_at_once(tmp_path):
    """All requests in the engine together (group_by_prefix reorders them, running requests hold
    blocks): the total matches with a roomy pool."""
    _, engine = tiny_engine("llama", tmp_path)
    prompts = engine_workload()
    ps = PrefixSharing(block_size=4, capacity_blocks=engine.kv.num_blocks)
    for p in prompts:
        ps.add(p, PARAMS.max_tokens)
    outs = engine.generate(prompts, PARAMS)
    measured = sum(o.num_cached_tokens for o in outs)
    assert measured == engine.stats.cached_tokens
    assert abs(ps.cached_tokens - measured) <= 0.05 * measured
