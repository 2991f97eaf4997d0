"""The native MoE path's parts against transformers' own: the experts block (both grouped-GEMM
routes; GPT-OSS's biased, clamped experts), loading transformers 5's fused 3-D expert tensors as
well as the per-expert layout, and what --quantization takes on GPT-OSS."""

import pytest
import torch
from safetensors.torch import save_file

from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, load_weights
from batchrun.models.layers import grouped_gemm
from batchrun.models.arch import gpt_oss
from batchrun.models.arch.moe import Experts, ModelConfig
from batchrun.options.engine import EngineConfig
from tests.helpers import kernel_library
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, make_tiny

CPU = torch.device("cpu")


ROUTES = ["C kernel", "C kernel (portable)", "torch._grouped_mm", "gather-bmm"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_experts_match_transformers_experts(route, tokens, monkeypatch):
    """Some of the 16 experts get no token (1 token x top-2), some several; the C kernel takes
    up to 16 rows per active expert, so 40 tokens go through it only when forced to."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cpu_kernels = None
    if route.startswith("C kernel"):
        cpu_kernels = kernel_library("portable" if "portable" in route else "native")
        if cpu_kernels is None:
            pytest.skip("no C compiler here")
        monkeypatch.setattr(grouped_gemm, "KERNEL_ROWS_PER_EXPERT", 80)
    elif route == "gather-bmm":
        monkeypatch.setattr(grouped_gemm, "_native_grouped_mm", lambda *_: False)
    else:
        assert grouped_gemm._native_grouped_mm("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=24, moe_intermediate_size=20, num_experts=16))
    ours = Experts(16, 24, 20)
    with torch.no_grad():
        for p in (hf.gate_up_proj, hf.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen))
        ours.load_state_dict(hf.state_dict())
        x = torch.randn(tokens, 24, generator=gen)
        chosen = torch.rand(tokens, 16, generator=gen).topk(2, dim=-1).indices
        weights = torch.rand(tokens, 2, generator=gen)
        got = ours(x, chosen, weights, cpu_kernels)
        # outputs of size ~10: float32 summation order
        torch.testing.assert_close(got, hf(x, chosen, weights), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("route", ["C kernel", "torch._grouped_mm"])
def test_gpt_oss_experts_match_transformers(route, monkeypatch):
    """GPT-OSS's experts: biases, gate/up interleaved in transformers' [experts, hidden, 2I],
    and the activation's clamps (inputs large enough that gate > limit and |up| > limit occur)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cpu_kernels = None
    if route == "C kernel":
        cpu_kernels = kernel_library()
        if cpu_kernels is None:
            pytest.skip("no C compiler here")
        monkeypatch.setattr(grouped_gemm, "KERNEL_ROWS_PER_EXPERT", 80)
    hf_cfg = GptOssConfig(hidden_size=24, intermediate_size=20, num_local_experts=8,
                          num_experts_per_tok=2, swiglu_limit=2.0)
    hf_cfg._experts_implementation = "eager"  # transformers' own loop over experts
    hf = GptOssExperts(hf_cfg)
    gen = torch.Generator().manual_seed(2)
    cfg = gpt_oss.ModelConfig.from_hf(GptOssConfig(
        hidden_size=24, intermediate_size=20, num_local_experts=8, num_experts_per_tok=2,
        swiglu_limit=2.0, architectures=["GptOssForCausalLM"]))
    ours = gpt_oss.ClampedExperts(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
            getattr(ours, name).copy_(gpt_oss.expert_tensor(name, p))
        x = torch.randn(9, 24, generator=gen)
        chosen = torch.rand(9, 8, generator=gen).topk(2, dim=-1).indices
        weights = torch.rand(9, 2, generator=gen)
        gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
        assert (gate_up[:, ::2] > 2).any() and (gate_up[:, 1::2].abs() > 2).any()
        torch.testing.assert_close(ours(x, chosen, weights, cpu_kernels), hf(x, chosen, weights),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", ["native", "portable"])
def test_expert_kernel_against_float64(path):
    """The C kernel alone: runs of 1 to 19 rows per expert (its blocks of 8 rows and the
    remainders), an odd output width (its pairs of weight rows and the last one alone) and an
    input width off the vector lanes, against a float64 product per expert."""
    lib = kernel_library(path)
    if lib is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 33, 40, generator=gen)
    counts = torch.tensor([3, 0, 19, 1, 8, 9])
    x = torch.randn(int(counts.sum()), 40, generator=gen)
    active = counts.nonzero().squeeze(1)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), counts[active].cumsum(0)])
    got = lib.expert_gemm(x, w, active, bounds)
    want = torch.cat([x[int(bounds[i]):int(bounds[i + 1])].double() @ w[e].double().T
                      for i, e in enumerate(active.tolist())])
    assert float((got.double() - want).abs().max()) < 1e-4


