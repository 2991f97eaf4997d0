"""End to end on CUDA: greedy decoding of a native model, a transformers-backend model, an MoE,
a vision-language model and a quantized checkpoint through `load_from_path` (the path a run
takes: CUDA graphs, Triton attention and GEMMs), against transformers' `generate` on the same
tiny random weights (float32 on the CPU, the tie rule of tests/parity.py).

Skipped without CUDA. BATCHRUN_E2E_DEVICE=cpu runs the very same tests on the CPU, which is how
they are checked where no GPU is (about 20 s); benchmarks/gpu_suite.py runs this file on a GPU.
"""

import os

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.llm import load_from_path
from batchrun.options.engine import EngineConfig
from tests.parity import ParityReport, assert_greedy_match

DEVICE = os.environ.get("BATCHRUN_E2E_DEVICE", "cuda")
MAX_TOKENS = 12

pytestmark = [
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs CUDA (BATCHRUN_E2E_DEVICE=cpu runs these on the CPU)"),
    pytest.mark.usefixtures("one_torch_thread"),
]


def load(path, **overrides):
    """The checkpoint at `path` as a run loads it, in float32 on DEVICE, with a small KV pool."""
    overrides = {"block_size": 16, "max_num_batched_tokens": 32, **overrides}
    config = EngineConfig.default(device=DEVICE, dtype="float32", num_blocks=256, threads=1,
                                  **overrides)
    return load_from_path(path, config)


def text_checkpoint(arch, path, smol_tokenizer, archs=None):
    """A tiny random checkpoint of `arch` with the bundled tokenizer beside it (prompts are token
    ids below the tiny vocabulary; the tokenizer only lets the folder load as a run's does)."""
    from tests.tiny_models import ARCHS, make_tiny

    hf = make_tiny(arch, path, archs=archs or ARCHS)
    smol_tokenizer.save_pretrained(path)
    return hf


def assert_decodes_as(loaded, hf, label: str) -> None:
    """Mixed-length prompts decoded together (a 32-token step budget chunks the long ones)
    against transformers' one-at-a-time greedy decoding on the CPU."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 64)]
    outs = loaded.engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                          ignore_eos=True))
    report = ParityReport()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                          pad_token_id=0)
        assert_greedy_match(out.outputs[0].token_ids, ref.sequences[0, len(prompt):].tolist(),
                            [lg[0] for lg in ref.logits], f"{label}[{i}] on {DEVICE}", report)
    assert report.compared == len(prompts)
    assert loaded.engine.kv.num_free_blocks == loaded.engine.kv.num_blocks


def test_native_model(tmp_path, smol_tokenizer):
    from batchrun.models.transformers.model import TransformersModel

    hf = text_checkpoint("llama3-rope", tmp_path, smol_tokenizer)
    loaded = load(tmp_path, model_impl="native")
    assert not isinstance(loaded.engine.runner.model, TransformersModel)
    assert (loaded.engine.runner.graphs is not None) == (DEVICE == "cuda")
    assert_decodes_as(loaded, hf, "llama")


def test_transformers_backend_model(tmp_path, smol_tokenizer):
    """Gemma 2 on the backend: sliding windows and logit soft-capping in the attention."""
    from batchrun.models.transformers.model import TransformersModel
    from tests.tiny_models import BACKEND_ARCHS

    hf = text_checkpoint("gemma2", tmp_path, smol_tokenizer, BACKEND_ARCHS)
    loaded = load(tmp_path, model_impl="transformers")
    assert isinstance(loaded.engine.runner.model, TransformersModel)
    assert_decodes_as(loaded, hf, "gemma2 (backend)")


def test_moe_model(tmp_path, smol_tokenizer):
    from batchrun.models.arch.moe import MoeModel
    from tests.tiny_models import BACKEND_ARCHS

    hf = text_checkpoint("qwen3_moe", tmp_path, smol_tokenizer, BACKEND_ARCHS)
    loaded = load(tmp_path, model_impl="native")
    assert isinstance(loaded.engine.runner.model, MoeModel)
    assert_decodes_as(loaded, hf, "qwen3_moe")


def test_quantized_checkpoint(tmp_path, smol_tokenizer):
    """A GPTQ int4 checkpoint (act-order, groups of 32) against transformers on the format's
    reference dequantisation of the same bytes."""
    from batchrun.models.quant.int4_linear import Int4WeightLinear
    from tests import quant_checkpoints as qc
    from tests.unit.test_quant_checkpoints import CASES

    config, pack, cls = CASES["gptq-act-order-g32"]
    hf = text_checkpoint("llama", tmp_path, smol_tokenizer)
    reference = qc.quantize_checkpoint(tmp_path, pack, config)
    loaded = load(tmp_path)
    assert type(loaded.engine.runner.model.layers[0].mlp.down_proj) is cls is Int4WeightLinear
    for prefix, weight in reference.items():
        hf.get_submodule(prefix).weight.data = torch.from_numpy(weight)
    assert_decodes_as(loaded, hf, "gptq int4")


def test_vision_language_model(tmp_path, smol_tokenizer):
    """Qwen2-VL: two requests with images of different sizes and a text-only one in one batch,
    prefilled in 16-token chunks that cut through the images."""
    from batchrun.models.transformers.processor import render
    from tests.tiny_vlms import image, make_tiny_vlm

    hf, _ = make_tiny_vlm("qwen2_vl", tmp_path, smol_tokenizer)
    loaded = load(tmp_path, model_impl="auto", block_size=4, max_num_batched_tokens=16)
    cases = {"one": [image(120, 90, 1)], "two": [image(150, 100, 2), image(28, 28, 3)],
             "none": []}
    engine = loaded.engine
    for rid, images in cases.items():
        prompt, mm = render(loaded.processor, _chat(len(images)), images)
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           multimodal=mm)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    for rid, images in cases.items():
        text = loaded.processor.apply_chat_template(_chat(len(images)), add_generation_prompt=True,
                                                    tokenize=False)
        inputs = loaded.processor(text=[text], images=images or None, return_tensors="pt")
        ref = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert done[rid] == ref[0, inputs["input_ids"].shape[1]:].tolist(), f"qwen2_vl {rid}"


def _chat(n_images: int):
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": "Describe it."}]
    return [{"role": "user", "content": parts}]
