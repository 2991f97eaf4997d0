"""ScoreCache: a block's prompt entries live exactly as long as the KV cache keeps its hash."""

import torch

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.score_cache import ScoreCache


def scored_request(kv: KVCacheManager, prompt: list[int]) -> Request:
    req = Request("r", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1), max_tokens=0)
    assert kv.allocate(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(req)
    n = len(prompt) - 1
    req.scores.put(1, torch.zeros(n), torch.ones(n, dtype=torch.long),
                   torch.zeros((n, 1), dtype=torch.long), torch.zeros((n, 1)))
    return req


def recache_without_entries(kv: KVCacheManager) -> None:
    """The same prompt blocks computed again by a plain request: no entries come with them."""
    plain = Request("p", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 1)
    assert kv.allocate(plain, 5)
    plain.num_computed_tokens = 5
    kv.cache_full_blocks(plain)
    kv.free_request(plain)


def test_entries_follow_the_block_hashes():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    cache = ScoreCache(kv)
    req = scored_request(kv, [1, 2, 3, 4, 5])
    cache.publish(req)
    again = Request("r2", [1, 2, 3, 4, 9], SamplingParams(max_tokens=0, prompt_logprobs=1), 0)
    hashes = list(req.block_hashes)
    kv.free_request(req)
    # both full blocks are cached with their entries: a scoring request matches and adopts them
    assert kv.match_prefix(again, cache.prefix_filter(again)) == 4 and again.scores.filled == 4
    kv.free_request(again)
    # taking every block evicts the hashes, and their entries with them
    other = Request("o", list(range(100, 106)), SamplingParams(max_tokens=1), 1)
    assert kv.allocate(other, 6)
    assert not any(kv.is_cached(h) for h in hashes)
    kv.free_request(other)
    recache_without_entries(kv)
    late = Request("r3", [1, 2, 3, 4, 9], SamplingParams(max_tokens=0, prompt_logprobs=1), 0)
    assert kv.match_prefix(late, cache.prefix_filter(late)) == 0
    assert cache.prefix_filter(Request("g", [1, 2], SamplingParams(), 1)) is None


def test_reset_forgets_every_entry():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    cache = ScoreCache(kv)
    req = scored_request(kv, [1, 2, 3, 4, 5])
    cache.publish(req)
    kv.free_request(req)
    kv.reset_prefix_cache()
    recache_without_entries(kv)
    late = Request("r3", [1, 2, 3, 4, 9], SamplingParams(max_tokens=0, prompt_logprobs=1), 0)
    assert kv.match_prefix(late, cache.prefix_filter(late)) == 0
