"""Prompt-logprob entries of cached KV blocks (engine/prompt_logprobs.py), keyed by the block's
hash and dropped when the KV cache evicts that hash, so a later prefix hit still knows them."""

from __future__ import annotations

from typing import Callable

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.prompt_logprobs import BlockScores
from batchrun.engine.request import Request


class ScoreCache:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._entries: dict[bytes, BlockScores] = {}
        kv.add_eviction_listener(self.drop)

    def drop(self, block_hash: bytes) -> None:
        self._entries.pop(block_hash, None)

    def prefix_filter(self, req: Request) -> Callable[[int, bytes], bool] | None:
        """For KVCacheManager.match_prefix: a scoring request takes a cached block only if its
        entries are known too (it adopts them); None for other requests."""
        scores = req.scores
        if scores is None:
            return None
        bs = self.kv.block_size
        return lambda i, h: scores.adopt(i, bs, self._entries.get(h))

    def publish(self, req: Request) -> None:
        """Offer the entries of req's newly full, cached blocks (more top-k wins)."""
        scores, bs = req.scores, self.kv.block_size
        assert scores is not None  # the caller publishes scoring requests only
        full = min(len(req.block_hashes), scores.filled // bs)
        for i in range(scores.published, full):
            h = req.block_hashes[i]
            old = self._entries.get(h)
            if self.kv.is_cached(h) and (old is None or old.k < scores.k):
                self._entries[h] = scores.block(i, bs)
        scores.published = max(scores.published, full)
