"""The native Llama-family model against transformers on tiny random checkpoints."""

import pytest
import torch

from batchrun.config import EngineConfig
from batchrun.engine import SamplingParams
from batchrun.llm import build_engine, build_model
from batchrun.models.llama import LlamaModel, ModelConfig
from tests.parity import ParityReport, assert_greedy_match
from tests.tiny_models import ARCHS, IdTokenizer, make_tiny


def tiny_engine(arch, tmp_path, **overrides):
    from transformers import AutoConfig

    hf = make_tiny(arch, tmp_path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    model = build_model(LlamaModel, cfg, tmp_path, torch.device("cpu"), torch.float32)
    overrides.setdefault("block_size", 4)
    engine = build_engine(model, IdTokenizer(), EngineConfig.default(**overrides), [2],
                          torch.device("cpu"), torch.float32)
    return hf, engine


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


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_greedy_matches_transformers(arch, tmp_path):
    """Mixed-length prompts decoded together (chunked prefill, paged KV) vs one-at-a-time HF."""
    hf, engine = tiny_engine(arch, tmp_path, max_num_batched_tokens=32)
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
