"""The transformers backend (batchrun/models/transformers/) against transformers itself, on tiny
random checkpoints of many architectures, through everything the engine does to a batch."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.pooling import PoolingParams
from batchrun.llm import build_engine, load_weights
from batchrun.engine.attention.reference import attend, reference_attention
from batchrun.models.arch.moe import MoeModel
from batchrun.models.transformers.model import TransformersModel
from batchrun.models.transformers.support import UnsupportedModelError, choose
from batchrun.options.engine import EngineConfig
from tests.helpers import matrix
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, make_tiny
from tests.unit.test_native_model import hf_greedy

CPU = torch.device("cpu")
MAX_TOKENS = 12
# The native MoE paths run these (models/arch/moe.py; GPT-OSS's sinks, windows, biases and clamped
# experts in models/arch/gpt_oss.py).
MOE_ARCHS = ["gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")
# One representative per mechanism runs by default (pytest --matrix: all of them).
BACKEND_KEEP = {"llama", "gemma2", "diffllama", "falcon", "bloom", "phimoe-window", "llama4_text",
                "gpt_neox", "mixtral", "megatron-bert", "deepseek_v2", "trocr", "mimo_v2_flash",
                "roberta"}
NATIVE_KEEP = {"gemma2", "phi3-longrope", "stablelm", "bloom", "falcon-mqa", "gpt_neo"}
MOE_KEEP = {"qwen3_moe", "gpt_oss"}


def backend_engine(arch, path, impl="transformers", **overrides):
    """(transformers model, batchrun engine on `impl`) over one tiny checkpoint of `arch`."""
    hf = make_tiny(arch, path, archs=BACKEND_ARCHS)
    overrides.setdefault("block_size", 4)
    config = EngineConfig.default(model_impl=impl, **overrides)
    model = load_weights(path, config, CPU, torch.float32)
    return hf, build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)


# Families whose generate disagrees with their own forward, where the forward is held: RoBERTa's
# generate counts positions from 0, its forward (and its training) from after the padding index.
# Nemotron-H with a time-step floor that binds: generate's decode update leaves it out.
FORWARD_REFERENCE = {"roberta", "nemotron_h-floor"}


@torch.no_grad()
def forward_greedy(hf, prompt, max_new_tokens):
    """hf_greedy's tokens and logits from transformers' full forward at each step (no cache)."""
    tokens, logits = list(prompt), []
    for _ in range(max_new_tokens):
        logits.append(hf(torch.tensor([tokens])).logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):], logits


def check_against_transformers(hf, prompts, outs, label, report):
    """Greedy tokens (tie-aware) and the logprob of each token up to any tie, against generate."""
    greedy = forward_greedy if label in FORWARD_REFERENCE else hf_greedy
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, ref_logits = greedy(hf, prompt, MAX_TOKENS)
        ours = out.outputs[0]
        assert_greedy_match(ours.token_ids, ref, ref_logits, f"{label}[{i}]", report)
        for j, (token, lp) in enumerate(zip(ours.token_ids, ours.logprobs)):
            if token != ref[j]:
                break
            expected = float(torch.log_softmax(ref_logits[j].float(), -1)[token])
            assert lp.logprob == pytest.approx(expected, abs=2e-3), f"{label}[{i}] token {j}"


def windowed(arch: str) -> bool:
    """Whether some layers see only part of the context: a sliding window (GPT-Neo's
    window_size) or an attention chunk (Llama 4)."""
    extra = BACKEND_ARCHS[arch][2]
    return bool(extra.get("sliding_window") or extra.get("window_size")
                or extra.get("attention_chunk_size") or extra.get("local_attention"))


def pool_blocks(arch: str) -> int:
    """A KV pool small enough for the busy batch to preempt: a model whose every layer is
    windowed holds only its windows' blocks (engine/kv_groups.py), so it gets a smaller one."""
    mixed = {"layer_types", "attention_types", "no_rope_layer_interval",
             "global_attn_every_n_layers"}
    every_layer = windowed(arch) and not mixed & set(BACKEND_ARCHS[arch][2])
    return 12 if every_layer else 24


