"""Models with recurrent state (engine/state_slots.py, models/transformers/stateful.py) on the
transformers backend against transformers' generate: tiny random Mamba and Mamba-2 through continuous
batching of mixed prompt lengths, prefill chunks across the chunk boundary, preemption (the
state recomputed), n = 2 (the state copied at the fork) and too few state slots."""

from dataclasses import replace

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.kv_sizing import state_checkpoint_count
from batchrun.llm import build_engine, load_weights
from batchrun.options.engine import EngineConfig
from tests.helpers import matrix
from tests.parity import ParityReport
from tests.tiny_models import NATIVE_STATE_ARCHS, STATE_ARCHS, IdTokenizer, make_tiny
from tests.unit.test_native_model import hf_greedy
from tests.unit.test_transformers_backend import MAX_TOKENS, check_against_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# One representative per kind of state runs by default (pytest --matrix: every family).
STATE_KEEP = {"mamba", "mamba2", "jamba", "lfm2", "qwen3_next"}

CPU = torch.device("cpu")
# The families whose mixers write state checkpoints themselves (Mamba's, Mamba-2's, the short
# convolutions: WRITES_CHECKPOINTS); the others' are run in pieces ending at the checkpoints
# (engine/state_checkpoint_pieces.py). Every family takes prefix-cache hits.
WRITES_OWN = {"mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "granitemoehybrid",
              "nemotron_h", "falcon_h1", "lfm2", "zamba2"}
CHUNK = 16  # prompts of 37 and 20 tokens cross it


def state_engine(arch, path, **overrides):
    hf = fresh_generate(make_tiny(arch, path, archs=STATE_ARCHS))
    overrides.setdefault("block_size", 4)
    config = EngineConfig.default(model_impl="transformers", max_num_batched_tokens=CHUNK,
                                  **overrides)
    model = load_weights(path, config, CPU, torch.float32)
    return hf, build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)


WINDOW_BLOCKS = {"recurrent_gemma": 9}


def fresh_generate(hf):
    """`hf` whose generate starts from no state: RecurrentGemma's blocks keep the last call's
    state on the module, and a one-token prompt's prefill (transformers' decode path) continues
    it where it should start afresh."""
    if not hasattr(getattr(hf, "model", None), "_setup_cache"):
        return hf
    own = hf.generate

    def generate(ids, **kwargs):
        hf.model._setup_cache(hf.config, ids.shape[0], ids.device, hf.dtype)
        return own(ids, **kwargs)

    hf.generate = generate
    return hf


def prompts_of(lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_matches_transformers_batched_and_chunked(arch, tmp_path):
    hf, engine = state_engine(arch, tmp_path)
    # prefix hits through state checkpoints (test_state_prefix_cache.py), every 64 tokens
    assert engine.kv.enable_prefix_caching and engine.kv.checkpoints.interval == 64
    prompts = prompts_of((37, 5, 20, 11, 1))
    report = ParityReport()
    check_against_transformers(hf, prompts, engine.generate(prompts, GREEDY), arch, report)
    assert report.compared == 5
    assert engine.kv.states.num_free == engine.kv.states.num_slots  # every slot back
    again = engine.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == 0  # its 37 tokens pass no checkpoint
    check_against_transformers(hf, prompts[:1], [again], f"{arch} again", report)


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_preempted_sequences_recompute_their_state(arch, tmp_path):
    # 24 blocks of 4 tokens: the four sequences cannot all grow to their full length together
    # (RecurrentGemma's attention keeps an 8-token window: fewer blocks)
    hf, engine = state_engine(arch, tmp_path, num_blocks=WINDOW_BLOCKS.get(arch, 24))
    prompts = prompts_of((37, 9, 26, 14), seed=7)
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats.num_preemptions > 0
    check_against_transformers(hf, prompts, outs, f"{arch} preempted", ParityReport())
    assert engine.kv.states.num_free == engine.kv.states.num_slots


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_n2_copies_the_state_at_the_fork(arch, tmp_path):
    hf, engine = state_engine(arch, tmp_path)
    prompts = prompts_of((23, 6))
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1)
    outs = engine.generate(prompts, params)
    for choice in range(2):  # greedy: both choices are transformers' tokens
        one = [replace(o, outputs=[o.outputs[choice]]) for o in outs]
        check_against_transformers(hf, prompts, one, f"{arch} choice {choice}", ParityReport())


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_fewer_slots_than_sequences_queue_the_rest(arch, tmp_path):
    # two slots for four requests, and n = 2 forks that find no slot free recompute their prompt
    hf, engine = state_engine(arch, tmp_path, max_num_seqs=2)
    assert engine.kv.states.num_slots == 2
    prompts = prompts_of((30, 7, 18), seed=9)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1)
    outs = engine.generate(prompts, params)
    assert engine.kv.states.peak_used == 2
    for choice in range(2):
        one = [replace(o, outputs=[o.outputs[choice]]) for o in outs]
        check_against_transformers(hf, prompts, one, f"{arch} slots {choice}", ParityReport())


