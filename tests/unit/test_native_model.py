"""The native Llama-family model against transformers on tiny random checkpoints."""

import pytest
import torch

from batchrun.options.engine import EngineConfig
from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, build_model
from batchrun.models.arch.llama import LlamaModel, ModelConfig
from tests.helpers import tiny_engine
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import ARCHS, IdTokenizer, make_tiny


def hf_greedy(hf, prompt, max_new_tokens):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                      pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [l[0] for l in out.logits]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefill_logits_match_transformers(arch, tmp_path):
    hf, engine = tiny_engine(arch, tmp_path)
    prompt = torch.randint(3, 512, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(prompt).logits[0, -1]
    engine.add_request("r", prompt[0].tolist(), SamplingParams(temperature=0, max_tokens=1,
                                                                logprobs=5))
    out = engine.step()[0].outputs[0]
    ours_top = [t for t, _ in out.logprobs[0].top]
    assert ours_top == ref.topk(5).indices.tolist()
    ref_lp = torch.log_softmax(ref.float(), -1)
    assert out.logprobs[0].logprob == pytest.approx(float(ref_lp[out.token_ids[0]]), abs=1e-4)


@pytest.mark.parametrize("path", ["cpu-kernels", "pytorch-only"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_greedy_matches_transformers(arch, path, tmp_path, monkeypatch):
    """Mixed-length prompts decoded together (chunked prefill, paged KV) vs one-at-a-time HF,
    with the C kernels and packed linears, and with the plain PyTorch fallback they replace."""
    if path == "pytorch-only":
        monkeypatch.setenv("BATCHRUN_DISABLE_KERNELS", "1")
        monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")
    hf, engine = tiny_engine(arch, tmp_path, max_num_batched_tokens=32)
    assert (engine.runner.model.cpu_kernels is None) == (path == "pytorch-only")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 64, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    report = ParityReport()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, ref_logits = hf_greedy(hf, prompt, 24)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits, f"{arch}[{i}]", report)
    assert report.compared == len(prompts)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_fused_weights_are_the_checkpoint_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_PACKED_LINEAR", "0")  # packed weights no longer expose .weight
    hf, engine = tiny_engine("qwen2", tmp_path)
    layer = engine.runner.model.layers[0]
    ref = hf.model.layers[0]
    q = ref.self_attn.q_proj.weight.shape[0]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[:q], ref.self_attn.q_proj.weight)
    torch.testing.assert_close(layer.self_attn.qkv_proj.bias[q:q + 64], ref.self_attn.k_proj.bias)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight[256:], ref.mlp.up_proj.weight)


def test_bfloat16_on_cpu_tracks_float32_transformers(tmp_path):
    """--dtype bfloat16 on the CPU (bf16 packed GEMMs, bf16 KV read by the C kernel): over a
    prefill and 8 decode steps, our log-probabilities stray from transformers-fp32 no more than
    transformers' own bf16 run does (bf16 rounding is the only expected difference)."""
    import copy

    from transformers import AutoConfig

    hf = make_tiny("llama", tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    model = build_model(LlamaModel, cfg, tmp_path, torch.device("cpu"), torch.bfloat16)
    engine = build_engine(model, IdTokenizer(), EngineConfig.default(block_size=4), [2],
                          torch.device("cpu"), torch.bfloat16)
    prompt = torch.randint(3, 512, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                   logprobs=1))[0].outputs[0]
    ids = torch.tensor([prompt + out.token_ids])
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0, rows].float(), -1)
        hf_bf16 = torch.log_softmax(copy.deepcopy(hf).to(torch.bfloat16)(ids).logits[0, rows].float(), -1)
    tokens = torch.tensor(out.token_ids)
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    our_err = (ours - ref.gather(1, tokens[:, None])[:, 0]).abs().max()
    hf_err = (hf_bf16 - ref).gather(1, tokens[:, None]).abs().max()
    assert our_err <= 2 * hf_err + 0.02, (our_err, hf_err)
    # each greedy pick is the fp32 argmax or within bf16 noise of it
    assert (ref.max(-1).values - ref.gather(1, tokens[:, None])[:, 0]).max() <= 2 * hf_err + 0.02
