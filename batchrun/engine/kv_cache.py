"""Paged KV block pool with automatic prefix caching.

Full blocks are keyed by a hash chained over (parent block hash, the block's token ids, the
content hashes of images whose placeholder tokens the block holds); the
first block's parent is the request's cache salt (its LoRA adapter's, None for the base model),
so the same prompt under two adapters never shares a block. A freed
block keeps its hash and sits in an LRU free list, so a later request with the same prefix can
take it back; allocating a new block evicts the least recently freed one.

The model's layers come in KV groups (kv_groups.py): a request holds one block table per group
(`req.block_ids[g]`), all from the one pool. A sliding-window group hands back the blocks that
lie wholly before the first position its next query tokens can attend (FREED marks them in
the table); a freed block keeps its hash like any other. A prefix-cache hit at block m needs,
in the full groups, blocks 0..m-1 cached, and in a window group only those holding the window
before the first uncomputed token: the hit is shortened to the longest prefix every group
holds, so no freed block is ever read.

A model whose layers keep recurrent state (state_slots.py) also holds one state slot per
running sequence, taken with its first blocks and handed back with them; the scheduler sees one
`allocate` that succeeds only when both the blocks and a slot are there. A block's KV does not
give back the state at its end, so such a model's prefix hits end at a state checkpoint
(state_checkpoints.py: `checkpoints`, the pool the engine builds when the model's layers write
them; without one its prefix cache is off): `plan_checkpoints` picks the boundaries a step's
chunk passes, `cache_full_blocks` makes them hits once the step has run, and a hit sets the
request's `state_source`, the checkpoint the runner copies into its slot.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Literal

from batchrun.engine.kv_groups import KVGroups
from batchrun.engine.request import Request
from batchrun.engine.state_checkpoints import CheckpointPool
from batchrun.engine.state_slots import StateSlots

FREED = -1  # a block-table entry a window group has handed back


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: KVGroups | None = None, states: StateSlots | None = None,
                 checkpoints: CheckpointPool | None = None):
        self.num_blocks = num_blocks
        self.states = states  # a stateful model's state slots; None for attention only
        self.checkpoints = checkpoints  # its state checkpoints (prefix hits); None: no hits
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups or KVGroups.single()
        self.windows = self.groups.windows
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[tuple[int, bytes] | None] = [None] * num_blocks  # (group, hash)
        self.cached: list[dict[bytes, int]] = [{} for _ in self.windows]  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Called with each hash group 0 forgets (engine/score_cache.py keeps data beside it).
        self._eviction_listeners: list[Callable[[bytes], None]] = []
        if checkpoints is not None:  # a checkpoint without its blocks is never a hit
            self._eviction_listeners.append(checkpoints.drop)
        self.peak_used = 0

    def add_eviction_listener(self, listener: Callable[[bytes], None]) -> None:
        self._eviction_listeners.append(listener)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self.cached[0]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int, chunk: int | None = None) -> int:
        """The most blocks a sequence of num_tokens holds at once (over all groups), computed
        in chunks of at most `chunk` tokens."""
        return self.groups.blocks_per_sequence(num_tokens, self.block_size, chunk)

    def _tables(self, req: Request) -> list[list[int]]:
        if not req.block_ids:
            req.block_ids = [[] for _ in self.windows]
        return req.block_ids

    def window_start(self, req: Request, position: int, window: int) -> int:
        """The first position a window group must still hold for queries from `position` on
        (one earlier for a scoring request, whose step may recompute position - 1)."""
        slack = req.scores is not None and not req.scores.done
        return max(0, position - window + 1 - slack)

    def match_prefix(self, req: Request,
                     accept: Callable[[int, bytes], bool] | None = None) -> int:
        """Attach cached blocks for the longest cached prefix of req; returns tokens matched.

        The last token is never matched: a step must compute something to sample from.
        `accept(i, hash)`, called for each hit in order, can end the match before block i.
        """
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes = self._chain(req, (len(req.all_token_ids) - 1) // bs)
        m = self._longest_hit(req, hashes)
        if accept is not None:
            m = next((i for i in range(m) if not accept(i, hashes[i])), m)
            m = self._longest_hit(req, hashes[:m])
        if self.states is not None:
            m = self._state_hit(req, hashes, m)
            if self._longest_hit(req, hashes[:m]) != m:  # a window group lacks a block there
                m, req.state_source = 0, None
        tables = self._tables(req)
        for g, window in enumerate(self.windows):
            first = 0 if window is None else self.window_start(req, m * bs, window) // bs
            tables[g] = [FREED] * first + [self.cached[g][h] for h in hashes[first:m]]
            for block in tables[g][first:]:
                if self.ref_cnt[block] == 0:
                    del self.free[block]
                self.ref_cnt[block] += 1
        req.block_hashes = hashes[:m]
        self._note_usage()
        return m * bs

    def _state_hit(self, req: Request, hashes: list[bytes], m: int) -> int:
        """The most blocks <= m ending at a state checkpoint (0 without checkpoints, and for a
        scoring request, whose recomputed position would advance the state twice); sets
        req.state_source to that checkpoint."""
        pool = self.checkpoints
        req.state_source = None
        if pool is None or req.scores is not None:
            return 0
        step = pool.interval // self.block_size
        for end in range(m - m % step, 0, -step):
            if pool.has(hashes[end - 1]):
                req.state_source = pool.lookup(hashes[end - 1])
                return end
        return 0

    def next_hit_block(self, cached: int) -> int:
        """The block whose caching would lengthen a hit of `cached` tokens: the next one, or
        for a model with state the one ending at the next checkpoint (a running request
        recomputing the blocks before it leaves no hit a waiting one could take)."""
        if self.checkpoints is None:
            return cached // self.block_size
        interval = self.checkpoints.interval
        return (cached // interval + 1) * interval // self.block_size - 1

    def plan_checkpoints(self, req: Request, n: int) -> None:
        """The state checkpoints req's next n tokens pass (prompt positions only), each
        given a slot unless it is kept already: req.checkpoint_writes."""
        pool = self.checkpoints
        if pool is None or req.rescore:
            return
        start, end = req.num_computed_tokens, min(req.num_computed_tokens + n,
                                                  req.num_prompt_tokens)
        hashes = self.prompt_hashes(req)
        for position in range((start // pool.interval + 1) * pool.interval, end + 1,
                              pool.interval):
            block_hash = hashes[position // self.block_size - 1]
            slot = pool.plan(block_hash)
            if slot is not None:
                req.checkpoint_writes.append((position, slot, block_hash))

    def _settle_checkpoints(self, req: Request) -> None:
        """req's step has run: its planned checkpoints are hits from now on."""
        if self.checkpoints is not None:
            for position, _, block_hash in req.checkpoint_writes:
                if position <= req.num_computed_tokens:
                    self.checkpoints.commit(block_hash)
                else:
                    self.checkpoints.cancel(block_hash)
        req.checkpoint_writes = []

    def _chain(self, req: Request, n: int) -> list[bytes]:
        """The chained hashes of req's first n blocks, stopping at the first block a full
        group does not cache (no hit can reach past it)."""
        full = [g for g, w in enumerate(self.windows) if w is None]
        hashes: list[bytes] = []
        parent = req.cache_salt
        for i in range(n):
            parent = request_block_hash(req, parent, i, self.block_size)
            if any(parent not in self.cached[g] for g in full):
                break
            hashes.append(parent)
        return hashes

    def _longest_hit(self, req: Request, hashes: list[bytes]) -> int:
        """The most blocks m <= len(hashes) whose window blocks every window group caches
        (the full groups cache all of `hashes`)."""
        for m in range(len(hashes), 0, -1):
            if all(h in self.cached[g]
                   for g, w in enumerate(self.windows) if w is not None
                   for h in hashes[self.window_start(req, m * self.block_size, w)
                                   // self.block_size:m]):
                return m
        return 0

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
        """Make req's block tables cover num_tokens tokens (after handing back the window
        groups' blocks its next query tokens cannot see); False (nothing taken) if the pool is
        short."""
        tables = self._tables(req)
        self.release_behind_window(req)
        full = -(-num_tokens // self.block_size)
        need = [max(0, full - len(t)) for t in tables]
        if sum(need) > len(self.free) or not self._slot_available(req):
            return False
        for table, n in zip(tables, need):
            for _ in range(n):
                table.append(self._take())
        if self.states is not None and req.state_slot is None:
            req.state_slot = self.states.take()
        self._note_usage()
        return True

    def _slot_available(self, req: Request) -> bool:
        return self.states is None or req.state_slot is not None or self.states.num_free > 0

    def release_behind_window(self, req: Request) -> None:
        """Hand back the window groups' blocks wholly before the window of req's next query
        token (position num_computed_tokens), oldest first: the pool evicts those first, and
        keeps the blocks nearest the window for a later prefix hit."""
        for table, window in zip(req.block_ids, self.windows):
            if window is None:
                continue
            end = min(self.window_start(req, req.num_computed_tokens, window) // self.block_size,
                      len(table))
            start = end
            while start > 0 and table[start - 1] != FREED:  # the freed entries are a prefix
                start -= 1
            for i in range(start, end):
                self._release(table[i])
                table[i] = FREED

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        self._forget_hash(block)
        self.ref_cnt[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free[block] = None

    def fork(self, src: Request, dst: Request) -> list[tuple[int, int]] | Literal[False]:
        """Give dst src's computed KV: full blocks shared, each group's partial tail block
        copied.

        Returns the (src block, dst block) pairs to copy, False when the pool has no blocks
        for the copies or no state slot for dst (dst then gets nothing and recomputes later).
        A stateful model's dst gets a slot of its own: the caller copies src's state into it.
        """
        full = src.num_computed_tokens // self.block_size
        partial = src.num_computed_tokens % self.block_size
        if partial and len(self.free) < len(self.windows) or not self._slot_available(dst):
            return False
        if self.states is not None and dst.state_slot is None:
            dst.state_slot = self.states.take()
        copies = []
        tables = []
        for table in src.block_ids:
            shared = table[:full]
            for block in shared:
                if block != FREED:
                    self.ref_cnt[block] += 1
            if partial:
                copies.append((table[full], self._take()))
                shared = shared + [copies[-1][1]]
            tables.append(shared)
        dst.block_ids = tables
        dst.block_hashes = list(src.block_hashes[:full])
        self._note_usage()
        return copies

    def _forget_hash(self, block: int) -> None:
        old = self.hash_of[block]
        if old is not None:
            g, h = old
            if self.cached[g].get(h) == block:
                del self.cached[g][h]
                if g == 0:
                    for listener in self._eviction_listeners:
                        listener(h)
            self.hash_of[block] = None

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of req's blocks that became full of computed tokens (and its
        state checkpoints the step wrote)."""
        self._settle_checkpoints(req)
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(req.num_computed_tokens, req.num_tokens) // bs
        for i in range(len(req.block_hashes), full):
            parent = req.block_hashes[-1] if req.block_hashes else req.cache_salt
            h = request_block_hash(req, parent, i, bs)
            req.block_hashes.append(h)
            for g, table in enumerate(req.block_ids):
                block = table[i]
                if block != FREED and h not in self.cached[g]:
                    self.cached[g][h] = block
                    self.hash_of[block] = (g, h)

    def free_request(self, req: Request) -> None:
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for table in req.block_ids:
            for block in reversed(table):
                if block != FREED:
                    self._release(block)
        req.block_ids = []
        req.block_hashes = []
        if self.checkpoints is not None:  # planned, but its step will not run
            for _, _, block_hash in req.checkpoint_writes:
                self.checkpoints.cancel(block_hash)
        req.checkpoint_writes = []
        req.state_source = None
        if req.state_slot is not None:
            assert self.states is not None
            self.states.release(req.state_slot)
            req.state_slot = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (all blocks must be free)."""
        assert len(self.free) == self.num_blocks, "reset_prefix_cache with blocks in use"
        for listener in self._eviction_listeners:
            for h in self.cached[0]:
                listener(h)
        for cached in self.cached:
            cached.clear()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self.hash_of = [None] * self.num_blocks

    def _note_usage(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used_blocks)


def readable_table(table: list[int]) -> list[int]:
    """A block table for the attention kernels: freed entries read as the first held block
    (their keys are masked, but must still be finite numbers)."""
    if not table or table[0] != FREED:
        return table
    live = next((b for b in table if b != FREED), 0)
    return [live if b == FREED else b for b in table]
