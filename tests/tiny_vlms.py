"""Tiny random-weight vision-language models with processors built offline: the bundled model's
tokenizer plus each family's image tokens, transformers' slow (PIL/numpy) image processors."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "idefics3", "smolvlm", "gemma3")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

IMAGE_MARKER = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>",
                "idefics3": "<image>", "smolvlm": "<image>", "gemma3": "<start_of_image>"}
EXTRA_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
    "llava": ["<image>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
}
EXTRA_TOKENS["smolvlm"] = EXTRA_TOKENS["idefics3"]  # SmolVLM is Idefics3 with another connector
# Gemma 3's processor reads them as the tokenizer's boi / image / eoi tokens.
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                 "eoi_token": "<end_of_image>"}
EXTRA_TOKENS["gemma3"] = list(GEMMA3_TOKENS.values())
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
            initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def tokenizer(family: str, base):
    """A copy of `base` (the bundled tokenizer) with the family's image tokens added."""
    import copy

    if family == "gemma3":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base.name_or_path, extra_special_tokens=GEMMA3_TOKENS)
    else:
        tok = copy.deepcopy(base)
        tok.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS[family]})
    tok.chat_template = CHAT_TEMPLATE.replace("IMAGE", IMAGE_MARKER[family])
    return tok


def processor(family: str, tok):
    import transformers as t

    from batchrun.models.transformers.processor import images_only

    if family in ("qwen2_vl", "qwen2_5_vl"):
        ip = t.Qwen2VLImageProcessorPil(min_pixels=16 * 28 * 28 // 4, max_pixels=64 * 28 * 28,
                                        patch_size=14, merge_size=2)
        cls = t.Qwen2VLProcessor if family == "qwen2_vl" else t.Qwen2_5_VLProcessor
        return images_only(cls)(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template)
    if family == "llava":
        ip = t.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        return t.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=7,
                                vision_feature_select_strategy="default",
                                chat_template=tok.chat_template, num_additional_image_tokens=1)
    if family == "idefics3":
        ip = t.Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28},
                                      do_image_splitting=True)
        return t.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4,
                                   chat_template=tok.chat_template)
    if family == "smolvlm":
        ip = t.SmolVLMImageProcessorPil(size={"longest_edge": 56},
                                        max_image_size={"longest_edge": 28},
                                        do_image_splitting=True)
        return images_only(t.SmolVLMProcessor)(image_processor=ip, tokenizer=tok, image_seq_len=4,
                                               chat_template=tok.chat_template,
                                               video_processor=None)
    if family == "gemma3":
        ip = t.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        return t.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=4,
                                 chat_template=tok.chat_template)
    raise ValueError(family)


def config(family: str, tok):
    import transformers as t

    vocab = len(tok)
    ids = {name: tok.convert_tokens_to_ids(name) for name in EXTRA_TOKENS[family]}
    text = dict(TEXT, vocab_size=vocab)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        if family == "qwen2_5_vl":  # windowed attention blocks and one full block
            vision = dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=2,
                          intermediate_size=64, patch_size=14, spatial_merge_size=2,
                          temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        cls = t.Qwen2VLConfig if family == "qwen2_vl" else t.Qwen2_5_VLConfig
        return cls(
            text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]}),
            vision_config=vision,
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if family == "llava":
        return t.LlavaConfig(
            text_config=dict(text, model_type="llama"),
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, image_size=28,
                               patch_size=7, projection_dim=32),
            image_token_id=ids["<image>"], vision_feature_layer=-1,
            vision_feature_select_strategy="default", projector_hidden_act="gelu")
    if family in ("idefics3", "smolvlm"):
        cls = t.Idefics3Config if family == "idefics3" else t.SmolVLMConfig
        return cls(
            text_config=dict(text, model_type="llama"),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=28, patch_size=7),
            image_token_id=ids["<image>"], scale_factor=2)
    if family == "gemma3":  # a sliding and a full layer; image tokens attend both ways
        gemma = {k: v for k, v in text.items() if k != "bos_token_id"}
        gemma.update(head_dim=16, sliding_window=512, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "full_attention"])
        return t.Gemma3Config(
            text_config=gemma,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=28, patch_size=7),
            mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
            eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    raise ValueError(family)


def make_tiny_vlm(family: str, path: Path, base_tokenizer, seed: int = 0):
    """Save a tiny random VLM and its processor to `path`; returns (transformers model, processor)."""
    from transformers import AutoModelForImageTextToText

    tok = tokenizer(family, base_tokenizer)
    proc = processor(family, tok)
    cfg = config(family, tok)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    if family == "gemma3":  # its projector starts at zero: every image would look the same
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    model.save_pretrained(path)
    save_processor(proc, path)
    return model, proc


def save_processor(proc, path: Path) -> None:
    """What load_processor reads (transformers' own save needs every sub-processor)."""
    import json

    proc.image_processor.save_pretrained(path)
    proc.tokenizer.save_pretrained(path)
    settings = {"processor_class": type(proc).__name__}
    for key in ("image_seq_len", "image_seq_length", "num_image_tokens", "patch_size",
                "vision_feature_select_strategy", "num_additional_image_tokens",
                "spatial_merge_size", "vision_aspect_ratio", "img_size", "downsample_factor"):
        if hasattr(proc, key):
            settings[key] = getattr(proc, key)
    (Path(path) / "processor_config.json").write_text(json.dumps(settings))
    (Path(path) / "chat_template.jinja").write_text(proc.chat_template)


def image(width: int, height: int, seed: int = 0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