@pytest.mark.parametrize("arch", matrix(sorted(BACKEND_ARCHS), BACKEND_KEEP))
def test_greedy_and_logprobs_match_transformers(arch, tmp_path):
    """Mixed-length prompts in one engine, prefilled in chunks of at most 16 tokens (crossing the
    8-token sliding windows), in a KV pool too small for all of them (preemption), then two
    prompts extending an earlier one's prefix (prefix-cache hits)."""
    hf, engine = backend_engine(arch, tmp_path, max_num_batched_tokens=16,
                                num_blocks=pool_blocks(arch))
    assert isinstance(engine.runner.model, TransformersModel)
    check_a_busy_engine(hf, engine, arch)


@pytest.mark.parametrize("path", ["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("arch", matrix(MOE_ARCHS, MOE_KEEP))
def test_native_moe_matches_transformers(arch, path, tmp_path, monkeypatch):
    """The native MoE path (models/arch/moe.py) through the same batching, chunked prefill, preemption
    and prefix hits, with the C kernels and packed linears and without them."""
    if path == "pytorch-only":
        monkeypatch.setenv("BATCHRUN_DISABLE_KERNELS", "1")
        monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    hf, engine = backend_engine(arch, tmp_path, impl="native", max_num_batched_tokens=16,
                                num_blocks=24)
    assert isinstance(engine.runner.model, MoeModel)
    assert (engine.runner.model.cpu_kernels is None) == (path == "pytorch-only")
    check_a_busy_engine(hf, engine, arch)


def check_a_busy_engine(hf, engine, arch):
    """Mixed prompt lengths, preemption and prefix hits in `engine`, against hf's generate."""
    gen = torch.Generator().manual_seed(2)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 23, 40, 3)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    report = ParityReport()
    check_against_transformers(hf, prompts, engine.generate(prompts, params), arch, report)
    assert engine.stats.num_preemptions > 0
    sharing = [prompts[2][:32] + torch.randint(3, vocab, (n,), generator=gen).tolist()
               for n in (4, 9)]
    cached = engine.stats.cached_tokens
    check_against_transformers(hf, sharing, engine.generate(sharing, params), arch, report)
    # A windowed layer handed back prompts[2]'s blocks before position 32 as it moved on, and
    # the small pool reused them: the first sharing prompt misses, the second hits its blocks.
    hits = 1 if windowed(arch) else 2
    assert engine.stats.cached_tokens - cached >= hits * 28
    assert report.compared == 6
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


# The native model files beyond Llama: Gemma (GeGLU, (1 + w) norms), Gemma 2 (soft-capping,
# alternating 8-token windows), Gemma 3 (q/k norms, local RoPE base), Phi-3 (fused checkpoint
# weights; LongRoPE on half the head, a window on every layer), windowed Mistral, StableLM
# (LayerNorm with bias; q/k/v bias, per-head q/k norms and rotary on a quarter of the head; or
# the parallel residual, full rotary, tied embeddings), BLOOM (ALiBi in the attention kernels,
# LayerNorms with biases and random weights, per-head interleaved q/k/v), Falcon (RoPE; new
# decoder architecture's K/V groups and two norms, multi-query with one parallel norm, or
# sequential with per-head q/k/v and biases), GPT-Neo (learned positions, unscaled scores,
# 8-token local layers between global ones).
NATIVE_FILES = {"gemma": "gemma", "gemma2": "gemma", "gemma3_text": "gemma", "phi3": "llama",
                "phi3-longrope": "llama", "mistral": "llama", "stablelm": "stablelm",
                "stablelm-parallel": "stablelm", "bloom": "bloom", "falcon": "falcon",
                "falcon-mqa": "falcon", "falcon-seq": "falcon", "gpt_neo": "gpt_neo"}


@pytest.mark.parametrize("path", ["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("arch", matrix(sorted(NATIVE_FILES), NATIVE_KEEP))
def test_native_greedy_and_logprobs_match_transformers(arch, path, tmp_path, monkeypatch):
    """The same batch on the native path: the C kernels' windowed and soft-capped attention, or
    without them (BATCHRUN_DISABLE_KERNELS) the SDPA backend's."""
    if path == "pytorch-only":
        monkeypatch.setenv("BATCHRUN_DISABLE_KERNELS", "1")
    hf, engine = backend_engine(arch, tmp_path, impl="native", max_num_batched_tokens=16,
                                num_blocks=pool_blocks(arch))
    model = engine.runner.model
    assert type(model).__module__ == f"batchrun.models.arch.{NATIVE_FILES[arch]}"
    assert (model.cpu_kernels is None) == (path == "pytorch-only")
    check_a_busy_engine(hf, engine, arch)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "gemma2", "gemma3_text",
                                  "phi3-longrope", *MOE_ARCHS])
def test_backend_equals_native_path(arch, tmp_path):
    _, native = backend_engine(arch, tmp_path / "n", impl="native", max_num_batched_tokens=32)
    _, ours = backend_engine(arch, tmp_path / "t", max_num_batched_tokens=32)
    assert not isinstance(native.runner.model, TransformersModel)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 30, 2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    for i, (a, b) in enumerate(zip(native.generate(prompts, params), ours.generate(prompts, params))):
        a, b = a.outputs[0], b.outputs[0]
        margins = [lp.top[0][1] - lp.top[1][1] for lp in a.logprobs]
        assert_greedy_match(b.token_ids, a.token_ids, margins, f"{arch}[{i}]")
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), 16)
        for x, y in zip(a.logprobs[:n], b.logprobs[:n]):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "llama4_text"])
