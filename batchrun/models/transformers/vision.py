"""A transformers vision-language model on the engine: the decoder runs as the transformers backend
runs any causal LM (attention.py on the paged KV cache), the vision tower once per image, when a
step first covers that image's placeholder tokens; its output stays in an encoder cache keyed by
the image's content hash, so the later chunks of a chunked prefill, and other requests with the
same image, reuse it. The placeholders' embeddings are replaced by the image features for the rows
of the step that hold them.

M-RoPE models (Qwen2-VL, Qwen2.5-VL) get the prompt's 3-D positions from the model's own
get_rope_index when the request is added; decode continues them with the returned delta.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Sequence

import torch

from batchrun.engine.attention.base import GroupedMetadata
from batchrun.engine.multimodal import ImageInput, MultiModalInputs, StepImages
from batchrun.models.transformers import attention, own_forward
from batchrun.models.quant.methods import METHODS, Method
from batchrun.models.transformers.model import TransformersModel, max_context, wrap
from batchrun.models.transformers.support import (BOTH_WAYS, UnsupportedModelError,
                                                  base_decoder, vision_reason)

ENCODER_CACHE_BYTES = 512 << 20


class EncoderCache:
    """Image features by content hash, least recently used evicted past a byte budget."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the vision tower (tests read it)

    def get(self, key: bytes, encode) -> torch.Tensor:
        feats = self.entries.get(key)
        if feats is not None:
            self.entries.move_to_end(key)
            return feats
        feats = encode()
        self.encoded += 1
        self.entries[key] = feats
        self.bytes += feats.numel() * feats.element_size()
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return feats


def image_token_id(cfg) -> int:
    """The placeholder token id of vision-language config `cfg` (some name it ..._index)."""
    known = getattr(cfg, "image_token_id", None)
    known = known if known is not None else getattr(cfg, "image_token_index", None)
    if known is None:  # (support.vision_reason refuses such a config first)
        raise UnsupportedModelError(f"{cfg.model_type}'s config names no image placeholder token")
    return int(known)


def place_spans(cfg, prompt: list[int], mm: MultiModalInputs) -> None:
    """Fill mm's spans, placeholders and both-ways spans from the prompt's placeholder tokens,
    each image taking as many as its processor wrote (ImageInput.expansion): the config only, no
    weights (`batchrun plan` keys its prefix-cache model's blocks by them, as the engine)."""
    token = image_token_id(cfg)
    where = torch.nonzero(torch.tensor(prompt) == token).flatten()
    counts = [img.placeholders(token) for img in mm.images]
    if mm.images and (sum(counts) != len(where) or 0 in counts):
        raise ValueError(f"the prompt holds {len(where)} image placeholder tokens; its "
                         f"{len(mm.images)} image(s) need {sum(counts)}")
    mm.spans, mm.placeholders, start = [], [], 0
    for n in counts:
        own = where[start:start + n]
        mm.placeholders.append(own)
        mm.spans.append((int(own[0]), int(own[-1]) + 1))
        start += n
    place_both_ways(cfg, prompt, mm)


def place_both_ways(cfg, prompt: list[int], mm: MultiModalInputs) -> None:
    """The spans whose tokens attend both ways, as transformers' masks for the family have them
    (support.BOTH_WAYS); none for a causal family."""
    import hashlib

    kind = BOTH_WAYS.get(cfg.model_type)
    if kind == "image":  # Gemma 3: each image's placeholders (keyed by the image's hash)
        mm.both_ways = list(mm.spans)
    elif kind == "prefix":  # PaliGemma: the whole prompt, images and text (token type 0)
        mm.both_ways = [(0, len(prompt))]
        mm.both_ways_key = hashlib.blake2b(torch.tensor(prompt).numpy().tobytes(),
                                           digest_size=16).digest()


