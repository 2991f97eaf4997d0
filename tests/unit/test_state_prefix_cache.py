"""Prefix caching for models with recurrent state (engine/state_checkpoints.py): prompts sharing
a prefix of several blocks start from the state checkpoint where their hit ends. Greedy tokens
and logprobs with the cache on equal those with it off and transformers' generate, through
chunked prefill (checkpoints inside a chunk and at its end), preemption and n = 2; the hits
are reported in num_cached_tokens. Mixers that keep only final states write their checkpoints
by running the step in pieces ending at them (engine/state_checkpoint_pieces.py): the same
states and outputs as a mixer that writes its own."""

from dataclasses import replace

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.state_checkpoints import CheckpointPool, StepCheckpoints
from batchrun.engine.state_slots import StateSpec, StepState, state_tensors
from batchrun.models.transformers import stateful
from batchrun.options.engine import EngineConfig
from tests.helpers import matrix
from tests.parity import ParityReport
from tests.tiny_models import STATE_ARCHS, make_tiny
from tests.unit.test_qwen3_next import native_engine
from tests.unit.test_state_models import GREEDY, WRITES_OWN, prompts_of, state_engine
from tests.unit.test_transformers_backend import MAX_TOKENS, check_against_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Mamba, a Mamba-2 hybrid with attention, LFM2's short convolutions (their own checkpoints), and
# Qwen3-Next's Gated DeltaNet on the backend (in pieces); pytest --matrix: every family
KEEP = {"mamba", "bamba", "lfm2", "qwen3_next"}
# Blocks of 4 tokens, chunks of 16 (state_engine): a checkpoint every 8 tokens is one inside
# each chunk and one at its end.
EVERY = 8
BLOCKS = {"recurrent_gemma": 16}  # KV blocks that preempt (an 8-token window frees the rest)


def shared_prefix_prompts(tails=(5, 9, 3, 12)):
    """Prompts of a 30-token shared prefix (7 blocks, checkpoints at 8, 16 and 24) and tails."""
    (shared,) = prompts_of((30,), seed=3)
    return [shared + tail for tail in prompts_of(tails, seed=4)]


def assert_same_outputs(on, off, label):
    """Greedy tokens equal, logprobs equal up to float32 rounding (the hit's state went through
    a checkpoint instead of one pass: Mamba-2's is the SSM's closed form over a segment, summed
    in another order than its chunked scan; Zamba 2's logprobs moved by up to 1.1e-4)."""
    for i, (a, b) in enumerate(zip(on, off)):
        for choice_a, choice_b in zip(a.outputs, b.outputs):
            assert choice_a.token_ids == choice_b.token_ids, f"{label}[{i}]"
            for lp_a, lp_b in zip(choice_a.logprobs, choice_b.logprobs):
                assert lp_a.logprob == pytest.approx(lp_b.logprob, abs=3e-4), f"{label}[{i}]"


