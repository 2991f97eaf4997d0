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
ENGINE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "idefics3", "smolvlm", "gemma3")
BOTH_WAYS = ("gemma3",)  # families whose image tokens attend both ways within an image


pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    if name in BOTH_WAYS:  # an image's tokens attend to each other: never split
        assert not cut, cut
    else:
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


def test_gemma3_image_tokens_attend_both_ways_and_are_never_split(tmp_path, smol_tokenizer,
                                                                  monkeypatch):
    """Gemma 3's image tokens see their whole image (transformers' token_type_ids mask): the
    step budget (12) would cut the image's span [10, 14), so the scheduler ends that chunk
    before the image and computes the image in one step; tokens and logprobs are
    transformers'. (Its causal mask instead changes the logprobs: the check can fail.) With the
    CPU kernels the image's step runs on them (every row in the kernel up to visible_until)."""
    from batchrun.engine.attention.cpu_kernel import CpuKernelMetadata

    hf, _ = make_tiny_vlm("gemma3", tmp_path, smol_tokenizer)
    loaded = load_from_path(tmp_path, EngineConfig.default(
        block_size=4, max_num_batched_tokens=12, num_blocks=256, threads=1))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Here is a picture."},
                                             {"type": "image"},
                                             {"type": "text", "text": "Describe it."}]}]
    images = [image(40, 30, 1)]
    prompt, mm = render(loaded.processor, messages, images)
    engine = loaded.engine
    model = engine.runner.model
    chunks = []  # (first token, count) of each step of the request

    def spy(*args, images=(), **kwargs):
        chunks.extend((s.first, s.count) for s in images)
        return forward(*args, images=images, **kwargs)

    forward = model.forward
    model.forward = spy
    planned = []
    plan = CpuKernelMetadata.rows_seeing_ahead
    monkeypatch.setattr(CpuKernelMetadata, "rows_seeing_ahead",
                        lambda meta: planned.append(meta) or plan(meta))
    try:
        engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       logprobs=0), multimodal=mm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    result = out.outputs[0]
    finally:
        del model.forward
    assert bool(planned) == (engine.runner.attention.name == "cpu-kernel")
    (first, end), = mm.spans
    assert (first, end) == (10, 14)
    assert chunks[:2] == [(0, 10), (10, 12)], chunks  # not (0, 12): the image stays whole

    text = loaded.processor.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
    inputs = loaded.processor(text=[text], images=images, return_tensors="pt")
    ref = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                      output_scores=True, return_dict_in_generate=True)
    tokens = ref.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, tokens)]
    assert result.token_ids == tokens
    assert [x.logprob for x in result.logprobs] == pytest.approx(logprobs, abs=1e-4)
    causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    with torch.no_grad():
        first_causal = torch.log_softmax(hf(**causal).logits[0, -1].float(), -1)[tokens[0]]
    assert abs(first_causal.item() - logprobs[0]) > 1e-3