class VisionLanguageModel(TransformersModel):
    def __init__(self, hf_model, config):
        super().__init__(hf_model, config)
        self.image_token_id = image_token_id(hf_model.config)
        self.encoder_cache = EncoderCache()
        self.mrope = hasattr(hf_model.model, "get_rope_index")
        # Gemma 3, PaliGemma: some tokens attend both ways (place_both_ways); the scheduler
        # keeps each such span in one chunk, the attention reads visible_until.
        self.bidirectional = hf_model.config.model_type in BOTH_WAYS
        self.encoder_inputs = encoder_inputs(hf_model.model.get_image_features)
        # Qwen3-VL: the vision tower's deepstack features join the first decoder layers' output
        self.deepstack = len(getattr(hf_model.config.vision_config, "deepstack_visual_indexes",
                                     None) or ())

    @property
    def decoder(self):
        return decoder_of(self.hf, self.hf.config)

    def place_images(self, prompt: list[int], mm: MultiModalInputs) -> None:
        """Fill mm's spans (and M-RoPE positions) from the prompt's placeholder tokens."""
        place_spans(self.hf.config, prompt, mm)
        if self.mrope and mm.images:
            ids = torch.tensor(prompt)
            grids = torch.cat([img.data["image_grid_thw"] for img in mm.images])
            types = (ids == self.image_token_id).int()[None]
            with torch.inference_mode():
                pos, delta = self.hf.model.get_rope_index(ids[None], mm_token_type_ids=types,
                                                          image_grid_thw=grids)
            mm.positions, mm.position_delta = pos[:, 0], int(delta.flatten()[0])

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        """The image's features [placeholders, hidden] (with deepstack: [placeholders,
        hidden x (1 + deepstack layers)], the layers' features beside the input's), from the
        cache or the vision tower."""
        def run():
            data = {k: v.to(self.hf.device) for k, v in image.data.items()
                    if k in self.encoder_inputs}
            out = self.hf.model.get_image_features(**data)
            deep = [features(d) for d in getattr(out, "deepstack_features", None) or ()]
            return torch.cat([features(out), *deep], -1).to(self.hf.dtype)
        return self.encoder_cache.get(image.content_hash, run)

    def place_features(self, embeds: torch.Tensor, step: StepImages, deep: torch.Tensor | None):
        """Write the features of the step's image placeholders into their rows of `embeds`
        (their deepstack features into those rows of `deep`)."""
        mm, last, width = step.inputs, step.first + step.count, embeds.shape[-1]
        for img, (a, b), where in zip(mm.images, mm.spans, mm.placeholders):
            if a >= last or b <= step.first:
                continue
            feats = self.encode(img)
            if feats.shape[0] != len(where):
                raise RuntimeError(f"{self.hf.config.model_type}: the vision tower gave "
                                   f"{feats.shape[0]} features for an image with "
                                   f"{len(where)} placeholder tokens")
            inside = (where >= step.first) & (where < last)
            rows = step.row + where[inside] - step.first
            embeds[rows] = feats[inside, :width].to(embeds.dtype)
            if deep is not None:
                deep[rows] = feats[inside, width:].to(deep.dtype)

    def forward(self, input_ids, positions, kv_caches, meta, images: Sequence[StepImages] = ()):
        embeds = self.hf.get_input_embeddings()(input_ids)
        rope = positions[None].expand(3, -1).clone() if self.mrope else positions
        deep = embeds.new_full((len(input_ids), embeds.shape[-1] * self.deepstack), float("nan")) \
            if self.deepstack and images else None
        for step in images:
            self.place_features(embeds, step, deep)
            if self.mrope:
                mm, last = step.inputs, step.first + step.count
                assert mm.positions is not None  # place_images sets them for M-RoPE models
                tokens = torch.arange(step.first, last)
                prompt_len = mm.positions.shape[1]
                in_prompt = tokens < prompt_len
                rows = slice(step.row, step.row + step.count)
                rope[:, rows] = torch.where(
                    in_prompt[None], mm.positions[:, tokens.clamp(max=prompt_len - 1)],
                    (tokens + mm.position_delta)[None]).to(rope.device)
        position_ids = rope[:, None] if self.mrope else rope[None]
        if self.bidirectional and images:
            meta = with_image_rows(meta, images, len(input_ids))
        with attention.step(kv_caches, meta, max_context(meta, positions),
                            calls_per_layer=self.config.calls_per_layer, layers=self.kv_index,
                            kv_shape=(self.config.num_kv_heads, self.config.head_dim)):
            out = self.decoder(inputs_embeds=embeds[None], position_ids=position_ids,
                               use_cache=False, **deepstack_inputs(deep, self.deepstack))
        return out[0][0]


def deepstack_inputs(deep: torch.Tensor | None, layers: int) -> dict:
    """The decoder's deepstack arguments (Qwen3-VL): the image rows of the step and, per
    decoder layer that adds them, those rows' features from the vision tower's layers; rows
    without an image feature (text, images not in this step) are NaN in `deep`."""
    if deep is None:
        return {}
    rows = ~deep[:, 0].isnan()
    if not rows.any():
        return {}
    return {"visual_pos_masks": rows[None],
            "deepstack_visual_embeds": list(deep[rows].chunk(layers, -1))}


def encoder_inputs(get_image_features) -> set[str]:
    """The processor outputs the model's get_image_features takes (pixel_values, image_sizes,
    image_grid_thw, pixel_attention_mask, ...): the others (Idefics3's rows / cols, InternVL's
    num_patches) only laid out the placeholders."""
    import inspect

    params = inspect.signature(get_image_features).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def features(out) -> torch.Tensor:
    """get_image_features' output as one [placeholders, hidden] tensor, in placeholder order:
    its projected features (pooler_output in transformers' output classes), one tensor or one
    per image / tile."""
    feats = getattr(out, "pooler_output", out)
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1])


