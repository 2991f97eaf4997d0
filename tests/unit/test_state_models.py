"""Models with recurrent state (engine/state_slots.py, models/transformers/stateful.py) on the
transformers backend against transformers' generate: tiny random Mamba and Mamba-2 through continuous
batching of mixed prompt lengths, prefill chunks across the chunk boundary, preemption (the
state recomputed), n = 2 (the state copied at the fork) and too few state slots."""

from dataclasses import replace

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, load_weights
from batchrun.options.engine import EngineConfig
from tests.helpers import matrix
from tests.parity import ParityReport
from tests.tiny_models import STATE_ARCHS, IdTokenizer, make_tiny
from tests.unit.test_native_model import hf_greedy
from tests.unit.test_transformers_backend import MAX_TOKENS, check_against_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# One representative per kind of state runs by default (pytest --matrix: every family).
STATE_KEEP = {"mamba", "mamba2", "jamba", "lfm2"}

CPU = torch.device("cpu")
CHUNK = 16  # prompts of 37 and 20 tokens cross it


def state_engine(arch, path, **overrides):
    hf = make_tiny(arch, path, archs=STATE_ARCHS)
    overrides.setdefault("block_size", 4)
    config = EngineConfig.default(model_impl="transformers", max_num_batched_tokens=CHUNK,
                                  **overrides)
    model = load_weights(path, config, CPU, torch.float32)
    return hf, build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)


def prompts_of(lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_matches_transformers_batched_and_chunked(arch, tmp_path):
    hf, engine = state_engine(arch, tmp_path)
    assert not engine.kv.enable_prefix_caching  # a block's KV does not give back the state
    prompts = prompts_of((37, 5, 20, 11, 1))
    report = ParityReport()
    check_against_transformers(hf, prompts, engine.generate(prompts, GREEDY), arch, report)
    assert report.compared == 5
    assert engine.kv.states.num_free == engine.kv.states.num_slots  # every slot back
    again = engine.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == 0
    check_against_transformers(hf, prompts[:1], [again], f"{arch} again", report)


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_preempted_sequences_recompute_their_state(arch, tmp_path):
    # 24 blocks of 4 tokens: the four sequences cannot all grow to their full length together
    hf, engine = state_engine(arch, tmp_path, num_blocks=24)
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
    else:  # Bamba, Granite 4
        heads, head_dim, groups, n, kernel = (cfg.mamba_n_heads, cfg.mamba_d_head,
                                              cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_d_conv)
        kinds = cfg.layer_types
    # transformers names the kinds "linear_attention" / "full_attention" in some versions
    kinds = [{"linear_attention": "mamba", "full_attention": "attention"}.get(k, k) for k in kinds]
    channels = heads * head_dim + 2 * groups * n  # Mamba-2 convolves x, B and C
    elements = channels * (kernel - 1) + heads * head_dim * n
    return kinds.count("mamba"), elements, kinds.count("attention")


@pytest.mark.parametrize("arch", matrix(sorted(STATE_ARCHS), STATE_KEEP))
def test_models_check_and_plan_name_the_state_per_request(arch):
    from batchrun.footprint import backend_config
    from batchrun.models.transformers.check import check, describe
    from tests.tiny_models import tiny_config

    cfg = tiny_config(arch, STATE_ARCHS)
    cfg.architectures = [STATE_ARCHS[arch][1]]
    layers, elements, attention_layers = state_elements(cfg)
    per_request = layers * elements * 4  # float32
    report = check(cfg)
    assert report.impl == "transformers" and report.layers == attention_layers
    assert report.state_layers == layers
    assert report.state_bytes_fp32 == per_request
    lines = "\n".join(describe(arch, report))
    assert f"fp32 {per_request / 1024:.1f} KiB" in lines
    assert ("KV cache: none" in lines) == (not attention_layers)
    assert "prefix caching: no" in lines
    sized = backend_config(cfg)  # what plan sizes
    assert sized.state_bytes_per_sequence == per_request
    assert sized.num_layers == attention_layers
    from batchrun.footprint import kv_reservation

    plain = EngineConfig.default(max_num_seqs=8, kv_cache_memory=2 ** 22)
    blocks, reserved = kv_reservation(plain, sized, "cpu", torch.float32)
    kv_bytes = reserved - 8 * per_request  # the blocks' share of the one budget
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


@pytest.mark.parametrize("arch", ["mamba2", "lfm2"])
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


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_bfloat16_passes_the_load_check(arch, tmp_path):
    """In bfloat16 Mamba's residual stream stays float32 (residual_in_fp32): the head must
    read it in the model's dtype. The load check holds the engine's chunked path against
    transformers' own forward within bfloat16's tolerance."""
    make_tiny(arch, tmp_path, archs=STATE_ARCHS)
    config = EngineConfig.default(model_impl="transformers", block_size=4,
                                  max_num_batched_tokens=CHUNK)
    model = load_weights(tmp_path, config, CPU, torch.bfloat16)  # raises where it differs
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for layer in engine.runner.states for t in layer)
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
