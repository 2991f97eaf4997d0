"""Which path runs a model (native, the transformers backend, or neither, and why), from its config
alone: no weights are read."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.models.transformers.indexed import INDEXED_LAYER_TYPES, indexed

# Layer kinds the paged KV cache holds; anything else keeps recurrent or convolution state.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# Models whose layers (some or all) keep a recurrent state instead of a KV cache, for configs that
# do not say so through layer_types.
RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1",
    "nemotron_h", "granitemoehybrid", "lfm2", "lfm2_moe", "qwen3_next", "rwkv", "xlstm",
    "recurrent_gemma", "minimax", "plamo2", "kimi_linear", "olmo_hybrid", "bailing_hybrid",
}

# Vision-language families whose language model attends both ways somewhere (transformers
# builds their masks from token types, create_masks_for_generate), and where: "image" (each
# image's placeholders), "prefix" (the whole prompt: PaliGemma's prefix-LM). Another family with
# its own masks is refused (vision_reason): its attention is not the engine's causal one.
BOTH_WAYS = {"gemma3": "image", "shieldgemma2": "image", "paligemma": "prefix"}

# Of those, the families the backend runs with the engine owning their state (stateful.py): all
# their layers of a kind stateful.MIXERS runs. The rest stay refused until their layers are.
STATE_MODEL_TYPES = {"mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "granitemoehybrid",
                     "nemotron_h", "falcon_h1", "lfm2", "lfm2_moe", "qwen3_next", "qwen3_5_text",
                     "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "minimax", "zamba",
                     "zamba2", "recurrent_gemma", "rwkv", "xlstm"}
# Of those, the families without any attention layer, whose classes need not take an attention
# function (RWKV's and xLSTM's do not: they have none to take).
NO_ATTENTION = {"rwkv", "xlstm"}

# Families whose attention classes (named here, by model type) compute attention inline instead
# of calling transformers' AttentionInterface: inline/ replaces those modules' forwards.
INLINE_ATTENTION = {"bloom": "BloomAttention", "falcon": "FalconAttention",
                    "gpt_neo": "GPTNeoSelfAttention", "openai-gpt": "Attention",
                    "mpt": "MptAttention", "xglm": "XGLMAttention", "trocr": "TrOCRAttention",
                    "gpt_neox_japanese": "GPTNeoXJapaneseAttention",
                    "megatron-bert": "MegatronBertSelfAttention",
                    "roformer": "RoFormerSelfAttention"}
# Families whose mask applies config.sliding_window to every layer while their attention
# modules do not pass it to the attention function (the paged kernels see no mask):
# the backend gives their attention modules the window (model.use_batchrun_attention).
WINDOW_FROM_MASK = {"phimoe", "doge"}
# Families no path runs, and why (what the generic checks cannot tell).
REFUSED = {
    "cpmant": "CPM-Ant attends bidirectionally over its whole input (its context mask is all "
              "ones) with a learned relative-position bias per query-key pair; the paged KV "
              "cache serves causal attention",
}
# Families that are causal decoders only when their config says is_decoder.
DECODER_IF_SET = {"megatron-bert", "roformer"}


class UnsupportedModelError(ValueError):
    """The model cannot run on the requested path; the message says why."""


@dataclass(frozen=True)
class Verdict:
    impl: str  # "native" | "transformers"
    note: str = ""  # why this path (auto), or what it cannot do


def native_reason(hf) -> str | None:
    """Why no native model file runs `hf` exactly (None: one does)."""
    from batchrun.models.arch import native

    return native.native_reason(hf)


def transformers_reason(hf) -> str | None:
    """Why the transformers backend cannot run `hf` (None: it can)."""
    model_type = getattr(hf, "model_type", None)
    if getattr(hf, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model (decoder-only models only)"
    if model_type in RECURRENT_MODEL_TYPES and model_type not in STATE_MODEL_TYPES:
        return (f"{model_type} keeps a recurrent (state-space / linear-attention) state, which the "
                f"paged KV cache does not hold")
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf  # a VLM's decoder's
    other = sorted(set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
                   - (INDEXED_LAYER_TYPES if indexed(text) else set()))
    if other and getattr(text, "model_type", model_type) not in STATE_MODEL_TYPES:
        return (f"{model_type} has {', '.join(other)} layers; the paged KV cache holds only "
                f"full, sliding-window and chunked attention layers")
    if model_type in REFUSED:
        return REFUSED[model_type]
    if not getattr(hf, "is_causal", True):
        return f"{model_type} attends bidirectionally (causal decoders only)"
    if model_type in DECODER_IF_SET and not getattr(hf, "is_decoder", False):
        return (f"{model_type} without is_decoder in its config attends both ways (causal "
                f"decoders only)")
    if getattr(hf, "vision_config", None) is not None:
        return vision_reason(hf)
    cls = causal_lm_class(hf)
    if cls is None:
        return f"transformers has no causal-LM class for model type {model_type!r}"
    if not takes_attention_function(cls, hf) and model_type not in NO_ATTENTION:
        return (f"{cls.__name__} does not take a custom attention function (transformers' "
                f"AttentionInterface)")
    return None


def vision_reason(hf) -> str | None:
    """Why the generic vision path (models/transformers/vision.py: the family's processor, its
    model's get_image_features, the language model on the engine) cannot run the
    vision-language model of config `hf` exactly (None: it can, as far as its config tells)."""
    from transformers import AutoModelForImageTextToText

    model_type = hf.model_type
    try:
        cls = AutoModelForImageTextToText._model_mapping[type(hf)]
    except (KeyError, ValueError):
        return f"transformers has no image-text-to-text class for model type {model_type!r}"
    if "create_masks_for_generate" in vars(cls) and model_type not in BOTH_WAYS:
        return (f"{model_type} builds its own attention masks from token types, which the "
                f"engine's attention does not reproduce")
    if getattr(hf, "image_token_id", None) is None and \
            getattr(hf, "image_token_index", None) is None:
        return (f"{model_type}'s config names no image placeholder token (image_token_id), "
                f"which the vision path places image features at")
    return None


def takes_attention_function(cls, hf) -> bool:
    """Whether the backend can attend for `cls`'s layers: the class says it takes transformers'
    AttentionInterface, or its modelling code calls it (transformers' own test of its source,
    as set_attn_implementation makes it), or inline/ replaces its attention modules."""
    if getattr(cls, "_supports_attention_backend", False) or hf.model_type in INLINE_ATTENTION:
        return True
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    return bool(can_set and can_set())


def causal_lm_class(hf):
    from transformers import AutoModelForCausalLM

    auto_map = getattr(hf, "auto_map", None)
    if isinstance(auto_map, dict) and auto_map.get("AutoModelForCausalLM"):
        # the folder's own class: a config keeps an auto_map only where the operator trusted
        # its folder (models/weights/remote_code.py)
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], hf.name_or_path)
    try:
        return AutoModelForCausalLM._model_mapping[type(hf)]
    except (KeyError, ValueError):
        return None


def choose(hf, requested: str = "auto") -> Verdict:
    """The path for `hf` under --model-impl `requested`; UnsupportedModelError when none."""
    if requested == "native":
        reason = native_reason(hf)
        if reason:
            raise UnsupportedModelError(f"the native path cannot run this model: {reason}")
        return Verdict("native")
    if requested == "auto":
        reason = native_reason(hf)
        if reason is None:
            return Verdict("native")
        note = f"the native path does not run it: {reason}"
    else:
        note = "--model-impl transformers"
    hf = as_transformers_config(hf)
    refusal = transformers_reason(hf)
    if refusal:
        raise UnsupportedModelError(f"unsupported model: {refusal}")
    return Verdict("transformers", note)


def as_transformers_config(hf):
    """`hf` as a transformers PretrainedConfig (hf_config.plain_config reads some as plain
    attributes)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf, PretrainedConfig):
        return hf
    values = {k: v for k, v in vars(hf).items() if k != "model_type"}
    return AutoConfig.for_model(hf.model_type, **values)


def base_decoder(hf):
    """The decoder without its head of transformers' causal LM `hf`: its base_model, or its
    `model` where base_model_prefix names no attribute of it (Llama4ForCausalLM shares the
    prefix "language_model" with the vision-language class, and base_model is then itself)."""
    base = hf.base_model
    inner = getattr(hf, "model", None)
    return inner if base is hf and inner is not None else base