def with_image_rows(meta, images: Sequence[StepImages], rows: int):
    """A copy of the step's metadata whose visible_until lets each image token see its whole
    image (the scheduler put the whole image in this step)."""
    import copy

    until = [0] * rows
    for step in images:
        until[step.row:step.row + step.count] = step.inputs.visible_until(step.first, step.count)
    if not any(until):  # no image token in this step (decodes): the fast kernels serve it
        return meta
    visible = torch.tensor(until, device=meta.positions.device)

    def with_until(group_meta):
        group_meta = copy.copy(group_meta)
        group_meta.visible_until = visible
        return group_meta

    if isinstance(meta, GroupedMetadata):  # each KV group's metadata carries it
        return dataclasses.replace(meta, groups=[with_until(g) for g in meta.groups])
    return with_until(meta)


def model_reason(hf) -> str | None:
    """Why the loaded vision-language model `hf` cannot run on the generic path (None: it can):
    its model must encode images with get_image_features, and a model with 3-D rotary
    positions must compute them with get_rope_index as Qwen2-VL's does."""
    import inspect

    kind, inner = hf.config.model_type, getattr(hf, "model", None)
    if not callable(getattr(inner, "get_image_features", None)):
        return f"{kind}: its model has no get_image_features to encode images with"
    if not hasattr(inner, "language_model") and not hasattr(inner, "text_model"):
        return f"{kind}: its model has no separate language model to run on the engine"
    decoder_takes = inspect.signature(decoder_of(hf, hf.config).forward).parameters
    if getattr(hf.config.vision_config, "deepstack_visual_indexes", None) and \
            "deepstack_visual_embeds" not in decoder_takes:
        return (f"{kind} adds vision features inside its decoder layers (deepstack), and its "
                f"language model takes them otherwise than Qwen3-VL's")
    rope_index = getattr(inner, "get_rope_index", None)
    if rope_index is not None:
        takes = set(inspect.signature(rope_index).parameters)
        if not {"mm_token_type_ids", "image_grid_thw"} <= takes:
            return (f"{kind}: its 3-D rotary positions (get_rope_index) take other inputs "
                    f"than Qwen2-VL's, which the engine does not supply")
    return None


def is_vision_language(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def decoder_of(hf, hf_config):
    """The decoder (the text model, without its head) of transformers' model `hf`: a
    vision-language model's language model."""
    if not is_vision_language(hf_config):
        return base_decoder(hf)
    inner = hf.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def wrap_language_model(hf, quantization: Method, path) -> VisionLanguageModel:
    model = wrap(hf, VisionLanguageModel, quantization, path)
    assert isinstance(model, VisionLanguageModel)
    return model


def load(path, device: torch.device, dtype: torch.dtype, quantization: Method = METHODS["none"],
         trust_remote_code: bool = False, wrap_model=wrap_language_model) -> VisionLanguageModel:
    """The vision-language model at `path`: its decoder on the "batchrun" attention, its vision
    tower on PyTorch's SDPA (the tower runs outside the engine's steps and caches); `wrap_model`
    makes the engine's model of it (stateful_vision.py's for a decoder that keeps state)."""
    from transformers import AutoModelForImageTextToText

    from batchrun.models.transformers.model import from_pretrained_checked
    from batchrun.models.weights.remote_code import auto_kwargs

    attention.register()
    hf = from_pretrained_checked(
        AutoModelForImageTextToText, path, dtype=dtype, device_map=device,
        attn_implementation={"text_config": attention.NAME, "vision_config": "sdpa", "": "sdpa"},
        **auto_kwargs(trust_remote_code))
    reason = vision_reason(hf.config) or model_reason(hf)
    if reason:
        raise UnsupportedModelError(f"unsupported model: {reason}")
    model = wrap_model(hf.eval(), quantization, path)
    assert isinstance(model, VisionLanguageModel)
    own_forward.check(model, f"{path}", quantized=quantization.quantizes)
    from batchrun.models.transformers import vision_check
    from batchrun.models.transformers.processor import load_processor, processor_class

    if processor_class(path) is not None:  # without one it runs as a text model
        vision_check.verify(model, load_processor(path, trust_remote_code), f"{path}",
                            quantized=quantization.quantizes)
    return model


def verdict_before_load(full, model, folder, impl: str, reason: str) -> tuple[str, str]:
    """(impl, reason) after what the load checks of a vision-language model before its image
    check (vision.model_reason on the meta model, then its processor: run cannot load without
    the one it saves), refused in run's words."""
    from batchrun.models.transformers.processor import load_processor, processor_class

    if not is_vision_language(full):
        return impl, reason
    why = model_reason(model) if model is not None else None
    if why:
        return "refused", f"unsupported model: {why}"
    if folder is not None and processor_class(folder) is not None:
        try:
            load_processor(folder, getattr(full, "auto_map", None) is not None)
        except ValueError as exc:
            return "refused", str(exc)
    return impl, reason