def test_expert_kernel_in_bfloat16():
    """bfloat16 weights and rows, float32 sums: within bfloat16 rounding of the float32 result."""
    lib = kernel_library()
    if lib is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(1)
    experts = Experts(8, 40, 24)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        x = torch.randn(5, 40, generator=gen)
        chosen = torch.rand(5, 8, generator=gen).topk(2, dim=-1).indices
        weights = torch.rand(5, 2, generator=gen)
        want = experts(x, chosen, weights)
        got = experts.to(torch.bfloat16)(x.bfloat16(), chosen, weights.bfloat16(), lib)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_fused_expert_checkpoint_loads(tmp_path):
    """A checkpoint holding `mlp.experts.gate_up_proj` [experts, 2I, H] (transformers 5's
    in-memory layout) runs like the per-expert one save_pretrained writes."""
    import shutil

    hf = make_tiny("qwen3_moe", tmp_path / "per_expert", archs=BACKEND_ARCHS)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(tmp_path / "per_expert" / "config.json", fused)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors")
    prompt = [5, 9, 200, 17, 33, 101, 7]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    for path in (tmp_path / "per_expert", fused):
        config = EngineConfig.default(model_impl="native", block_size=4)
        engine = build_engine(load_weights(path, config, CPU, torch.float32), IdTokenizer(),
                              config, [2], CPU, torch.float32)
        top = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                       logprobs=5))[0].outputs[0].logprobs[0].top
        assert [t for t, _ in top] == ref.topk(5).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(ref.topk(5).values.tolist(), abs=1e-4)


def test_a_missing_expert_is_refused(tmp_path):
    from safetensors.torch import load_file

    make_tiny("mixtral", tmp_path, archs=BACKEND_ARCHS)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, tmp_path / "model.safetensors")
    config = EngineConfig.default(model_impl="native")
    with pytest.raises(ValueError, match=r"lacks expert weights of layers.1.mlp.experts.gate_up_proj"
                                         r": \(expert, shard\) \[\(2, 1\)\]"):
        load_weights(tmp_path, config, CPU, torch.float32)


@pytest.mark.parametrize("model_type,arch,kw,sparse", [
    ("qwen3_moe", "Qwen3MoeForCausalLM", {"decoder_sparse_step": 2}, (False, True, False, True)),
    ("qwen2_moe", "Qwen2MoeForCausalLM", {"mlp_only_layers": [0, 3]}, (False, True, True, False)),
    ("mixtral", "MixtralForCausalLM", {}, (True, True, True, True)),
])
def test_sparse_layers_follow_the_config(model_type, arch, kw, sparse):
    """Which layers are MoE, as transformers' own decoder layers decide."""
    import transformers
    from transformers import AutoConfig

    hf = AutoConfig.for_model(model_type, num_hidden_layers=4, hidden_size=32,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                              vocab_size=64, **kw)
    hf.architectures = [arch]
    assert ModelConfig.from_hf(hf).sparse_layers == sparse
    model = getattr(transformers, arch)(hf)
    assert tuple("Sparse" in type(layer.mlp).__name__ for layer in model.model.layers) == sparse


def test_quantization_on_gpt_oss_takes_its_attention_linears_only(tmp_path):
    """--quantization int8-weight: q/k/v/o quantized; the router a float linear, the experts'
    3-D weights float; the next token's logprob that of transformers on the dequantised weights
    (per output channel, so quantizing the fused q/k/v is quantizing each)."""
    from batchrun.models.quant.int8_linear import Int8WeightLinear, quantize_per_channel

    hf = make_tiny("gpt_oss", tmp_path, archs=BACKEND_ARCHS)
    config = EngineConfig.default(model_impl="native", block_size=4, quantization="int8-weight")
    model = load_weights(tmp_path, config, CPU, torch.float32)
    for layer in model.layers:
        assert isinstance(layer.self_attn.qkv_proj, Int8WeightLinear)
        assert isinstance(layer.self_attn.o_proj, Int8WeightLinear)
        assert not isinstance(layer.mlp.gate, Int8WeightLinear)
        assert all(p.dtype == torch.float32 for p in layer.mlp.experts.parameters())
    engine = build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)
    prompt = list(range(3, 30))
    with torch.no_grad():
        for attn in (layer.self_attn for layer in hf.model.layers):
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                q, scale = quantize_per_channel(proj.weight)
                proj.weight.copy_(q.float() * scale[:, None])
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    top = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=1)
                          )[0].outputs[0].logprobs[0].top
    assert top[0][0] == int(ref.argmax())
    assert top[0][1] == pytest.approx(float(ref.max()), abs=1e-4)