def run_both(arch, tmp_path, prompts, params, engine=state_engine, **overrides):
    """(hf, the cached engine, outputs with the prefix cache on, outputs with it off), the first
    prompt run alone first on the cached engine so the rest hit its checkpoints."""
    hf, on = engine(arch, tmp_path, state_checkpoint_tokens=EVERY, **overrides)
    _, off = engine(arch, tmp_path, enable_prefix_caching=False, **overrides)
    assert on.kv.checkpoints is not None and off.kv.checkpoints is None
    first = on.generate(prompts[:1], params)
    assert first[0].num_cached_tokens == 0
    return hf, on, on.generate(prompts, params), off.generate(prompts, params)


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), KEEP))
def test_hits_start_from_checkpoints_and_match_cache_off(arch, tmp_path):
    prompts = shared_prefix_prompts()
    hf, engine, on, off = run_both(arch, tmp_path, prompts, GREEDY)
    # the repeated prompt (35 tokens) hits up to its checkpoint at 32, the others at 24
    assert [o.num_cached_tokens for o in on] == [32, 24, 24, 24]
    assert_same_outputs(on, off, arch)
    check_against_transformers(hf, prompts, on, f"{arch} cached", ParityReport())
    pool = engine.kv.checkpoints
    assert not pool.pending and engine.kv.states.num_free == engine.kv.states.num_slots


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), KEEP))
def test_hits_under_preemption_and_n2(arch, tmp_path):
    # 24 blocks of 4 tokens: four sequences of two choices cannot all grow together (fewer for
    # RecurrentGemma, whose attention keeps an 8-token window; 11 evict the prefix's blocks)
    prompts = shared_prefix_prompts((9, 3, 14))
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1)
    hf, engine, on, off = run_both(arch, tmp_path, prompts, params,
                                   num_blocks=BLOCKS.get(arch, 24))
    assert engine.stats.num_preemptions > 0
    assert all(o.num_cached_tokens > 0 for o in on)
    assert_same_outputs(on, off, f"{arch} preempted")
    for choice in range(2):  # greedy: both choices are transformers' tokens
        one = [replace(o, outputs=[o.outputs[choice]]) for o in on]
        check_against_transformers(hf, prompts, one, f"{arch} choice {choice}", ParityReport())


def native(arch, path, **overrides):
    return native_engine(path, arch=arch, **overrides)


@pytest.mark.parametrize("arch,kernels", matrix(
    [("qwen3_next", "cpu-kernels"), ("qwen3_next", "pytorch-only"), ("qwen3_5", "cpu-kernels")],
    {("qwen3_next", "cpu-kernels")}, key=lambda v: v))
def test_native_gated_delta_hits_match_cache_off(arch, kernels, tmp_path, monkeypatch):
    if kernels == "pytorch-only":
        monkeypatch.setenv("BATCHRUN_DISABLE_KERNELS", "1")
    prompts = shared_prefix_prompts()
    hf, engine, on, off = run_both(arch, tmp_path, prompts, GREEDY, engine=native)
    assert (engine.runner.model.cpu_kernels is None) == (kernels == "pytorch-only")
    assert [o.num_cached_tokens for o in on] == [32, 24, 24, 24]
    assert_same_outputs(on, off, arch)
    check_against_transformers(hf, prompts, on, f"{arch} cached", ParityReport())
    # preempted and forked (n = 2) sequences hit the same checkpoints
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1)
    prompts = shared_prefix_prompts((9, 3, 14))
    _, small, on, off = run_both(arch, tmp_path, prompts, params, engine=native, num_blocks=24)
    assert small.stats.num_preemptions > 0 and all(o.num_cached_tokens > 0 for o in on)
    assert_same_outputs(on, off, f"{arch} preempted")


@pytest.mark.parametrize("arch", matrix(sorted(WRITES_OWN), {"mamba"}))
def test_pieces_write_what_a_mixers_own_checkpoints_hold(arch, tmp_path):
    """A mixer that writes its checkpoints itself, and the same mixer run in pieces ending at
    them: the same outputs and the same states in every slot, for fresh and continued
    sequences, checkpoints inside a chunk and at its end, and a sequence without any."""
    hf = make_tiny(arch, tmp_path, archs=STATE_ARCHS)
    _, mixer = stateful.stateful_layers(hf)[0]
    kind = stateful.MIXERS[type(mixer).__name__]
    spec = StateSpec(stateful.spec_of(hf, torch.float32).layers[:1])
    gen = torch.Generator().manual_seed(0)
    start = [tuple(torch.randn(t.shape, generator=gen) for t in layer)
             for layer in state_tensors(spec, 8, torch.device("cpu"))]
    hidden = torch.randn(1, 20 + 5 + 12 + 9, hf.config.hidden_size, generator=gen)
    # sequence 0 fresh, checkpoints after 8 and 16 of its 20 rows; 1 continued, none; 2
    # continued, one at its end (12); 3 fresh, one after its first row
    checkpoints = StepCheckpoints([0, 0, 2, 3], [8, 16, 12, 1], [4, 5, 6, 7])
    outs, states = [], []
    with torch.no_grad():
        for run in (kind.forward, lambda *a: stateful.in_pieces(kind, *a)):
            tensors = [tuple(t.clone() for t in layer) for layer in start]
            step = StepState.of(tensors, [0, 1, 2, 3], [0, 8, 4, 0], [20, 5, 12, 9],
                                torch.device("cpu"), checkpoints)
            out = run(mixer, hidden, tensors[0], step)
            outs.append(out[0] if isinstance(out, tuple) else out)
            states.append(tensors[0])
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    for own, pieces in zip(*states):
        torch.testing.assert_close(pieces, own, atol=2e-5, rtol=1e-4)


