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
from batchrun.models.transformers.support import VISION_MODEL_TYPES, UnsupportedModelError

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


def placeholders_per_image(cfg, data: dict) -> int:
    """How many placeholder tokens the processor wrote for one image (its `data`)."""
    kind = cfg.model_type
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        return int(data["image_grid_thw"].prod()) // cfg.vision_config.spatial_merge_size ** 2
    if kind == "llava":
        vc = cfg.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return n + (1 if cfg.vision_feature_select_strategy == "full" else 0)
    if kind in ("idefics3", "smolvlm"):  # SmolVLM: Idefics3's tiles, another connector
        vc = cfg.vision_config
        per_tile = (vc.image_size // vc.patch_size) ** 2 // cfg.scale_factor ** 2
        return per_tile * int(data["pixel_values"].shape[1])
    if kind == "gemma3":  # the vision tower's patches pooled to a fixed count
        return cfg.mm_tokens_per_image
    raise UnsupportedModelError(f"{kind}: images are not supported for this model type "
                                f"(vision-language models: {', '.join(VISION_MODEL_TYPES)})")


def place_spans(cfg, prompt: list[int], mm: MultiModalInputs) -> None:
    """Fill mm's spans and placeholders from the prompt's placeholder tokens: the config only,
    no weights (`batchrun plan` keys its prefix-cache model's blocks by them, as the engine)."""
    ids = torch.tensor(prompt)
    where = torch.nonzero(ids == cfg.image_token_id).flatten()
    counts = [placeholders_per_image(cfg, img.data) for img in mm.images]
    if sum(counts) != len(where):
        raise ValueError(f"the prompt holds {len(where)} image placeholder tokens; its "
                         f"{len(mm.images)} image(s) need {sum(counts)}")
    mm.spans, mm.placeholders, start = [], [], 0
    for n in counts:
        own = where[start:start + n]
        mm.placeholders.append(own)
        mm.spans.append((int(own[0]), int(own[-1]) + 1))
        start += n


class VisionLanguageModel(TransformersModel):
    def __init__(self, hf_model, config):
        super().__init__(hf_model, config)
        self.image_token_id = hf_model.config.image_token_id
        self.encoder_cache = EncoderCache()
        self.mrope = hasattr(hf_model.model, "get_rope_index")
        # Gemma 3: an image's tokens attend to each other both ways (transformers' token_type_ids
        # mask); the scheduler keeps each image in one chunk, the attention reads visible_until.
        self.bidirectional = hf_model.config.model_type == "gemma3"

    @property
    def decoder(self):
        return decoder_of(self.hf, self.hf.config)

    def place_images(self, prompt: list[int], mm: MultiModalInputs) -> None:
        """Fill mm's spans (and M-RoPE positions) from the prompt's placeholder tokens."""
        place_spans(self.hf.config, prompt, mm)
        mm.bidirectional = self.bidirectional
        if self.mrope:
            ids = torch.tensor(prompt)
            grids = torch.cat([img.data["image_grid_thw"] for img in mm.images])
            types = (ids == self.image_token_id).int()[None]
            with torch.inference_mode():
                pos, delta = self.hf.model.get_rope_index(ids[None], mm_token_type_ids=types,
                                                          image_grid_thw=grids)
            mm.positions, mm.position_delta = pos[:, 0], int(delta.flatten()[0])

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        """The image's features [placeholders, hidden], from the cache or the vision tower."""
        def run():
            data = {k: v.to(self.hf.device) for k, v in image.data.items()}
            out = self.hf.model.get_image_features(**data)
            feats = getattr(out, "pooler_output", out)
            if isinstance(feats, (list, tuple)):
                feats = torch.cat(list(feats))
            return feats.reshape(-1, feats.shape[-1]).to(self.hf.dtype)
        return self.encoder_cache.get(image.content_hash, run)

    def forward(self, input_ids, positions, kv_caches, meta, images: Sequence[StepImages] = ()):
        embeds = self.hf.get_input_embeddings()(input_ids)
        rope = positions[None].expand(3, -1).clone() if self.mrope else positions
        for step in images:
            mm, last = step.inputs, step.first + step.count
            for img, (a, b), where in zip(mm.images, mm.spans, mm.placeholders):
                if a >= last or b <= step.first:
                    continue
                feats = self.encode(img)
                if feats.shape[0] != len(where):
                    raise RuntimeError(f"{self.hf.config.model_type}: the vision tower gave "
                                       f"{feats.shape[0]} features for an image with "
                                       f"{len(where)} placeholder tokens")
                inside = (where >= step.first) & (where < last)
                embeds[step.row + where[inside] - step.first] = feats[inside].to(embeds.dtype)
            if self.mrope:
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
                            calls_per_layer=self.config.calls_per_layer):
            out = self.decoder(inputs_embeds=embeds[None], position_ids=position_ids,
                               use_cache=False)
        return out[0][0]


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


def is_vision_language(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def decoder_of(hf, hf_config):
    """The decoder (the text model, without its head) of transformers' model `hf`: a
    vision-language model's language model."""
    if not is_vision_language(hf_config):
        return hf.base_model
    inner = hf.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def load(path, device: torch.device, dtype: torch.dtype, quantization: Method = METHODS["none"],
         trust_remote_code: bool = False) -> VisionLanguageModel:
    """The vision-language model at `path`: its decoder on the "batchrun" attention, its vision
    tower on PyTorch's SDPA (the tower runs outside the engine's steps and caches)."""
    from transformers import AutoModelForImageTextToText

    from batchrun.models.transformers.model import from_pretrained_checked
    from batchrun.models.weights.remote_code import auto_kwargs

    attention.register()
    hf = from_pretrained_checked(
        AutoModelForImageTextToText, path, dtype=dtype, device_map=device,
        attn_implementation={"text_config": attention.NAME, "vision_config": "sdpa", "": "sdpa"},
        **auto_kwargs(trust_remote_code))
    if hf.config.model_type not in VISION_MODEL_TYPES:
        raise UnsupportedModelError(f"{hf.config.model_type}: images are not supported for this "
                                    f"model type (vision-language models: "
                                    f"{', '.join(VISION_MODEL_TYPES)})")
    model = wrap(hf.eval(), VisionLanguageModel, quantization, path)
    assert isinstance(model, VisionLanguageModel)
    own_forward.check(model, f"{path}", quantized=quantization.quantizes)
    return model
