"""The load check of a vision-language model's image path (vision.py): one small synthetic image
through the family's own processor, its placeholders placed and its features encoded as the
engine places and encodes them, the prompt prefilled through the engine's forward on a paged KV
cache; its logits are compared with transformers' own forward on the same processor output
(pixel values and all). A family whose generic path differs is refused with the figure, never
served wrong; one whose image cannot even be placed is refused with the reason."""

from __future__ import annotations

import contextlib

import torch

from batchrun.engine.attention import StepLayout
from batchrun.engine.model import KeepsState
from batchrun.engine.multimodal import StepImages
from batchrun.engine.state_slots import StepState, state_tensors
from batchrun.models import load_check
from batchrun.models.transformers import own_forward
from batchrun.models.transformers.support import UnsupportedModelError

CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]


def probe_image():
    """A 40x30 colour gradient: small, so every family's processor keeps its placeholders few."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:30, 0:40]
    pixels = np.stack([x * 6, y * 8, (x + y) * 3], -1).astype(np.uint8)
    return Image.fromarray(pixels)


@torch.inference_mode()
def engine_logits(model, prompt: list[int], mm) -> torch.Tensor:
    """float32 logits [T, vocab] of the prompt with its image, in one prefill step."""
    device, dtype, n = model.hf.device, model.hf.dtype, len(prompt)
    backend, caches = load_check.fresh_cache(model, n, device, dtype)
    blocks = list(range(-(-n // load_check.BLOCK_SIZE)))
    layout = StepLayout.of([blocks], [0], [n], 0, load_check.BLOCK_SIZE, device)
    state = {}
    if isinstance(model, KeepsState):  # its state layers (Qwen3.5's) on one fresh slot
        state["state"] = StepState.of(state_tensors(model.state_spec, 1, device), [0], [0], [n],
                                      device)
    hidden = model(torch.tensor(prompt, device=device), layout.positions, caches,
                   backend.build(layout), images=[StepImages(mm, 0, 0, n)], **state)
    return model.compute_logits(hidden).float()


@torch.inference_mode()
def reference_logits(hf, processor) -> torch.Tensor:
    """transformers' logits of the same chat and image, on its own (eager) attention."""
    from batchrun.models.transformers.processor import TEXT_KEYS

    text = processor.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[probe_image()], return_tensors="pt")
    taken = set(TEXT_KEYS) | set(own_forward_inputs(hf))
    inputs = {k: v.to(hf.device) for k, v in inputs.items() if k in taken}
    with own_forward.own_attention(hf), no_leftover_state(hf):
        return hf(**inputs, use_cache=False).logits[0].float()


@contextlib.contextmanager
def no_leftover_state(hf):
    """transformers' forwards keep per-call state on their modules (Qwen2-VL's rope_deltas):
    after the reference run every module's plain tensor-or-None attributes are as they were,
    so the served model holds (and reads) nothing the check left."""
    def plain(module):
        return {k: v for k, v in vars(module).items()
                if not k.startswith("_") and (v is None or isinstance(v, torch.Tensor))}

    saved = [(m, plain(m)) for m in hf.modules()]
    try:
        yield
    finally:
        for module, before in saved:
            for key in plain(module).keys() - before.keys():
                delattr(module, key)
            for key, value in before.items():
                setattr(module, key, value)


def own_forward_inputs(hf) -> list[str]:
    import inspect

    return list(inspect.signature(hf.forward).parameters)


def verify(model, processor, name: str, quantized: bool = False) -> load_check.Verdict:
    """The image check of `model` (a vision.VisionLanguageModel) with `processor`; an
    UnsupportedModelError names why its image cannot be placed, a LoadCheckError the figure
    where its logits differ from transformers'."""
    from batchrun.models.transformers.processor import render

    kind = model.hf.config.model_type
    try:
        prompt, mm = render(processor, CHAT, [probe_image()])
        model.place_images(prompt, mm)
        ours = engine_logits(model, prompt, mm)
    except Exception as exc:  # whatever the family's processor or modelling code raises
        raise UnsupportedModelError(f"{kind}: its image path fails on the engine "
                                    f"({type(exc).__name__}: {exc})") from exc
    try:
        ref = reference_logits(model.hf, processor)
    except Exception as exc:  # transformers' own forward cannot take its processor's output
        raise UnsupportedModelError(f"{kind}: transformers' own forward fails on its "
                                    f"processor's output ({type(exc).__name__}: {exc})") from exc
    verdict = load_check.compare(ours, ref, model.hf.dtype, quantized)
    if not verdict.agrees:
        raise load_check.LoadCheckError(
            f"{name}: with an image, the engine's logits differ from transformers' own forward "
            f"on the same weights (max |Δlogit| {verdict.max_diff:.3g}, RMS Δ / std "
            f"{verdict.spread:.3g}; {verdict.rule}; first at prompt position "
            f"{verdict.position}); refusing to serve wrong output")
    return verdict
