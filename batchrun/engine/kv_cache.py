"""Paged KV block pool with automatic prefix caching.

Full blocks are keyed by a hash chained over (parent block hash, the block's token ids, the
content hashes of images whose placeholder tokens the block holds); the
first block's parent is the request's cache salt (its LoRA adapter's, None for the base model),
so the same prompt under two adapters never shares a block. A freed
block keeps its hash and sits in an LRU free list, so a later request with the same prefix can
take it back; allocating a new block evicts the least recently freed one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable

from batchrun.engine.request import Request


def block_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def request_block_hash(req: Request, parent: bytes | None, i: int, bs: int) -> bytes:
    """The hash of req's block i: its tokens, and the content hashes of the images whose
    placeholder tokens it holds (the same placeholders stand for any image)."""
    extra = req.multimodal.block_key(i * bs, (i + 1) * bs) if req.multimodal else b""
    return block_hash(parent, req.all_token_ids[i * bs:(i + 1) * bs], extra)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Called with each hash the cache forgets (engine/score_cache.py keeps data beside it).
        self._eviction_listeners: list[Callable[[bytes], None]] = []
        self.peak_used = 0

    def add_eviction_listener(self, listener: Callable[[bytes], None]) -> None:
        self._eviction_listeners.append(listener)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self.cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, req: Request,
                     accept: Callable[[int, bytes], bool] | None = None) -> int:
        """Attach cached blocks for the longest cached prefix of req; returns tokens matched.

        The last token is never matched: a step must compute something to sample from.
        `accept(i, hash)`, called for each hit in order, can end the match before block i.
        """
        if not self.enable_prefix_caching:
            return 0
        tokens, bs = req.all_token_ids, self.block_size
        parent = req.cache_salt
        matched: list[int] = []
        hashes: list[bytes] = []
        for i in range((len(tokens) - 1) // bs):
            h = request_block_hash(req, parent, i, bs)
            block = self.cached.get(h)
            if block is None or (accept is not None and not accept(i, h)):
                break
            matched.append(block)
            hashes.append(h)
            parent = h
        for block in matched:
            if self.ref_cnt[block] == 0:
                del self.free[block]
            self.ref_cnt[block] += 1
        req.block_ids = matched
        req.block_hashes = hashes
        self._note_usage()
        return len(matched) * bs

    def prompt_hashes(self, req: Request) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (computed once per request)."""
        if req.prompt_hashes is None:
            hashes: list[bytes] = []
            bs = self.block_size
            for i in range(req.num_prompt_tokens // bs):
                hashes.append(request_block_hash(req, hashes[-1] if hashes else req.cache_salt,
                                                 i, bs))
            req.prompt_hashes = hashes
        return req.prompt_hashes

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make req's block table cover num_tokens tokens; False (nothing taken) if the pool is short."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            self._forget_hash(block)
            self.ref_cnt[block] = 1
            req.block_ids.append(block)
        self._note_usage()
        return True

    def fork(self, src: Request, dst: Request) -> tuple[int, int] | None | bool:
        """Give dst src's computed KV: full blocks shared, the partial tail block copied.

        Returns (src block, dst block) to copy, None when nothing needs copying, False when the
        pool has no block for the copy (dst then gets nothing and recomputes later).
        """
        full = src.num_computed_tokens // self.block_size
        partial = src.num_computed_tokens % self.block_size
        copy = None
        if partial:
            if not self.free:
                return False
            block, _ = self.free.popitem(last=False)
            self._forget_hash(block)
            self.ref_cnt[block] = 1
            copy = (src.block_ids[full], block)
        shared = src.block_ids[:full]
        for block in shared:
            self.ref_cnt[block] += 1
        dst.block_ids = shared + ([copy[1]] if copy else [])
        dst.block_hashes = list(src.block_hashes[:full])
        self._note_usage()
        return copy

    def _forget_hash(self, block: int) -> None:
        old = self.hash_of[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
                for listener in self._eviction_listeners:
                    listener(old)
            self.hash_of[block] = None

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of req's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(req.num_computed_tokens, req.num_tokens) // bs
        for i in range(len(req.block_hashes), full):
            parent = req.block_hashes[-1] if req.block_hashes else req.cache_salt
            h = request_block_hash(req, parent, i, bs)
            req.block_hashes.append(h)
            block = req.block_ids[i]
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h

    def free_request(self, req: Request) -> None:
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for block in reversed(req.block_ids):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None
        req.block_ids = []
        req.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (all blocks must be free)."""
        assert len(self.free) == self.num_blocks, "reset_prefix_cache with blocks in use"
        for listener in self._eviction_listeners:
            for h in self.cached:
                listener(h)
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks

    def _note_usage(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used_blocks)