def test_prompt_logprobs_embeddings_and_n(arch, tmp_path):
    """Prompt scoring and final hidden states against one transformers forward; n > 1 sampling."""
    hf, engine = backend_engine(arch, tmp_path, max_num_batched_tokens=16)
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    ref_lp = torch.log_softmax(out.logits[0].float(), -1)
    scored = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    ours = scored.prompt_logprobs.logprob
    assert ours[0] is None
    expected = [float(ref_lp[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert ours[1:] == pytest.approx(expected, abs=2e-3)
    pooled = engine.generate([prompt], SamplingParams(max_tokens=0, pooling=PoolingParams(
        "last", normalize=False)))[0].embedding
    torch.testing.assert_close(torch.tensor(pooled), out.hidden_states[-1][0, -1].float(),
                               atol=1e-4, rtol=1e-4)
    sampled = engine.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=0,
                                                       max_tokens=5))[0]
    assert len(sampled.outputs) == 3 and all(len(o.token_ids) == 5 for o in sampled.outputs)


def test_windowed_and_sink_layers_take_the_engine_kernels_with_their_window(tmp_path,
                                                                          monkeypatch):
    from batchrun.models.transformers import attention

    calls = []  # every layer goes through paged_attention (no reference_attention is imported)
    real = attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention", lambda *a, **k: (
        calls.append(("paged_attention", k.get("window"))), real(*a, **k))[1])
    _, engine = backend_engine("gemma3_text", tmp_path / "g")  # layer 0: a window of 8; 1 full
    calls.clear()
    engine.generate([list(range(3, 8))], SamplingParams(max_tokens=1))
    assert calls == [("paged_attention", None)] * 2  # 5 tokens: the window changes nothing
    calls.clear()
    engine.generate([list(range(3, 23))], SamplingParams(max_tokens=1))
    assert calls == [("paged_attention", 8), ("paged_attention", None)]
    calls.clear()
    _, engine = backend_engine("gpt_oss", tmp_path / "o")  # sinks on every layer
    calls.clear()
    engine.generate([list(range(3, 23))], SamplingParams(max_tokens=1))
    assert calls == [("paged_attention", 8), ("paged_attention", None)]


