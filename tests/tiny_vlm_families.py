"""Tiny random-weight vision-language models of the families the generic vision path runs
(models/transformers/vision.py: the family's own processor and get_image_features) beyond
tests/tiny_vlms.py's: LLaVA-NeXT (anyres grids), LLaVA on a SigLIP tower with the "full" feature
strategy, Mistral 3 (Pixtral tower), InternVL (tiles, pixel shuffle), PaliGemma (prefix-LM),
Qwen3-VL (interleaved M-RoPE, deepstack features added inside the decoder's first layers),
LLaVA-OneVision (anyres with a cap on the grid's features), Idefics2 (a perceiver
resampler), Aya Vision (tiles, pixel shuffle, a Cohere 2 decoder) and Qwen3.5, dense and MoE
(Qwen3-VL's processor, a decoder of Gated DeltaNet layers with recurrent state beside
attention). Built offline from transformers' own config and processor classes and the bundled tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_vlms import CHAT_TEMPLATE, TEXT, save_processor

FAMILIES = ("llava_next", "llava_siglip", "mistral3", "internvl", "paligemma", "qwen3_vl",
            "llava_onevision", "idefics2", "aya_vision", "qwen3_5", "qwen3_5_moe")

IMAGE_MARKER = {"aya_vision": "<image>", "llava_next": "<image>", "llava_onevision": "<image>", "idefics2": "<image>", "llava_siglip": "<image>", "mistral3": "[IMG]",
                "internvl": "<IMG_CONTEXT>", "paligemma": "<image>",
                "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>"}
EXTRA_TOKENS = {"aya_vision": ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>",
                               "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"],
                "llava_next": ["<image>"], "llava_onevision": ["<image>", "<video>"],
                "idefics2": ["<fake_token_around_image>", "<image>", "<end_of_utterance>"], "llava_siglip": ["<image>"],
                "mistral3": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "paligemma": ["<image>"],
                "qwen3_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                             "<|video_pad|>"]}
EXTRA_TOKENS["qwen3_5"] = EXTRA_TOKENS["qwen3_5_moe"] = EXTRA_TOKENS["qwen3_vl"]
# InternVL's processor reads them as the tokenizer's named special tokens.
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
EXTRA_TOKENS["internvl"] = list(INTERNVL_TOKENS.values())
CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=7,
            projection_dim=32)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=7)
PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def tokenizer(family: str, base):
    """A copy of `base` (the bundled tokenizer) with the family's image tokens added."""
    import copy

    if family == "internvl":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base.name_or_path,
                                            extra_special_tokens=INTERNVL_TOKENS)
    else:
        tok = copy.deepcopy(base)
        tok.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS[family]})
    tok.chat_template = CHAT_TEMPLATE.replace("IMAGE", IMAGE_MARKER[family])
    return tok


def processor(family: str, tok):
    import transformers as t

    from batchrun.models.transformers.processor import images_only, processor_cls

    template = tok.chat_template
    if family == "llava_next":
        ip = t.LlavaNextImageProcessorPil(size={"shortest_edge": 28},
                                          crop_size={"height": 28, "width": 28},
                                          image_grid_pinpoints=PINPOINTS)
        return t.LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=7,
                                    vision_feature_select_strategy="default",
                                    num_additional_image_tokens=1, chat_template=template)
    if family == "llava_onevision":  # anyres with a cap on the grid's features
        ip = t.LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                               image_grid_pinpoints=PINPOINTS)
        return images_only(t.LlavaOnevisionProcessor)(
            image_processor=ip, tokenizer=tok, video_processor=None, num_image_tokens=16,
            vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_1",
            chat_template=template)
    if family == "idefics2":  # a perceiver resampler pools each image to image_seq_len latents
        ip = t.Idefics2ImageProcessorPil(size={"longest_edge": 28, "shortest_edge": 28},
                                         do_image_splitting=True)
        return t.Idefics2Processor(image_processor=ip, tokenizer=tok, image_seq_len=4,
                                   chat_template=template)
    if family == "aya_vision":  # tiles of 28 px, 7-px patches shuffled 2x2: 4 per tile
        ip = t.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                        min_patches=1, max_patches=4)
        return t.AyaVisionProcessor(image_processor=ip, tokenizer=tok, patch_size=7,
                                    img_size=28, downsample_factor=2, chat_template=template)
    if family == "llava_siglip":  # no CLS token: "full" keeps all 16 patches, no more
        ip = t.SiglipImageProcessorPil(size={"height": 28, "width": 28})
        return t.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=7,
                                vision_feature_select_strategy="full",
                                num_additional_image_tokens=0, chat_template=template)
    if family == "mistral3":
        ip = t.PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 7,
                                                                               "width": 7})
        return processor_cls("PixtralProcessor")(image_processor=ip, tokenizer=tok, patch_size=7,
                                  spatial_merge_size=2, chat_template=template)
    if family == "internvl":
        ip = t.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                        min_patches=1, max_patches=4)
        return images_only(t.InternVLProcessor)(image_processor=ip, tokenizer=tok,
                                                video_processor=None, image_seq_length=4,
                                                chat_template=template)
    if family in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):  # Qwen3.5 takes Qwen3-VL's processor
        ip = t.Qwen2VLImageProcessorPil(min_pixels=16 * 32 * 32 // 4, max_pixels=64 * 32 * 32,
                                        patch_size=16, merge_size=2)
        return images_only(t.Qwen3VLProcessor)(image_processor=ip, tokenizer=tok,
                                               video_processor=None, chat_template=template)
    if family == "paligemma":
        ip = t.SiglipImageProcessorPil(size={"height": 28, "width": 28})
        ip.image_seq_length = 16
        return t.PaliGemmaProcessor(image_processor=ip, tokenizer=tok, chat_template=template)
    raise ValueError(family)


