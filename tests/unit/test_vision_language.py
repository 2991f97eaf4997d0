"""Vision-language models on the engine (models/transformers/vision.py) against transformers'
generate on the same processor output: tiny random-weight VLMs of each family, images made here."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.llm import load_from_path
from batchrun.models.transformers.processor import render
from batchrun.options.engine import EngineConfig
from tests.tiny_vlms import image, make_tiny_vlm

MAX_TOKENS = 6
ENGINE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "idefics3", "smolvlm")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads on busy shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chat(n_images: int, text: str = "Describe it."):
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def reference(hf, processor, messages, images):
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def run(engine, requests):
    """{id: (token ids, cached tokens)} for requests [(id, prompt, multimodal)] run together."""
    for rid, prompt, mm in requests:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           multimodal=mm)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), out.num_cached_tokens)
    return done


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def family(request, tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    hf, processor = make_tiny_vlm(request.param, path, smol_tokenizer)
    config = EngineConfig.default(model_impl="auto", block_size=4, max_num_batched_tokens=16,
                                  num_blocks=256, threads=1)
    loaded = load_from_path(path, config)
    torch.set_num_threads(1)
    return request.param, hf, loaded


def test_greedy_tokens_match_generate(family):
    """One image, two images of different sizes, and a text-only line in one engine, prefilled
    in 16-token chunks that cut through the images; each image encoded once."""
    name, hf, loaded = family
    cases = {"one": [image(120, 90, 1)], "two": [image(150, 100, 2), image(28, 28, 3)],
             "none": []}
    requests = []
    for rid, images in cases.items():
        prompt, mm = render(loaded.processor, chat(len(images)), images)
        assert (mm is None) == (not images)
        requests.append((rid, prompt, mm))
    model = loaded.engine.runner.model
    before = model.encoder_cache.encoded
    cut = []  # (first, end) of a step's tokens that cover only part of an image's placeholders

    def spy(*args, images=(), **kwargs):
        for step in images:
            last = step.first + step.count
            cut.extend((a, b) for a, b in step.inputs.spans
                       if a < last and b > step.first and not (step.first <= a and b <= last))
        return forward(*args, images=images, **kwargs)

    forward = model.forward
    model.forward = spy
    try:
        done = run(loaded.engine, requests)
    finally:
        del model.forward
    assert cut, "no chunk boundary fell inside an image"
    for rid, images in cases.items():
        assert done[rid][0] == reference(hf, loaded.processor, chat(len(images)), images or None), \
            f"{name} {rid}"
    assert model.encoder_cache.encoded - before == 3  # chunks over an image reuse its features


def test_prefix_cache_keys_blocks_by_image(family):
    """The same image under the same prompt reuses the blocks over its placeholders; another
    image under the same text shares only the blocks before its first placeholder."""
    name, hf, loaded = family
    first, other = image(50, 40, 7), image(50, 40, 8)
    prompt, mm = render(loaded.processor, chat(1), [first])
    run(loaded.engine, [("warm", prompt, mm)])
    prompt_again, mm_again = render(loaded.processor, chat(1), [first])
    prompt_other, mm_other = render(loaded.processor, chat(1), [other])
    assert prompt_other == prompt  # same text, same placeholders: only the image differs
    done = run(loaded.engine, [("same", prompt_again, mm_again)])
    done.update(run(loaded.engine, [("other", prompt_other, mm_other)]))
    bs = loaded.engine.config.cache.block_size
    image_start = mm_other.spans[0][0]
    assert done["same"][1] == (len(prompt) - 1) // bs * bs
    assert done["other"][1] == image_start // bs * bs
    assert done["other"][0] == reference(hf, loaded.processor, chat(1), [other]), name
    assert done["same"][0] == reference(hf, loaded.processor, chat(1), [first]), name


def test_vision_language_families_it_cannot_run_are_refused_with_the_reason():
    """Gemma 3's image tokens attend both ways within an image, which the causal paged
    attention would silently change: refused at load, as any family it does not know."""
    import transformers

    from batchrun.models.transformers.support import UnsupportedModelError, choose

    assert choose(transformers.LlavaConfig(), "auto").impl == "transformers"
    with pytest.raises(UnsupportedModelError, match="gemma3 is a vision-language model"):
        choose(transformers.Gemma3Config(), "auto")