def test_chunked_layers_attend_with_their_chunk(tmp_path, monkeypatch):
    """Llama 4's chunked layers (0 and 2) pass their 8-token chunk to paged_attention once a
    context is longer than a chunk; its NoPE layers (1 and 3) attend to everything."""
    from batchrun.models.transformers import attention

    calls = []
    real = attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention", lambda *a, **k: (
        calls.append((k.get("window"), k.get("chunk"))), real(*a, **k))[1])
    _, engine = backend_engine("llama4_text", tmp_path)
    calls.clear()
    engine.generate([list(range(3, 8))], SamplingParams(max_tokens=1))
    assert calls == [(None, None)] * 4  # 5 tokens: one chunk, nothing to cut
    calls.clear()
    engine.generate([list(range(3, 23))], SamplingParams(max_tokens=1))
    assert calls == [(None, 8), (None, None)] * 2
    assert [(g.chunked, g.window) for g in engine.kv.groups.groups] == [
        (False, None), (True, 8)]


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_tiny("qwen3_moe", tmp_path / "one", archs=BACKEND_ARCHS)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    config = EngineConfig.default(model_impl="transformers", block_size=4)
    model = load_weights(tmp_path / "sharded", config, CPU, torch.float32)
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)
    prompt = [5, 9, 200, 17, 33]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    top = out[0].outputs[0].logprobs[0].top
    assert [t for t, _ in top] == ref.topk(5).indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(ref.topk(5).values.tolist(), abs=1e-4)