def config(family: str, tok):
    import transformers as t

    ids = {name: tok.convert_tokens_to_ids(name) for name in EXTRA_TOKENS[family]}
    text = dict(TEXT, vocab_size=len(tok))
    if family == "llava_next":
        return t.LlavaNextConfig(
            text_config=dict(text, model_type="llama"), vision_config=CLIP,
            image_token_id=ids["<image>"], image_grid_pinpoints=PINPOINTS,
            vision_feature_layer=-1, vision_feature_select_strategy="default")
    if family == "llava_onevision":
        return t.LlavaOnevisionConfig(
            text_config=dict(text, model_type="qwen2"), vision_config=SIGLIP,
            image_token_id=ids["<image>"], video_token_id=ids["<video>"],
            image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1,
            vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_1")
    if family == "idefics2":
        return t.Idefics2Config(
            text_config=dict(text, model_type="mistral", head_dim=16),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=28, patch_size=7),
            perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1,
                                  resampler_n_heads=2, resampler_head_dim=16,
                                  num_key_value_heads=1),
            image_token_id=ids["<image>"])
    if family == "aya_vision":
        return t.AyaVisionConfig(
            text_config=dict(text, model_type="cohere2", head_dim=16, sliding_window=512,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=SIGLIP, image_token_id=ids["<|IMG_PATCH|>"], downsample_factor=2,
            vision_feature_layer=-1, vision_feature_select_strategy="full",
            adapter_layer_norm_eps=1e-6)
    if family == "llava_siglip":
        return t.LlavaConfig(
            text_config=dict(text, model_type="llama"), vision_config=SIGLIP,
            image_token_id=ids["<image>"], vision_feature_layer=-1,
            vision_feature_select_strategy="full")
    if family == "mistral3":
        return t.Mistral3Config(
            text_config=dict(text, model_type="mistral", head_dim=16),
            vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                               image_size=56, patch_size=7),
            image_token_index=ids["[IMG]"], spatial_merge_size=2, vision_feature_layer=-1)
    if family == "internvl":
        return t.InternVLConfig(
            text_config=dict(text, model_type="qwen2"),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=[28, 28], patch_size=[7, 7]),
            image_token_id=ids["<IMG_CONTEXT>"], downsample_ratio=0.5, vision_feature_layer=-1)
    if family == "qwen3_vl":  # one deepstack layer: the tower's first block feeds decoder layer 0
        return t.Qwen3VLConfig(
            text_config=dict(text, head_dim=16, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                               temporal_patch_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"])
    if family in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNets beside attention, M-RoPE
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64) if family == "qwen3_5_moe" else {}
        cls = t.Qwen3_5MoeConfig if family == "qwen3_5_moe" else t.Qwen3_5Config
        return cls(
            text_config=dict(text, **moe, head_dim=16,
                             layer_types=["linear_attention", "full_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, rope_parameters={
                                 "rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2],
                                 "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                               temporal_patch_size=2, num_position_embeddings=64),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"])
    if family == "paligemma":
        gemma = {k: v for k, v in text.items() if k != "bos_token_id"}
        gemma.update(model_type="gemma", head_dim=16)
        return t.PaliGemmaConfig(text_config=gemma, vision_config=dict(SIGLIP, projection_dim=64),
                                 image_token_index=ids["<image>"], projection_dim=64)
    raise ValueError(family)


def make_tiny_vlm(family: str, path: Path, base_tokenizer, seed: int = 0):
    """Save a tiny random VLM and its processor to `path`; returns (transformers model, processor)."""
    from transformers import AutoModelForImageTextToText

    tok = tokenizer(family, base_tokenizer)
    proc = processor(family, tok)
    cfg = config(family, proc.tokenizer)  # PaliGemma's processor adds tokens of its own
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    model.save_pretrained(path)
    save_processor(proc, path)
    return model, proc