def test_without_checkpoints_the_prefix_cache_stays_off(tmp_path, monkeypatch):
    own = stateful.spec_of
    monkeypatch.setattr(stateful, "spec_of", lambda hf, dtype: replace(own(hf, dtype),
                                                                       checkpoints=False))
    _, engine = state_engine("lfm2", tmp_path, state_checkpoint_tokens=EVERY,
                             kv_cache_memory=1 << 22)
    assert not engine.runner.model.state_spec.checkpoints
    assert not engine.kv.enable_prefix_caching and engine.kv.checkpoints is None
    prompts = shared_prefix_prompts()
    engine.generate(prompts[:1], GREEDY)
    assert all(o.num_cached_tokens == 0 for o in engine.generate(prompts, GREEDY))
    monkeypatch.undo()
    # with checkpoints, the same budget pays for them: fewer KV blocks
    _, cached = state_engine("lfm2", tmp_path, state_checkpoint_tokens=EVERY,
                             kv_cache_memory=1 << 22)
    per_sequence = cached.runner.model.state_spec.bytes_per_sequence
    assert cached.kv.checkpoints.num_slots * per_sequence <= (1 << 22) // 4
    assert cached.kv.num_blocks < engine.kv.num_blocks


def test_pool_evicts_least_recently_used_and_never_a_pending_checkpoint():
    pool = CheckpointPool(first_slot=4, num_slots=2, interval=8)
    a, b = pool.plan(b"a"), pool.plan(b"b")
    assert {a, b} == {4, 5} and not pool.has(b"a")  # planned, not yet written
    assert pool.plan(b"c") is None  # every slot pending: nothing to evict
    pool.commit(b"a")
    pool.commit(b"b")
    assert pool.plan(b"a") is None  # kept already
    assert pool.lookup(b"a") == a  # a is now the most recently used
    assert pool.plan(b"c") == b and not pool.has(b"b")
    pool.cancel(b"c")
    pool.drop(b"a")
    assert sorted(pool.free) == [4, 5] and not pool.ready and not pool.pending


def test_a_hit_ends_at_a_written_checkpoint_never_a_planned_one():
    from batchrun.engine.kv_cache import KVCacheManager
    from batchrun.engine.request import Request
    from batchrun.engine.sampling_params import SamplingParams
    from batchrun.engine.state_slots import StateSlots

    def request(rid):  # 22 tokens: blocks of 4, checkpoints every 8 at 8 and 16
        return Request(rid, list(range(3, 25)), SamplingParams(max_tokens=4), 4)

    pool = CheckpointPool(first_slot=2, num_slots=4, interval=8)
    kv = KVCacheManager(32, 4, True, states=StateSlots(2), checkpoints=pool)

    def step(req):  # admit req, plan its whole prompt, run it
        assert kv.allocate(req, 22)
        kv.plan_checkpoints(req, 22 - req.num_computed_tokens)
        return [position for position, _, _ in req.checkpoint_writes]

    a = request("a")
    assert kv.match_prefix(a) == 0 and step(a) == [8, 16]
    a.num_computed_tokens = 22
    kv.cache_full_blocks(a)  # the step ran: both checkpoints are hits
    kv.free_request(a)
    b = request("b")
    assert kv.match_prefix(b) == 16 and b.state_source == pool.lookup(a.prompt_hashes[3])
    kv.free_request(b)
    pool.clear()  # the blocks stay cached, the states are gone
    c, d = request("c"), request("d")
    assert kv.match_prefix(c) == 0 and step(c) == [8, 16]
    assert kv.match_prefix(d) == 0 and d.state_source is None  # c's step has not run yet
    kv.free_request(d)
    kv.free_request(c)  # preempted before its step ran: its checkpoints are never written
    assert not pool.pending and len(pool.free) == 4


