"""Native Qwen3-Next and Qwen3.5 text (models/arch/qwen3_next.py) against transformers' generate on
a tiny random checkpoint: continuous batching of mixed prompt lengths with prefill chunks of 16
tokens (the linear-attention state and the convolution's last inputs carried across chunks), on
the C kernels and on PyTorch only, preemption (the state recomputed into a fresh slot), n = 2
(the state copied at the fork), fewer state slots than sequences, prompt logprobs across chunks,
and bfloat16 through the load check."""

from dataclasses import replace

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.model import KeepsState, NativeModel
from batchrun.llm import build_engine, load_weights
from batchrun.models.arch.qwen3_next import Qwen3NextModel
from batchrun.options.engine import EngineConfig
from tests.parity import ParityReport
from tests.tiny_models import NATIVE_STATE_ARCHS, IdTokenizer, make_tiny
from tests.unit.test_transformers_backend import MAX_TOKENS, check_against_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
CHUNK = 16  # prompts of 37 and 20 tokens cross it
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def native_engine(path, dtype=torch.float32, arch="qwen3_next", **overrides):
    hf = make_tiny(arch, path, archs=NATIVE_STATE_ARCHS)
    overrides.setdefault("block_size", 4)
    config = EngineConfig.default(model_impl="native", max_num_batched_tokens=CHUNK, **overrides)
    model = load_weights(path, config, CPU, dtype)  # the load check: raises where it differs
    assert isinstance(model, Qwen3NextModel)
    assert isinstance(model, NativeModel) and isinstance(model, KeepsState)
    return hf, build_engine(model, IdTokenizer(), config, [2], CPU, dtype)


def prompts_of(lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def each_choice(hf, prompts, outs, label):
    for choice in range(2):  # greedy: both choices are transformers' tokens
        one = [replace(o, outputs=[o.outputs[choice]]) for o in outs]
        check_against_transformers(hf, prompts, one, f"{label} {choice}", ParityReport())


@pytest.mark.parametrize("arch,path", [("qwen3_next", "cpu-kernels"),
                                       ("qwen3_next", "pytorch-only"), ("qwen3_5", "cpu-kernels")])
def test_matches_transformers_batched_and_chunked(arch, path, tmp_path, monkeypatch):
    if path == "pytorch-only":
        monkeypatch.setenv("BATCHRUN_DISABLE_KERNELS", "1")
    hf, engine = native_engine(tmp_path, arch=arch)
    assert (engine.runner.model.cpu_kernels is None) == (path == "pytorch-only")
    # hits resume at state checkpoints (test_state_prefix_cache.py)
    assert engine.kv.enable_prefix_caching and engine.kv.checkpoints is not None
    assert len(engine.runner.kv_caches) == 1  # the one full-attention layer's
    prompts = prompts_of((37, 5, 20, 11, 1))
    report = ParityReport()
    check_against_transformers(hf, prompts, engine.generate(prompts, GREEDY), path, report)
    assert report.compared == 5
    assert engine.kv.states.num_free == engine.kv.states.num_slots  # every slot back
    with pytest.raises(ValueError, match="recurrent state"):
        engine.runner.model.lora_targets()


def test_preempted_sequences_recompute_their_state(tmp_path):
    hf, engine = native_engine(tmp_path, num_blocks=24)
    prompts = prompts_of((37, 9, 26, 14), seed=7)
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats.num_preemptions > 0
    check_against_transformers(hf, prompts, outs, "preempted", ParityReport())


def test_n2_and_fewer_slots_than_sequences(tmp_path):
    """Two slots for three prompts of n = 2: the forks copy their parent's state, or wait."""
    hf, engine = native_engine(tmp_path, max_num_seqs=2)
    assert engine.kv.states.num_slots == 2
    prompts = prompts_of((30, 7, 18), seed=9)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1)
    outs = engine.generate(prompts, params)
    assert engine.kv.states.peak_used == 2
    each_choice(hf, prompts, outs, "n2")