def _paged_layout(ctx, q_lens, block_size, num_blocks, gen):
    """Block tables, slots and metadata of sequences with context `ctx` after a step computing
    their last `q_lens` tokens, their blocks scattered over the pool."""
    from batchrun.engine.attention import AttentionMetadata

    width = max(-(-c // block_size) for c in ctx)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[:len(ctx) * width].view(len(ctx), width)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(ctx)), torch.tensor(q_lens))
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(slot_mapping=slots, block_size=block_size, block_tables=tables,
                             query_start=torch.tensor([0] + q_lens).cumsum(0),
                             context_lens=torch.tensor(ctx), positions=positions)
    return tables, meta


@pytest.mark.parametrize("window,softcap,sinks", [
    (None, None, False), (5, None, False), (None, 3.0, False), (None, None, True),
    (4, 2.0, True)])
def test_reference_attention_matches_dense_float64(window, softcap, sinks):
    gen = torch.Generator().manual_seed(5)
    h, hkv, d, bs = 4, 2, 8, 4
    ctx, q_lens = [9, 1, 14, 6, 3], [1, 1, 6, 6, 2]  # decodes, a chunk over context, fresh prompts
    tables, meta = _paged_layout(ctx, q_lens, bs, 32, gen)
    pool = (32 * bs, hkv, d)
    k_cache = torch.randn(pool, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(pool, generator=gen, dtype=torch.float64)
    t = sum(q_lens)
    q = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    sink = torch.randn(h, generator=gen, dtype=torch.float64) if sinks else None
    out = reference_attention(q, k, v, k_cache, v_cache, meta, 0.3, sliding_window=window,
                              softcap=softcap, sinks=sink)
    row = 0
    for s, (c, n) in enumerate(zip(ctx, q_lens)):
        kpos = torch.arange(c)
        kslots = tables[s, kpos // bs] * bs + kpos % bs
        keys, values = k_cache[kslots], v_cache[kslots]  # the step's K/V were written there
        torch.testing.assert_close(keys[c - n:], k[row:row + n])
        for i in range(n):
            p = c - n + i
            seen = (kpos <= p) & ((p - kpos < window) if window else True)
            scores = torch.einsum("hd,lhd->hl", q[row + i], keys.repeat_interleave(2, 1)) * 0.3
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~seen, float("-inf"))
            if sinks:
                scores = torch.cat([scores, sink[:, None]], -1)
            probs = torch.softmax(scores, -1)[:, :c]
            expected = torch.einsum("hl,lhd->hd", probs, values.repeat_interleave(2, 1))
            torch.testing.assert_close(out[row + i], expected, rtol=1e-10, atol=1e-10)
        row += n


@pytest.mark.parametrize("dk,dv", [(16, 8), (8, 16)])
def test_key_and_value_head_dims_may_differ(dk, dv):
    from types import SimpleNamespace

    from batchrun.models.transformers import attention
    from batchrun.models.transformers.probe import prefill_meta

    gen = torch.Generator().manual_seed(6)
    n, width = 5, max(dk, dv)
    q, k = (torch.randn(1, h, n, dk, generator=gen) for h in (4, 2))
    v = torch.randn(1, 2, n, dv, generator=gen)
    caches = [(torch.zeros(n, 2, width), torch.zeros(n, 2, width))]
    with attention.step(caches, prefill_meta(n, CPU), n):
        out, _ = attention.batchrun_attention(SimpleNamespace(layer_idx=0), q, k, v, None, 0.5)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    expected = attend(q[0].transpose(0, 1)[None], k[0].transpose(0, 1)[None],
                      v[0].transpose(0, 1)[None], causal, 0.5)
    torch.testing.assert_close(out, expected)


def test_attend_keeps_the_query_dtype():
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    kv = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)
    assert attend(q, kv, kv, torch.ones(1, 2, 3, dtype=torch.bool), 0.5).dtype == torch.bfloat16


def _config(model_type, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


def test_auto_picks_native_where_it_runs_the_model_exactly():
    llama = _config("llama", architectures=["LlamaForCausalLM"])
    assert choose(llama).impl == "native"
    assert choose(llama, "transformers").impl == "transformers"
    for model_type, arch in [("gemma", "GemmaForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                             ("gemma3_text", "Gemma3ForCausalLM"), ("phi3", "Phi3ForCausalLM"),
                             ("gpt_oss", "GptOssForCausalLM"),
                             ("qwen3_next", "Qwen3NextForCausalLM")]:
        assert choose(_config(model_type, architectures=[arch])).impl == "native", model_type
    windowed = _config("mistral", architectures=["MistralForCausalLM"], sliding_window=64,
                       max_position_embeddings=4096)
    assert choose(windowed).impl == "native"
    olmo = choose(_config("olmo2", architectures=["Olmo2ForCausalLM"]))
    assert olmo.impl == "transformers" and "model type 'olmo2'" in olmo.note
    # Phi-3.5's LongRoPE: transformers switches whole calls to the long factors past 4096
    long_rope = _config("phi3", architectures=["Phi3ForCausalLM"], max_position_embeddings=131072,
                        original_max_position_embeddings=4096, rope_parameters={
                            "rope_type": "longrope", "rope_theta": 10000.0,
                            "original_max_position_embeddings": 4096,
                            "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    verdict = choose(long_rope)
    assert verdict.impl == "transformers" and "LongRoPE beyond the original context" in verdict.note
    with pytest.raises(UnsupportedModelError, match="LongRoPE"):
        choose(long_rope, "native")


@pytest.mark.parametrize("model_type,kw,reason", [
    ("bailing_hybrid", {}, "recurrent"),
    ("t5", {}, "encoder-decoder"),
    ("llama", {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]},
     "linear_attention layers"),
    ("cpmant", {}, "CPM-Ant attends bidirectionally"),
    ("megatron-bert", {"is_decoder": False}, "without is_decoder in its config attends both ways"),
    ("minicpmv4_6", {}, "names no image placeholder token"),
])
def test_refused_with_the_reason(model_type, kw, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        choose(_config(model_type, **kw))


def test_a_bidirectional_encoder_is_refused_at_load(tmp_path):
    from transformers import BertConfig, BertLMHeadModel

    BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(tmp_path)
    config = EngineConfig.default(model_impl="transformers")
    with pytest.raises(UnsupportedModelError, match="attends bidirectionally"):
        load_weights(tmp_path, config, CPU, torch.float32)


def test_doge_with_a_learned_dynamic_mask_is_refused_at_load(tmp_path):
    """A trained Doge's A is not zero: its per-key bias changes transformers' scores, which the
    paged attention would not add (the random tiny Doge's A is zero: it runs, in the matrix)."""
    hf = make_tiny("doge", tmp_path / "zero", archs=BACKEND_ARCHS)
    for layer in hf.model.layers:
        torch.nn.init.uniform_(layer.self_attn.A, 0.5, 1.5)
    hf.save_pretrained(tmp_path / "learned")
    config = EngineConfig.default(model_impl="transformers")
    with pytest.raises(UnsupportedModelError, match="dynamic mask attention"):
        load_weights(tmp_path / "learned", config, CPU, torch.float32)


def test_cli_refuses_with_exit_code_2_and_runs_json_mode(tmp_path, smol_tokenizer):
    import json

    from transformers import AutoConfig

    from tests.helpers import batchrun

    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": [{"role": "user", "content": "JSON?"}],
                                          "max_tokens": 6, "response_format": {
                                              "type": "json_object"}}}) + "\n")
    hybrid = tmp_path / "bailing_hybrid"
    AutoConfig.for_model("bailing_hybrid", vocab_size=64, hidden_size=32,
                         num_hidden_layers=1).save_pretrained(hybrid)
    smol_tokenizer.save_pretrained(hybrid)
    refused = batchrun("run", lines, "-o", tmp_path / "o.jsonl", "--model", hybrid, real=True,
                       text=True)
    assert refused.returncode == 2
    assert "bailing_hybrid keeps a recurrent (state-space / linear-attention) state" in refused.stderr
    gemma2 = tmp_path / "gemma2"
    make_tiny("gemma2", gemma2, archs=BACKEND_ARCHS, vocab_size=len(smol_tokenizer))
    smol_tokenizer.save_pretrained(gemma2)
    ran = batchrun("run", lines, "-o", tmp_path / "out.jsonl", "--model", gemma2,
                   "--model-impl", "transformers", "--progress", "none", real=True, text=True)
    assert ran.returncode == 0, ran.stderr
    body = json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]
    assert body["choices"][0]["message"]["content"].startswith("{")


def _models_cli(*args):
    from click.testing import CliRunner

    from batchrun.models_cli import models

    return CliRunner().invoke(models, list(map(str, args)))


def test_models_check_reads_the_config_only(tmp_path):
    from transformers import AutoConfig

    hf = make_tiny("gemma2", tmp_path / "gemma2", archs=BACKEND_ARCHS)
    (tmp_path / "gemma2" / "model.safetensors").unlink()  # no weights are read
    result = _models_cli("check", tmp_path / "gemma2")
    assert result.exit_code == 0, result.output
    assert "path: native (models/arch/gemma.py) (it runs the model exactly)" in result.output
    count = sum(p.numel() for p in hf.parameters())
    assert f"parameters: {count:,} ({count * 4 / 2**20:.1f} MiB in fp32" in result.output
    assert "2 layers x 2 KV heads x head dim 32: fp32 1.0 KiB, bf16 512 B per token" in result.output
    assert "sliding window: 8 tokens on 1 of 2 layers" in result.output
    assert "LoRA: yes: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (on the " \
        "fused qkv_proj and gate_up_proj)" in result.output
    make_tiny("olmo2", tmp_path / "olmo2", archs=BACKEND_ARCHS)
    backend = _models_cli("check", tmp_path / "olmo2").output
    assert "path: transformers backend (the native path does not run it: model type 'olmo2'" \
        in backend
    assert "LoRA: yes: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (the " \
        "plain linears of its decoder layers)" in backend
    make_tiny("llama", tmp_path / "llama")
    native = _models_cli("check", tmp_path / "llama").output
    assert "path: native (models/arch/llama.py)" in native and "LoRA: yes: q_proj" in native
    make_tiny("qwen3_moe", tmp_path / "moe", archs=BACKEND_ARCHS)
    moe = _models_cli("check", tmp_path / "moe").output
    assert "path: native (models/arch/moe.py)" in moe and "MoE: 4 experts, 2 per token" in moe
    make_tiny("gpt_oss", tmp_path / "gpt_oss", archs=BACKEND_ARCHS)
    oss = _models_cli("check", tmp_path / "gpt_oss").output
    assert "path: native (models/arch/gpt_oss.py) (it runs the model exactly)" in oss
    assert "attention sinks: yes (in the engine's attention kernels)" in oss
    assert "LoRA: yes: q_proj, k_proj, v_proj, o_proj (on the fused qkv_proj); not the " \
        "experts" in oss  # no dense layers to name
    # a recurrent family whose layers the backend does not run yet (Mamba's and others' run: test_state_models)
    AutoConfig.for_model("bailing_hybrid", vocab_size=64, hidden_size=32,
                         num_hidden_layers=1).save_pretrained(tmp_path / "m")
    refused = _models_cli("check", tmp_path / "m")
    assert refused.exit_code == 2 and "path: refused (unsupported model: bailing_hybrid" \
        in refused.output
    assert "transformers backend" in _models_cli("list").output


def test_plan_sizes_backend_models_and_says_why_it_refuses_one(tmp_path):
    """footprint.model_config_for (what `batchrun plan` sizes) takes the backend's models with
    the KV shape the load's probe finds (GPT-NeoX ignores num_key_value_heads: 4 KV heads, not
    the config's 2), and refuses what models check refuses, saying why."""
    from transformers import AutoConfig

    from batchrun.footprint import model_config_for
    from batchrun.models.transformers.model import load

    make_tiny("gpt_neox", tmp_path / "neox", archs=BACKEND_ARCHS)
    cfg = model_config_for(str(tmp_path / "neox"))
    loaded = load(tmp_path / "neox", torch.device("cpu"), torch.float32).config
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.layer_windows) == \
        (loaded.num_kv_heads, loaded.head_dim, loaded.layer_windows) == (4, 32, (None, None))
    assert "2 layers x 4 KV heads" in _models_cli("check", tmp_path / "neox").output
    AutoConfig.for_model("bailing_hybrid", vocab_size=64, hidden_size=32,
                         num_hidden_layers=1).save_pretrained(tmp_path / "m")
    with pytest.raises(UnsupportedModelError,
                       match="bailing_hybrid keeps a recurrent .*`batchrun models check"):
        model_config_for(str(tmp_path / "m"))


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_indexed_attention_selects_the_indexers_top_k_on_the_cache(arch, tmp_path, monkeypatch):
    """DeepSeek-V3.2's and GLM-MoE-DSA's indexers pick each query's top-k keys (8 here) from
    the indexer keys our V cache keeps, past the top-k, through mixed prompt lengths, chunked
    prefill, preemption, prefix hits and n = 2, as transformers' generate (its own indexer)
    does; models check says so, with no cap on the context."""
    from batchrun.models.transformers import attention

    selected = []
    real = attention.selected_attention
    monkeypatch.setattr(attention, "selected_attention",
                        lambda *a: selected.append(1) or real(*a))
    hf, engine = backend_engine(arch, tmp_path, max_num_batched_tokens=16, num_blocks=24)
    assert engine.runner.model.config.max_position_embeddings == 256  # not index_topk
    check_a_busy_engine(hf, engine, arch)
    assert selected  # the sparse path ran (the dense one alone differs: the load check says)
    # n = 2 forks a sequence past the top-k (its blocks, indexer keys included, shared)
    prompt = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    forked = engine.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True))[0]
    ref, _ = hf_greedy(hf, prompt, MAX_TOKENS)
    assert [o.token_ids for o in forked.outputs] == [ref, ref]
    check = _models_cli("check", tmp_path).output
    assert "indexed (sparse) attention: each query attends to its indexer's top-k (8 tokens)" \
        in check
    if arch == "glm_moe_dsa":  # V as wide as K: 32 / 4 heads more columns for the keys
        assert "3 layers x 4 KV heads x head dim 32 (held 40 wide: the indexer's keys beside " \
            "V): fp32 3.8 KiB" in check


def test_an_indexer_not_run_on_the_cache_caps_the_context():
    """HY-V4's indexer does not select on the cache: its model runs dense, exact within the
    top-k, with the context capped there, and models check names the family."""
    from batchrun.models.transformers.config_features import features
    from batchrun.models.transformers.indexed import dense_context, key_dim
    from transformers import HYV4Config

    config = HYV4Config(index_topk=64)
    assert dense_context(config) == 64 and key_dim(config) == 0
    wording = dict(features(config, "transformers", "no"))["indexed (sparse) attention"]
    assert wording.startswith("run dense, which is exact up to the indexer's top-k (64 tokens)")
    assert "hy_v4" in wording