def test_plan_replays_hits_at_checkpoint_granularity():
    from batchrun.batch.estimate.job_estimate import prefix_model
    from batchrun.footprint import backend_config
    from batchrun.options.engine import EngineConfig
    from tests.tiny_models import tiny_config

    sized = backend_config(tiny_config("bamba", STATE_ARCHS))
    on = EngineConfig.default(max_num_seqs=8, kv_cache_memory=1 << 22)
    (prefix,) = prompts_of((100,), seed=1)
    sharing = prefix_model(on, sized, 64)
    assert sharing.enabled and sharing.block_size == 64
    sharing.add(prefix + [7, 8])
    assert sharing.add(prefix + [9, 10]) == 64  # the hit ends at the checkpoint at 64
    off = EngineConfig.default(max_num_seqs=8, kv_cache_memory=1 << 22,
                               enable_prefix_caching=False)
    assert not prefix_model(off, sized, 64).enabled


def test_a_waiting_prompt_waits_only_for_a_block_that_ends_at_a_checkpoint():
    # A running request recomputing blocks 4..5 of a shared prefix after its hit at 16 leaves
    # no longer hit for the next one: only the block ending at the next checkpoint (24) would
    from batchrun.engine.kv_cache import KVCacheManager
    from batchrun.engine.state_slots import StateSlots

    with_state = KVCacheManager(32, 4, True, states=StateSlots(2),
                                checkpoints=CheckpointPool(2, 4, interval=8))
    assert with_state.next_hit_block(16) == 5 and with_state.next_hit_block(0) == 1
    assert KVCacheManager(32, 4).next_hit_block(16) == 4


def test_an_image_prompt_of_a_stateful_vision_model_hits_its_checkpoints(tmp_path,
                                                                          smol_tokenizer):
    """Qwen3.5's image-text model (stateful_vision.py): the same image prompt again resumes at
    its last checkpoint, past the image, with the tokens and logprobs of the cache off."""
    from batchrun.llm import load_from_path
    from batchrun.models.transformers.processor import render
    from tests.tiny_vlm_families import make_tiny_vlm
    from tests.tiny_vlms import image
    from tests.unit.test_vision_families import chat

    make_tiny_vlm("qwen3_5", tmp_path, smol_tokenizer)
    outs = {}
    for on in (True, False):
        loaded = load_from_path(tmp_path, EngineConfig.default(
            model_impl="auto", block_size=4, max_num_batched_tokens=16, num_blocks=256,
            threads=1, enable_prefix_caching=on, state_checkpoint_tokens=EVERY))
        prompt, mm = render(loaded.processor, chat(1), [image(120, 90, 1)])
        image_id = loaded.engine.runner.model.image_token_id
        assert len(prompt) == 26 and image_id in prompt
        assert max(i for i, t in enumerate(prompt) if t == image_id) < 24  # before the hit
        outs[on] = [run_one(loaded.engine, f"again-{i}", prompt, mm) for i in range(2)]
    assert [o.num_cached_tokens for o in outs[True]] == [0, 24]
    assert_same_outputs(outs[True], outs[False], "qwen3_5 image")


def run_one(engine, rid, prompt, mm):
    engine.add_request(rid, prompt, GREEDY, multimodal=mm)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
