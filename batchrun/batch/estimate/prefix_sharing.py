"""How many prompt tokens the engine's prefix cache would serve, estimated without a model.

`PrefixSharing` replays the rules of `batchrun.engine.kv_cache.KVCacheManager` on token ids only:

* Only full blocks of `block_size` tokens are cached, and a block's identity is chained: block i
  of a prompt is reusable only if blocks 0..i-1 match too (the engine hashes (parent hash, block
  tokens)).
* The last prompt token is never served from the cache (`match_prefix` looks at the first
  `(len(prompt) - 1) // block_size` blocks only): a prompt of exactly k full blocks that is
  wholly cached still computes its last block; any other prompt computes at least its partial
  tail. An identical prompt of 40 tokens with block_size 4 gets 36 cached tokens.
* Every full block of a prompt is registered once its prefill ran. The blocks after it (the
  partial tail of the prompt, the generated tokens) also take room in the pool, and, when the
  request ends, places in the LRU; they are modelled as blocks no later prompt matches (their
  tokens are unknown before the run, and a later prompt rarely continues an earlier completion
  verbatim). Pass `completion_tokens` to `add` to count the generated ones.
* A prompt needing more blocks than `capacity_blocks` is rejected by the engine (when that is the
  pool size): it counts, with nothing cached and nothing added.
* The cache holds at most `capacity_blocks` blocks; the least recently used goes first. When a
  request finishes the engine frees its blocks deepest first, so a prompt's tail blocks are
  evicted before its shared prefix; the LRU order here follows that.

Memory is O(capacity_blocks) whatever the number of prompts: one dict entry per block.
Block identity is Python's `hash((parent, block_tuple))`: 64 bits, salted per process, cheap
(hashing is the cost: 0.45-0.8 s per 100k prompts of 300 tokens on this project's 2-core
machines, see the figures in the module's tests / the branch report). Collisions (~2^-64 per
pair) are ignored.

The approximation: prompts are replayed one after another, in the order they are added, with
an LRU of `capacity_blocks`. The engine differs in three ways:

1. Reordering: with `group_by_prefix` the engine admits the waiting requests (at most the
   runner's in-flight window) in lexicographic prompt order, so prompts with a shared prefix run
   together even when the file interleaves them. With a cache large enough for the working set
   this does not change the count (every occurrence of a block but the first is a hit, in any
   order); with a small cache and an interleaved file the sequential replay evicts prefixes the
   engine would have kept hot, so it *under*-estimates.
2. Concurrency: requests run together, and the prefix a running request is still prefilling
   is not yet cached. The engine holds back a request whose next block is being computed
   (`Scheduler._waits_for_prefix`), so it is served from the cache a step later: no loss here.
3. Pool pressure: the KV pool also holds the blocks of the running requests (prompt tails and
   generated tokens), which cached-but-free blocks make room for. With
   `capacity_blocks = num_blocks` the replay pretends the whole pool keeps prefixes and
   *over*-estimates under memory pressure; pass `num_blocks - running working set` (about
   concurrency x (prompt + completion) / block_size) for a tighter figure.

A model with sliding-window layers keeps its KV in several groups (engine/kv_groups.py), each
holding its own block of a prompt's tokens: the plan passes the pool divided by the number of
groups as the capacity (a window group hands back blocks behind its window, so this counts
them as held longer than they are: the replay errs towards fewer hits).

For the usual batch shapes (one system prompt or a few few-shot blocks, far smaller than the
pool) the three effects vanish and the replay is exact; see tests/unit/test_prefix_sharing.py,
which compares it with the engine's own counts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

# Default bound on remembered blocks when the pool size is not given: 4M tokens at block_size
# 16, about 30 MB of dict entries. A run's pool is usually far smaller (pass capacity_blocks).
DEFAULT_CAPACITY_BLOCKS = 1 << 18


class PrefixSharing:
    """Replay prompts through a model of the engine's prefix cache; see the module docstring."""

    def __init__(self, block_size: int = 16, capacity_blocks: int | None = None,
                 enabled: bool = True):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity_blocks must not be negative")
        self.block_size = block_size
        self.capacity_blocks = DEFAULT_CAPACITY_BLOCKS if capacity_blocks is None else capacity_blocks
        self.enabled = enabled
        # Block identity (int) -> 1, or a request's unmatchable tail blocks (tuple) -> their
        # count; least recently used first. _blocks is the sum of the weights.
        self._lru: OrderedDict[int | tuple, int] = OrderedDict()
        self._blocks = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._requests = 0
        self.evictions = 0
        self._tails = 0  # counter naming the tail entries

    def add(self, prompt_token_ids: Sequence[int], completion_tokens: int = 0,
            block_key: Callable[[int, int], bytes] | None = None) -> int:
        """Count one prompt; returns how many of its tokens the prefix cache would serve.
        `completion_tokens`: what the request will generate, for the pool room its blocks take
        (0 = count only the prompt's own partial block). `block_key(first, end)`: what else
        the engine mixes into the block over tokens [first, end) (a prompt's images:
        engine.multimodal.MultiModalInputs.block_key)."""
        n = len(prompt_token_ids)
        self._requests += 1
        self._prompt_tokens += n
        if not self.enabled or n == 0 or self.capacity_blocks == 0:
            return 0
        bs = self.block_size
        if -(-n // bs) > self.capacity_blocks:
            return 0  # the engine rejects a prompt its whole pool cannot hold
        # Chained identity of each full block: the zip yields full blocks only.
        hashes: list[int] = []
        parent = 0
        it = iter(prompt_token_ids)
        for i, block in enumerate(zip(*[it] * bs)):
            parent = hash((parent, block) if block_key is None else
                          (parent, block, block_key(i * bs, (i + 1) * bs)))
            hashes.append(parent)
        lru = self._lru
        hits = 0
        for h in hashes[:(n - 1) // bs]:  # the last token is never served
            if h not in lru:
                break
            hits += 1
        # Blocks after the prompt's full ones, as one LRU entry weighing their count: computed
        # tokens are the prompt and the generated ones but the last (sampled, never computed).
        computed = n + max(completion_tokens - 1, 0)
        tail = -(-computed // bs) - len(hashes)
        if tail > 0:
            self._tails += 1
            lru[("tail", self._tails)] = tail
            self._blocks += tail
        # Freed deepest block first, so the prefix ends up most recently used.
        move = lru.move_to_end
        for h in reversed(hashes[hits:]):
            if h in lru:
                move(h)
            else:
                lru[h] = 1
                self._blocks += 1
        for h in reversed(hashes[:hits]):
            move(h)
        while self._blocks > self.capacity_blocks:
            key, weight = lru.popitem(last=False)
            excess = self._blocks - self.capacity_blocks
            if weight > excess:  # part of a tail entry: the rest stays oldest
                lru[key] = weight - excess
                move(key, last=False)
                weight = excess
            self._blocks -= weight
            self.evictions += weight
        cached = hits * bs
        self._cached_tokens += cached
        return cached

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens (0.0 before any prompt), as EngineStats.cache_hit_rate."""
        return self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0

    @property
    def cached_blocks(self) -> int:
        """Blocks the modelled pool holds now (at most capacity_blocks), tail blocks included."""
        return self._blocks