def test_prompt_logprobs_across_chunks(tmp_path):
    hf, engine = native_engine(tmp_path)
    prompt = prompts_of((37,), seed=11)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    out = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    expected = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert out.prompt_logprobs.logprob[1:] == pytest.approx(expected, abs=2e-3)


def test_bfloat16_passes_the_load_check(tmp_path):
    _, engine = native_engine(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.float32 for layer in engine.runner.states for t in layer)
    out = engine.generate(prompts_of((21,)), SamplingParams(temperature=0, max_tokens=4,
                                                            ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_greedy_through_the_triton_kernels(tmp_path, monkeypatch):
    """The model's calls into the Triton kernels (CUDA's path; Triton's interpreter here):
    prefill chunks through the chunked kernel, a decode's one token through the recurrent one."""
    from batchrun.engine.kernels import triton_gated_delta
    from batchrun.models.layers import gated_delta_net

    def triton_rule(q, k, v, g, beta, state, slots, query_start, max_count, kernels=None):
        if max_count == 1:
            return triton_gated_delta.recurrent(q, k, v, g, beta, state, slots, query_start)
        return triton_gated_delta.chunked(q, k, v, g, beta, state, slots, query_start, chunk=16)

    hf, engine = native_engine(tmp_path)
    monkeypatch.setattr(gated_delta_net, "gated_delta_rule", triton_rule)
    prompts = prompts_of((20, 3), seed=13)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()


def test_plan_sizes_the_state_slots_and_the_attention_layers(tmp_path):
    """What `plan` reads without the weights (footprint.model_config_for): the KV layers are the
    full-attention ones, and each request's state is, per linear layer, the convolution's last
    kernel - 1 inputs of q|k|v and the [value heads, dk, dv] delta rule state, in float32."""
    from batchrun.footprint import kv_reservation, model_config_for
    from tests.tiny_models import tiny_config

    hf = tiny_config("qwen3_next", NATIVE_STATE_ARCHS)
    hf.architectures = ["Qwen3NextForCausalLM"]
    hf.save_pretrained(tmp_path)
    cfg = model_config_for(str(tmp_path))
    conv_dim = 2 * hf.linear_num_key_heads * hf.linear_key_head_dim + \
        hf.linear_num_value_heads * hf.linear_value_head_dim
    per_layer = (hf.linear_conv_kernel_dim - 1) * conv_dim + hf.linear_num_value_heads * \
        hf.linear_key_head_dim * hf.linear_value_head_dim
    assert cfg.num_layers == hf.layer_types.count("full_attention") == 1
    assert cfg.state_bytes_per_sequence == 3 * per_layer * 4
    plain = EngineConfig.default(max_num_seqs=8, kv_cache_memory=2 ** 22)
    _, reserved = kv_reservation(plain, cfg, "cpu", torch.float32)
    assert reserved >= 8 * cfg.state_bytes_per_sequence


def test_models_check_names_the_native_models_state(tmp_path):
    """models check on a native hybrid says what the native path holds: the state per request
    (the native model's own state_spec), KV caches for the attention layers only, prefix
    caching through state checkpoints and no LoRA."""
    from tests.unit.test_transformers_backend import _models_cli

    make_tiny("qwen3_next", tmp_path, archs=NATIVE_STATE_ARCHS)
    model = load_weights(tmp_path, EngineConfig.default(), CPU, torch.float32)
    out = _models_cli("check", tmp_path).output
    assert "path: native (models/arch/qwen3_next.py)" in out
    kib = model.state_spec.bytes_per_sequence / 1024
    assert f"recurrent state: 3 layers (convolution / SSM / linear-attention state): fp32 " \
        f"{kib:.1f} KiB" in out, out
    assert "KV cache: 1 layers" in out and "prefix caching: yes" in out and "LoRA: no" in out