def state_elements(cfg) -> tuple[int, int, int]:
    """(layers with state, one such layer's state elements, layers with attention) as the
    papers define the state: the convolution's last conv_kernel - 1 inputs of each channel,
    and the SSM state; each family names the sizes its own way."""
    t = cfg.model_type
    if hasattr(cfg, "linear_num_value_heads"):  # Gated DeltaNet: q, k, v convolved; S [Hv, dk, dv]
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                          cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        channels = 2 * hk * dk + hv * dv
        return (cfg.layer_types.count("linear_attention"),
                channels * (cfg.linear_conv_kernel_dim - 1) + hv * dk * dv,
                cfg.layer_types.count("full_attention"))
    if t == "kimi_linear":  # q, k, v of linear_num_heads x linear_head_dim convolved; S [H, d, d]
        heads, d = cfg.linear_num_heads, cfg.linear_head_dim
        return (cfg.layer_types.count("linear_attention"),
                3 * heads * d * (cfg.linear_conv_kernel_dim - 1) + heads * d * d,
                cfg.layer_types.count("full_attention"))
    if t == "minimax":  # lightning attention: a key-value state [heads, d, d], no convolution
        return (cfg.layer_types.count("linear_attention"),
                cfg.num_attention_heads * cfg.head_dim ** 2,
                cfg.layer_types.count("full_attention"))
    if t == "xlstm":  # the mLSTM's matrix memory C [H, dqk, dv], normaliser n [H, dqk], max m
        heads = cfg.num_heads
        dqk, dv = int(cfg.hidden_size * cfg.qk_dim_factor) // heads, \
            int(cfg.hidden_size * cfg.v_dim_factor) // heads
        return cfg.num_hidden_layers, heads * (dqk * dv + dqk + 1), 0
    if t == "rwkv":  # two stateful layers a block: time mixing (last input, WKV numerator,
        # denominator and maximum) and channel mixing (last input); one layer's on average
        hidden, inner = cfg.hidden_size, cfg.attention_hidden_size or cfg.hidden_size
        return 2 * cfg.num_hidden_layers, (2 * hidden + 3 * inner) // 2, 0
    if t == "recurrent_gemma":  # RG-LRU blocks: a convolution's last inputs and the LRU state
        kinds = cfg.layers_block_type
        return (kinds.count("linear_attention"), cfg.lru_width * cfg.conv1d_width,
                kinds.count("sliding_attention"))
    if t == "zamba":  # a Mamba mixer in every layer (its heads share the width); hybrids attend
        inner = cfg.mamba_expand * cfg.hidden_size
        return (cfg.num_hidden_layers, inner * (cfg.mamba_d_conv - 1 + cfg.mamba_d_state),
                cfg.layer_types.count("hybrid"))
    if t in ("mamba", "falcon_mamba"):
        inner = cfg.expand * cfg.hidden_size
        return cfg.num_hidden_layers, inner * (cfg.conv_kernel - 1 + cfg.state_size), 0
    if t == "lfm2":  # a short convolution's last L_cache - 1 inputs, no SSM
        return (cfg.layer_types.count("conv"), cfg.hidden_size * (cfg.conv_L_cache - 1),
                cfg.layer_types.count("full_attention"))
    if t == "jamba":
        attending = sum(i % cfg.attn_layer_period == cfg.attn_layer_offset
                        for i in range(cfg.num_hidden_layers))
        inner = cfg.mamba_expand * cfg.hidden_size
        return (cfg.num_hidden_layers - attending,
                inner * (cfg.mamba_d_conv - 1 + cfg.mamba_d_state), attending)
    if t == "mamba2":
        heads, head_dim, groups, n, kernel = (cfg.num_heads, cfg.head_dim, cfg.n_groups,
                                              cfg.state_size, cfg.conv_kernel)
        kinds = ["mamba"] * cfg.num_hidden_layers
    elif t == "nemotron_h":
        heads, head_dim, groups, n, kernel = (cfg.mamba_num_heads, cfg.mamba_head_dim,
                                              cfg.n_groups, cfg.ssm_state_size, cfg.conv_kernel)
        kinds = cfg.layers_block_type
    elif t == "falcon_h1":  # a mixer and attention in every layer, its width mamba_d_ssm
        heads, head_dim, groups, n = (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups,
                                      cfg.mamba_d_state)
        channels = cfg.mamba_d_ssm + 2 * groups * n
        elements = channels * (cfg.mamba_d_conv - 1) + heads * head_dim * n
        return cfg.num_hidden_layers, elements, cfg.num_hidden_layers
    elif t == "zamba2":  # a Mamba-2 mixer in every layer; the hybrid ones attend too
        heads, head_dim, groups, n, kernel = (cfg.n_mamba_heads, cfg.mamba_headdim,
                                              cfg.mamba_ngroups, cfg.mamba_d_state, cfg.mamba_d_conv)
        channels = heads * head_dim + 2 * groups * n
        return (cfg.num_hidden_layers, channels * (kernel - 1) + heads * head_dim * n,
                cfg.layer_types.count("hybrid"))
    else:  # Bamba, Granite 4
        heads, head_dim, groups, n, kernel = (cfg.mamba_n_heads, cfg.mamba_d_head,
                                              cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_d_conv)
        kinds = cfg.layer_types
    # transformers names the kinds "linear_attention" / "full_attention" in some versions
    kinds = [{"linear_attention": "mamba", "full_attention": "attention"}.get(k, k) for k in kinds]
    channels = heads * head_dim + 2 * groups * n  # Mamba-2 convolves x, B and C
    elements = channels * (kernel - 1) + heads * head_dim * n
    return kinds.count("mamba"), elements, kinds.count("attention")


