"""State slots beside the paged blocks (engine/state_slots.py, engine/kv_cache.py): one per
running sequence, taken with its first blocks, handed back with them, a fork's own slot, and
one memory budget for blocks and slots (engine/kv_sizing.py)."""

import pytest
import torch

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.kv_sizing import kv_blocks_for, state_slot_count
from batchrun.engine.request import Request
from batchrun.engine.sampling_params import SamplingParams
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.score_cache import ScoreCache
from batchrun.engine.state_slots import (StateSlots, StateSpec, StateTensor, StepState,
                                         copy_slot, state_tensors)
from batchrun.options.engine import EngineConfig

BS = 4


def request(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=8), 8)


def manager(num_blocks=16, slots=2) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, False, states=StateSlots(slots))


def test_a_slot_comes_with_the_first_blocks_and_goes_back_with_them():
    kv = manager()
    a, b, c = request(5, "a"), request(5, "b"), request(5, "c")
    assert kv.allocate(a, 5) and kv.allocate(b, 5)
    assert {a.state_slot, b.state_slot} == {0, 1}
    held = kv.num_free_blocks
    assert not kv.allocate(c, 5)  # blocks to spare, but no slot: nothing taken
    assert c.state_slot is None and not c.block_ids[0] and kv.num_free_blocks == held
    slot = a.state_slot
    assert kv.allocate(a, 9) and a.state_slot == slot  # growing keeps its slot
    kv.free_request(a)
    assert a.state_slot is None and kv.states.num_free == 1
    assert kv.allocate(c, 5) and c.state_slot == slot


def test_short_blocks_take_no_slot():
    kv = manager(num_blocks=2)
    assert not kv.allocate(request(12), 12)
    assert kv.states.num_free == 2


def test_a_fork_gets_its_own_slot_or_nothing():
    kv = manager(slots=2)
    leader, sib, third = request(6, "l"), request(6, "s"), request(6, "t")
    kv.allocate(leader, 6)
    leader.num_computed_tokens = 6
    assert kv.fork(leader, sib) is not False
    assert sib.state_slot not in (None, leader.state_slot)
    assert kv.fork(leader, third) is False  # no slot left: it recomputes later
    assert third.state_slot is None and not third.block_ids


def test_preemption_frees_the_slot():
    config = EngineConfig.default(block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    kv = KVCacheManager(6, BS, False, states=StateSlots(4))
    sched = Scheduler(config.scheduler, kv, ScoreCache(kv))
    first, second = request(10, "a"), request(10, "b")
    sched.add(first)
    sched.add(second)
    step = sched.schedule()  # 3 blocks each: the pool is full
    assert [r for r, _ in step.work] == [first, second]
    for req, n in step.work:
        req.num_computed_tokens += n
        req.all_token_ids.append(5)
    first.all_token_ids += [5, 5]  # a third block for the first: the second is preempted
    first.num_computed_tokens += 2
    sched.schedule()
    assert sched.num_preemptions == 1
    assert second.state_slot is None and kv.states.num_free == 3


def test_step_state_lays_sequences_out_one_per_row():
    spec = StateSpec(((StateTensor((3, 2), torch.float32),),))
    tensors = state_tensors(spec, 4, torch.device("cpu"))
    state = StepState.of(tensors, [2, 0, 3], [7, 0, 1], [1, 4, 2], torch.device("cpu"))
    rows, valid = state.padded_rows()
    assert rows[valid].tolist() == list(range(7))  # every row once, in row order
    assert valid.tolist() == [[True, False, False, False], [True] * 4, [True, True, False, False]]
    assert state.fresh.tolist() == [False, True, False]
    tensors[0][0][2] = 1.5
    copy_slot(tensors, 2, 1)
    assert tensors[0][0][1].eq(1.5).all() and spec.bytes_per_sequence == 24


def test_blocks_and_slots_share_one_budget():
    config = EngineConfig.default(block_size=BS, max_num_seqs=8, max_num_batched_tokens=16,
                                  kv_cache_memory=2 ** 20)

    class Attention:
        num_layers, num_kv_heads, head_dim = 2, 1, 16

    class Hybrid(Attention):
        state_bytes_per_sequence = 2 ** 16  # 8 slots: half the budget

    block = 2 * 2 * 16 * 4 * BS
    cpu = torch.device("cpu")
    assert kv_blocks_for(config, Attention, cpu, torch.float32, 4096) == 2 ** 20 // block
    assert kv_blocks_for(config, Hybrid, cpu, torch.float32, 4096) == 2 ** 19 // block

    class Big(Attention):
        state_bytes_per_sequence = 2 ** 17  # 8 slots would take the whole budget

    # the slots take at most half the budget: 4 of them, the sequences beyond wait for one
    assert state_slot_count(config, Big, cpu) == 4
    assert kv_blocks_for(config, Big, cpu, torch.float32, 4096) == 2 ** 19 // block

    class TooBig(Attention):
        state_bytes_per_sequence = 2 ** 21  # one sequence's state outgrows the budget

    with pytest.raises(ValueError, match="recurrent state of one sequence"):
        kv_blocks_for(config, TooBig, cpu, torch.float32, 4096)

    class Mamba(Hybrid):
        num_layers = 0  # no attention: its blocks take no memory

    assert kv_blocks_for(config, Mamba, cpu, torch.float32, 4096) == 8 * 4096 // BS
