"""The generic vision path (models/transformers/vision.py) on families beyond the first six:
LLaVA-NeXT (anyres grids and newline features), LLaVA on a SigLIP tower with the "full" feature
strategy, Mistral 3 (Pixtral tower, [IMG_BREAK] rows), InternVL (tiles, pixel shuffle),
PaliGemma (prefix-LM: the whole prompt attends both ways), Qwen3-VL (interleaved M-RoPE,
deepstack features added inside the first decoder layers), LLaVA-OneVision, Idefics2 and
Aya Vision. Each tiny random model's greedy tokens
through the engine, prefilled in chunks that cut through images where the family allows, equal
transformers' generate on the same processor output (and a text-only line: PaliGemma's prefix
attends both ways without an image too); placeholder counts are the processor's."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.llm import load_from_path
from batchrun.models.transformers.processor import render
from batchrun.options.engine import EngineConfig
from tests.helpers import matrix
from tests.tiny_vlm_families import FAMILIES, make_tiny_vlm
from tests.tiny_vlms import image

MAX_TOKENS = 5
CASES = {"one": [image(120, 90, 1)], "two": [image(150, 100, 2), image(28, 28, 3)]}
STEP_TOKENS = {"paligemma": 64}  # its prompt attends both ways: one step must hold it


pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Anyres tiling, a SigLIP tower, a both-ways prefix, deepstack, a decoder with recurrent state
# (pytest --matrix: every family).
FAMILY_KEEP = {"llava_next", "llava_siglip", "paligemma", "qwen3_vl", "qwen3_5"}


def chat(n_images: int):
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": "Describe it."}]
    return [{"role": "user", "content": parts}]


def text_only(hf, loaded):
    """(engine tokens, transformers' greedy tokens) of a line without an image, its prompt the
    chat template's through the tokenizer as a text line is."""
    text = loaded.processor.apply_chat_template(chat(0), add_generation_prompt=True,
                                                tokenize=False)
    prompt = loaded.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    ours = loaded.engine.generate([prompt], SamplingParams(temperature=0,
                                                           max_tokens=MAX_TOKENS))[0]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return list(ours.outputs[0].token_ids), ref[0, len(prompt):].tolist()


def generate(hf, processor, images):
    """transformers' greedy tokens and the processor's prompt ids."""
    text = processor.apply_chat_template(chat(len(images)), add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return out[0, len(prompt):].tolist(), prompt


@pytest.mark.parametrize("family", matrix(FAMILIES, FAMILY_KEEP))
def test_greedy_tokens_match_generate(family, tmp_path, smol_tokenizer):
    hf, _ = make_tiny_vlm(family, tmp_path, smol_tokenizer)
    loaded = load_from_path(tmp_path, EngineConfig.default(
        model_impl="auto", block_size=4, max_num_batched_tokens=STEP_TOKENS.get(family, 16),
        num_blocks=256, threads=1))
    engine, model = loaded.engine, loaded.engine.runner.model
    rendered = {rid: render(loaded.processor, chat(len(imgs)), imgs)
                for rid, imgs in CASES.items()}
    for rid, (prompt, mm) in rendered.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           multimodal=mm)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    for rid, imgs in CASES.items():
        ref, prompt = generate(hf, loaded.processor, imgs)
        assert rendered[rid][0] == prompt
        mm = rendered[rid][1]
        # the processor's count per image: the placeholders the model's features fill
        assert sum(img.placeholders(model.image_token_id) for img in mm.images) == \
            prompt.count(model.image_token_id)
        assert done[rid] == ref, f"{family} {rid}"
    ours, ref = text_only(hf, loaded)  # PaliGemma's prefix attends both ways without an image
    assert ours == ref, f"{family} text only"
    if family == "paligemma":  # the both-ways prefix matters: causal attention answers otherwise
        assert rendered["one"][1].both_ways == [(0, len(rendered["one"][0]))]
        with torch.no_grad():
            text = loaded.processor.apply_chat_template(chat(1), add_generation_prompt=True,
                                                        tokenize=False)
            inputs = loaded.processor(text=[text], images=CASES["one"], return_tensors="pt")
            both = hf(**inputs).logits[0, -1]
            inputs["token_type_ids"] = torch.ones_like(inputs["token_type_ids"])  # a suffix
            causal = hf(**inputs).logits[0, -1]
        assert not torch.allclose(both, causal, atol=1e-4)


def test_families_it_cannot_run_exactly_are_refused_by_name():
    """Molmo 2 builds its own token-type attention masks: refused with the reason, where the
    generic path would answer wrong. The families above are accepted by their configs alone, and
    so is Llama 4 (its decoder's chunked attention layers are a KV-group kind the engine runs);
    its image path is left to the load check."""
    import transformers

    from batchrun.models.transformers.support import UnsupportedModelError, choose

    for cfg in (transformers.LlavaNextConfig(), transformers.Mistral3Config(),
                transformers.InternVLConfig(), transformers.PaliGemmaConfig(),
                transformers.Qwen3VLConfig()):
        assert choose(cfg, "auto").impl == "transformers"
    with pytest.raises(UnsupportedModelError, match="molmo2 builds its own attention masks"):
        choose(transformers.Molmo2Config(), "auto")
    # a decoder's layer kinds are read from the text config: Llama 4's chunked attention runs
    assert choose(transformers.Llama4Config(), "auto").impl == "transformers"


@pytest.mark.parametrize("family,broken,replacement", [
    ("paligemma", "place_both_ways", lambda cfg, prompt, mm: None),  # its prefix made causal
    ("qwen3_vl", "deepstack_inputs", lambda deep, layers: {}),  # no deepstack features
])
def test_the_load_check_refuses_an_image_path_that_answers_wrong(family, broken, replacement,
                                                                 tmp_path, smol_tokenizer,
                                                                 monkeypatch):
    """The load runs a synthetic image through the engine and through transformers' forward:
    a family whose image path leaves out what its model does differs, and is refused with the
    figure instead of served."""
    from batchrun.models.load_check import LoadCheckError
    from batchrun.models.transformers import vision

    make_tiny_vlm(family, tmp_path, smol_tokenizer)
    monkeypatch.setattr(vision, broken, replacement)
    with pytest.raises(LoadCheckError, match="with an image, the engine's logits differ"):
        load_from_path(tmp_path, EngineConfig.default(model_impl="auto", block_size=4,
                                                      num_blocks=256, threads=1))