def float32_elements(cfg) -> int:
    """One stateful layer's state elements kept in float32 whatever the model's dtype: a Gated
    DeltaNet's or Kimi delta attention's recurrent state (transformers' cache keeps the float32
    its kernels return)."""
    if cfg.model_type == "xlstm":  # all of it
        return state_elements(cfg)[1]
    if cfg.model_type == "rwkv":  # the WKV sums, averaged over a block's two layers
        return 3 * (cfg.attention_hidden_size or cfg.hidden_size) // 2
    if cfg.model_type == "recurrent_gemma":
        return cfg.lru_width
    if cfg.model_type == "kimi_linear":
        return cfg.linear_num_heads * cfg.linear_head_dim ** 2
    if not hasattr(cfg, "linear_num_value_heads"):
        return 0
    return cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_models_check_and_plan_name_the_state_per_request(arch):
    from batchrun.footprint import backend_config
    from batchrun.models.transformers.check import check, describe
    from tests.tiny_models import tiny_config

    cfg = tiny_config(arch, STATE_ARCHS)
    cfg.architectures = [STATE_ARCHS[arch][1]]
    layers, elements, attention_layers = state_elements(cfg)
    per_request = layers * elements * 4  # float32
    report = check(cfg)  # auto runs Qwen3-Next natively (its state the same: test_qwen3_next)
    native = arch in NATIVE_STATE_ARCHS or arch == "qwen3_5_text"  # (qwen3_5's text config)
    assert report.impl == ("native" if native else "transformers")
    assert report.layers == attention_layers
    assert report.state_layers == layers
    assert report.state_bytes_fp32 == per_request
    lines = "\n".join(describe(arch, report))
    wide = float32_elements(cfg)
    per_request_bf16 = layers * ((elements - wide) * 2 + wide * 4)
    assert report.state_bytes_bf16 == per_request_bf16
    assert f"fp32 {per_request / 1024:.1f} KiB, bf16 {per_request_bf16 / 1024:.1f} KiB" in lines
    assert ("KV cache: none" in lines) == (not attention_layers)
    assert "prefix caching: yes (a hit resumes at the last state checkpoint" in lines
    sized = backend_config(cfg)  # what plan sizes
    assert sized.state_bytes_per_sequence == per_request
    assert sized.num_layers == attention_layers
    from batchrun.footprint import kv_reservation

    plain = EngineConfig.default(max_num_seqs=8, kv_cache_memory=2 ** 22)
    blocks, reserved = kv_reservation(plain, sized, "cpu", torch.float32)
    # the reservation also holds the prefix cache's checkpoints
    assert sized.state_checkpoints
    kept = state_checkpoint_count(plain, sized, torch.device("cpu"))
    assert kept > 0
    assert kept <= 4 * 8 and kept * per_request <= 2 ** 22 // 4
    kv_bytes = reserved - (8 + kept) * per_request  # the blocks' share of the one budget
    assert kv_bytes >= 0 and (kv_bytes == 0) == (not attention_layers)


