"""The CUDA path: Triton paged decode attention, CUDA-graph decode steps, parity with transformers.

Skipped without a CUDA device (CI has none); run on a GPU machine with `pytest tests/unit/test_cuda.py`.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_engine(tmp_path, dtype=torch.float32, **overrides):
    from transformers import AutoConfig

    from batchrun.options.engine import EngineConfig
    from batchrun.llm import build_engine, build_model
    from batchrun.models.arch.llama import LlamaModel, ModelConfig
    from tests.tiny_models import IdTokenizer, make_tiny

    hf = make_tiny("llama", tmp_path).cuda()
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    dev = torch.device("cuda")
    model = build_model(LlamaModel, cfg, tmp_path, dev, dtype)
    overrides.setdefault("block_size", 16)
    engine = build_engine(model, IdTokenizer(), EngineConfig.default(device="cuda", **overrides),
                          [2], dev, dtype)
    return hf, engine


def test_triton_kernel_matches_gather_path():
    from batchrun.engine.attention import paged_attention
    from batchrun.engine.attention.cuda_triton import TritonMetadata
    from tests.unit.test_attention_kernel import paged_problem

    q, k, v, kc, vc, reference, kernel = paged_problem(torch.float32)
    to = lambda t: t.cuda()  # noqa: E731
    reference.slot_mapping, reference.decode_slots, reference.decode_bias = map(
        to, (reference.slot_mapping, reference.decode_slots, reference.decode_bias))
    kernel = TritonMetadata(
        slot_mapping=to(kernel.slot_mapping), block_size=4, block_tables=to(kernel.block_tables),
        query_start=to(kernel.query_start), context_lens=to(kernel.context_lens),
        positions=to(kernel.positions), num_decode=kernel.num_decode,
        decode_tables=to(kernel.decode_tables), decode_lens=to(kernel.decode_lens))
    q, k, v, kc, vc = map(to, (q, k, v, kc, vc))
    expected = paged_attention(q, k, v, kc.clone(), vc.clone(), reference, 32 ** -0.5)
    got = paged_attention(q, k, v, kc, vc, kernel, 32 ** -0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_matches_transformers_on_cuda(tmp_path, graphs):
    from batchrun.engine import SamplingParams
    from tests.parity import assert_greedy_match

    hf, engine = cuda_engine(tmp_path, cuda_graphs=graphs, max_num_seqs=16,
                             max_num_batched_tokens=64)
    assert (engine.runner.graphs is not None) == graphs
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 64, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                          pad_token_id=0)
        assert_greedy_match(out.outputs[0].token_ids, ref.sequences[0, len(p):].tolist(),
                            [l[0] for l in ref.logits], f"cuda prompt {i}")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bfloat16_runs_with_graphs(tmp_path):
    from batchrun.engine import SamplingParams

    _, engine = cuda_engine(tmp_path, dtype=torch.bfloat16, max_num_seqs=8)
    outs = engine.generate([[5, 6, 7, 8]] * 3, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
