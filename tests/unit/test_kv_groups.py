"""The KV cache's groups (engine/kv_groups.py, engine/kv_cache.py): a sliding-window group hands
back exactly the blocks no query to come can attend, prefix hits need the window's blocks, and
preemption, resumption and forks keep every group's table whole."""

import pytest
import torch

from batchrun.engine.kv_cache import FREED, KVCacheManager
from batchrun.engine.kv_groups import KVGroup, KVGroups
from batchrun.engine.request import Request
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.kv_sizing import kv_blocks_for
from batchrun.options.engine import EngineConfig

BS, W = 4, 8
FULL, WIN = 0, 1  # the group order of KVGroups.of([W, None]): the full group first


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=16), 16)


def manager(num_blocks: int = 64, windows=(W, None)) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, KVGroups.of(list(windows)))


def run(kv: KVCacheManager, req: Request, n: int) -> None:
    """Schedule and compute req's next n tokens, as the scheduler and the updater do."""
    assert kv.allocate(req, req.num_computed_tokens + n)
    check_window(kv, req, req.num_computed_tokens, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def check_window(kv: KVCacheManager, req: Request, c: int, n: int) -> None:
    """Every block a query at positions c..c+n-1 attends (keys p - W < j <= p) is held; every
    block wholly before the first of them is handed back; the full group holds all."""
    first_key = max(0, c - W + 1)
    table = req.block_ids[WIN]
    assert len(table) == len(req.block_ids[FULL]) == -(-(c + n) // BS)
    for i, block in enumerate(table):
        attended = (i + 1) * BS > first_key
        assert (block != FREED) == attended, (c, n, i, table)
    assert FREED not in req.block_ids[FULL]


def test_layers_group_by_attention_kind():
    gemma3 = KVGroups.of([512, 512, 512, 512, 512, None] * 2)  # 1 full layer in 6
    assert gemma3.layers_per_block == 2
    assert gemma3.groups[0] == KVGroup(None, (5, 11))
    assert [g.layers for g in gemma3.groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert set(gemma3.windows[1:]) == {512}
    mistral = KVGroups.of([4096] * 4)  # every layer windowed: one group, a block holds all
    assert mistral.groups == (KVGroup(4096, (0, 1, 2, 3)),) and mistral.layers_per_block == 4
    plain = KVGroups.of([None] * 3)
    assert plain == KVGroups.single(3)
    placement = gemma3.placement()
    assert placement[11] == (0, 1) and placement[6] == (3, 1)


@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 13, 40])
def test_window_blocks_handed_back_as_the_sequence_advances(chunk):
    """Prefill in chunks of `chunk` tokens (crossing the window's boundary), then decode: the
    window group holds only what the next query tokens see, and the pool gets the rest back."""
    kv = manager()
    req = request(list(range(10, 50)))  # 40 tokens
    while req.num_computed_tokens < 40:
        run(kv, req, min(chunk, 40 - req.num_computed_tokens))
    for token in range(20):
        req.all_token_ids.append(100 + token)
        run(kv, req, 1)
    held_window = sum(b != FREED for b in req.block_ids[WIN])
    assert held_window <= -(-W // BS) + 1
    assert kv.num_used_blocks == len(req.block_ids[FULL]) + held_window == 15 + held_window
    kv.free_request(req)
    assert kv.num_free_blocks == kv.num_blocks


def test_scoring_request_keeps_the_position_it_may_recompute():
    kv = manager()
    req = Request("s", list(range(10, 40)), SamplingParams(max_tokens=0, prompt_logprobs=1), 0)
    assert kv.allocate(req, 16)
    req.num_computed_tokens = 16
    assert kv.allocate(req, 20)
    # its next step may recompute position 15, whose window starts at 8 (block 2), not 9
    assert req.block_ids[WIN][:3] == [FREED, FREED, req.block_ids[WIN][2]] != FREED


def test_prefix_hit_takes_the_window_blocks_it_needs():
    kv = manager()
    a = request(list(range(10, 50)))
    run(kv, a, 40)
    b = request(list(range(10, 42)) + [7, 7, 7])  # shares a's first 32 tokens (8 blocks)
    assert kv.match_prefix(b) == 32
    assert b.block_ids[FULL] == a.block_ids[FULL][:8]
    # a query at 32 sees keys 25..31: blocks 6 and 7 of the window group, not 0..5
    assert b.block_ids[WIN] == [FREED] * 6 + a.block_ids[WIN][6:8]
    b.num_computed_tokens = 32
    run(kv, b, 3)
    kv.free_request(b)
    kv.free_request(a)
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_hit_is_shortened_when_the_window_blocks_are_gone():
    kv = manager(num_blocks=24)
    a = request(list(range(10, 49)))
    run(kv, a, 39)  # 10 blocks in each group: 20 of 24
    a.all_token_ids.append(99)
    run(kv, a, 1)  # the window moves on: blocks 0..7 of the window group go back, still cached
    assert kv.num_free_blocks == 4 + 8
    other = request(list(range(500, 540)), "o")
    assert kv.allocate(other, 4 * 3)  # 6 blocks: the 4 never used, then window blocks 0 and 1
    prefix = list(range(10, 34))  # 24 tokens: every block cached in the full group...
    probe = request(prefix + [1, 2])
    hashes = kv.prompt_hashes(probe)
    assert all(kv.is_cached(h) for h in hashes[:6])
    # ...but a hit at 24 tokens needs window blocks 4 and 5 (keys 17..23): both still cached
    assert kv.match_prefix(probe) == 24
    kv.free_request(probe)
    assert kv.allocate(other, 4 * 6)  # 6 more: the rest of the window blocks a handed back
    assert kv.num_free_blocks == 0
    late = request(prefix + [1, 2], "late")
    assert kv.match_prefix(late) == 0 and late.block_ids == [[], []]
    # a hit right behind a's window still works: blocks 8 and 9 are a's own
    near = request(list(range(10, 49)) + [99, 5], "near")
    assert kv.match_prefix(near) == 40
    assert near.block_ids[WIN] == [FREED] * 8 + a.block_ids[WIN][8:10]


def test_preempted_windowed_request_resumes_from_what_is_cached():
    kv = manager(num_blocks=32)
    req = request(list(range(10, 46)))
    for _ in range(4):
        run(kv, req, 9)
    for token in range(5):
        req.all_token_ids.append(200 + token)
        run(kv, req, 1)
    tokens = list(req.all_token_ids)
    kv.free_request(req)  # preempted: every block back, the hashes kept
    req.num_computed_tokens = 0
    assert kv.num_free_blocks == kv.num_blocks and req.block_ids == []
    cached = kv.match_prefix(req)
    assert cached == 40 and req.all_token_ids == tokens
    assert req.block_ids[WIN][:8] == [FREED] * 8
    req.num_computed_tokens = cached
    run(kv, req, len(tokens) - cached)
    kv.free_request(req)
    assert kv.num_free_blocks == kv.num_blocks


def test_fork_copies_each_groups_tail():
    kv = manager()
    src = request(list(range(10, 40)))
    run(kv, src, 30)  # 7 full blocks and a half one
    dst = request(list(src.all_token_ids), "d")
    copies = kv.fork(src, dst)
    assert [s for s, _ in copies] == [src.block_ids[FULL][7], src.block_ids[WIN][7]]
    assert dst.block_ids[FULL][:7] == src.block_ids[FULL][:7]
    assert dst.block_ids[WIN][:7] == src.block_ids[WIN][:7]
    dst.num_computed_tokens = 30
    dst.all_token_ids.append(5)
    run(kv, dst, 1)  # its window moves on; the blocks src still holds stay in use
    assert dst.block_ids[WIN][:5] == [FREED] * 5 and src.block_ids[WIN][0] != FREED
    for r in (src, dst):
        kv.free_request(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_window_budget_fits_more_sequences():
    """The most blocks a sequence holds, and how many sequences a KV budget takes."""
    full = KVGroups.single(6)
    gemma3 = KVGroups.of([W] * 5 + [None])
    n, chunk = 1000, 16
    assert full.blocks_per_sequence(n, BS, chunk) == 250
    # 250 blocks of the full layer, 5 window groups of (8 + 16) / 4 + 1 blocks each
    assert gemma3.blocks_per_sequence(n, BS, chunk) == 250 + 5 * 7
    config = EngineConfig.default(block_size=BS, max_num_seqs=64, max_num_batched_tokens=chunk,
                                  kv_cache_memory=2 ** 21)

    class Cfg:
        num_layers, num_kv_heads, head_dim = 6, 1, 16

    class WindowedCfg(Cfg):
        layer_windows = (W,) * 5 + (None,)

    plain = kv_blocks_for(config, Cfg, torch.device("cpu"), torch.float32, n)
    windowed = kv_blocks_for(config, WindowedCfg, torch.device("cpu"), torch.float32, n)
    assert plain == 2 ** 21 // (2 * 6 * 16 * 4 * BS) == 682  # a block holds all 6 layers
    assert windowed == 2 ** 21 // (2 * 1 * 16 * 4 * BS) == 4096  # ...or one
    assert plain // 250 == 2 and windowed // (250 + 5 * 7) == 14  # sequences of 1000 tokens


def test_chunked_layers_are_a_kind_of_their_own():
    """Llama 4: chunked local attention on three layers in four, full attention on the fourth;
    a chunked layer and a windowed one of the same size do not share a group."""
    llama4 = KVGroups.of([None] * 8, [8, 8, 8, None] * 2)
    assert llama4.groups[0] == KVGroup(None, (3, 7))
    assert {g.chunked for g in llama4.groups[1:]} == {True}
    assert [g.layers for g in llama4.groups[1:]] == [(0, 1), (2, 4), (5, 6)]
    mixed = KVGroups.of([8, None, None], [None, 8, None])
    assert [(g.window, g.chunked, g.layers) for g in mixed.groups] == [
        (None, False, (2,)), (8, False, (0,)), (8, True, (1,))]


@pytest.mark.parametrize("step", [1, 3, 5])
def test_a_chunked_group_holds_every_block_its_queries_read(step):
    """Each query at p reads keys from its chunk's start p - p % C: those blocks are held at
    every step (the group keeps them as a window of C would), older ones handed back."""
    kv = KVCacheManager(64, BS, True, KVGroups.of([None, None], [W, None]))
    req = request(list(range(3, 40)))
    while req.num_computed_tokens < 37:
        c = req.num_computed_tokens
        n = min(step, 37 - c)
        assert kv.allocate(req, c + n)
        first_key = c - c % W
        table = req.block_ids[WIN]
        assert all(b != FREED for b in table[first_key // BS:])
        assert FREED not in req.block_ids[FULL]
        req.num_computed_tokens += n
        kv.cache_full_blocks(req)
    assert FREED in req.block_ids[WIN]  # the chunks behind were handed back