def test_batchrun_run_serves_a_mamba_end_to_end(tmp_path, smol_tokenizer):
    """`batchrun run` on a Mamba folder with a real tokenizer: chat template, engine, the state
    slots, the output file; the text is transformers' greedy continuation of the same prompt."""
    import json

    from tests.helpers import batchrun

    folder = tmp_path / "mamba"
    hf = make_tiny("mamba", folder, archs=STATE_ARCHS, vocab_size=len(smol_tokenizer),
                   hidden_size=64)
    smol_tokenizer.save_pretrained(folder)
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": prompt, "max_tokens": 6, "temperature": 0}}) + "\n"
        for i, prompt in enumerate(["The state of the art", "Once upon a time, far away"])))
    ran = batchrun("run", lines, "-o", tmp_path / "out.jsonl", "--model", folder,
                   "--progress", "none", real=True, text=True)
    assert ran.returncode == 0, ran.stderr
    out = {r["custom_id"]: r["response"]["body"] for r in
           map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i, prompt in enumerate(["The state of the art", "Once upon a time, far away"]):
        ids = smol_tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, ids.shape[1]:]
        assert out[f"r{i}"]["choices"][0]["text"] == smol_tokenizer.decode(ref)


@pytest.mark.parametrize("arch", ["mamba2", "lfm2", "qwen3_next"])
def test_prompt_logprobs_across_chunks(arch, tmp_path):
    """Prompt scoring of a 37-token prompt computed in chunks of 16, against one transformers
    forward over it: each chunk's rows read the state the chunk before left."""
    hf, engine = state_engine(arch, tmp_path)
    prompt = prompts_of((37,), seed=11)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    out = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    ours = out.prompt_logprobs.logprob
    assert ours[0] is None
    expected = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert ours[1:] == pytest.approx(expected, abs=2e-3)


# The dtypes of each stateful layer's state tensors in a bfloat16 model: the Gated DeltaNet's
# recurrent state stays float32, as transformers' cache keeps it
BF16_STATE = {"mamba": [torch.bfloat16] * 2, "mamba2": [torch.bfloat16] * 2,
              "qwen3_next": [torch.bfloat16, torch.float32]}


@pytest.mark.parametrize("arch", sorted(BF16_STATE))
def test_bfloat16_passes_the_load_check(arch, tmp_path):
    """In bfloat16 Mamba's residual stream stays float32 (residual_in_fp32): the head must
    read it in the model's dtype. The load check holds the engine's chunked path against
    transformers' own forward within bfloat16's tolerance."""
    make_tiny(arch, tmp_path, archs=STATE_ARCHS)
    config = EngineConfig.default(model_impl="transformers", block_size=4,
                                  max_num_batched_tokens=CHUNK)
    model = load_weights(tmp_path, config, CPU, torch.bfloat16)  # raises where it differs
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.bfloat16)
    assert all([t.dtype for t in layer] == BF16_STATE[arch] for layer in engine.runner.states)
    out = engine.generate(prompts_of((21,)), SamplingParams(temperature=0, max_tokens=4,
                                                            ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_family_of_state_models_whose_layers_all_attend_runs_without_state(tmp_path):
    """An LFM2 whose layer_types are all attention (no short convolution) keeps no state: it
    runs as any backend model does (it had been given a state model with no state, and no slots)."""
    from batchrun.engine.model import KeepsState

    hf = make_tiny("lfm2", tmp_path, archs=STATE_ARCHS, layer_types=["full_attention"] * 4)
    config = EngineConfig.default(model_impl="transformers", block_size=4)
    model = load_weights(tmp_path, config, CPU, torch.float32)
    assert not isinstance(model, KeepsState)
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)
    prompts = prompts_of((9, 4))
    report = ParityReport()
    check_against_transformers(hf, prompts, engine.generate(prompts, GREEDY), "lfm2", report)
    assert report.compared == 2


def test_a_binding_time_step_floor_applies_at_every_position(tmp_path):
    """Nemotron-H's time-step floor (time_step_min) binds transformers' forward but not its
    one-token decode update: the engine applies it at every position, so a token's output does
    not depend on whether a step took it alone or in a chunk, and the text is the forward's."""
    from tests.unit.test_transformers_backend import forward_greedy

    hf = make_tiny("nemotron_h", tmp_path, archs=STATE_ARCHS, time_step_min=0.5)
    config = EngineConfig.default(model_impl="transformers", max_num_batched_tokens=CHUNK,
                                  block_size=4)
    model = load_weights(tmp_path, config, CPU, torch.float32)
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)
    prompts = prompts_of((19, 6))
    report = ParityReport()
    outs = engine.generate(prompts, GREEDY)
    check_against_transformers(hf, prompts, outs, "nemotron_h-floor", report)
    assert report.compared == 2
    # generate's own text differs here (the floor binds): the case is not vacuous
    assert any(forward_greedy(hf, p, MAX_TOKENS)[0] != hf_greedy(hf, p, MAX_TOKENS)[0]
               for p in prompts)
