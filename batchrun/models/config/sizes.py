"""A model config's sizes checked for type, sign and range before anything is sized, built or
allocated from them: read_config, the GGUF and hub configs (spec_config) and the tokenizer-only
reader (footprint.tokenizer_model) all pass their raw values through check_config, so
`models check`, `plan`, `validate --check-prompts` and every load refuse the same config the
same way (ModelFolderError naming the file and the field; exit 2).

The upper bounds are far above any released model (hidden 18432, 126 layers, 128 heads, a
262144-token vocabulary, 10M positions) and low enough that counting parameters or building the
model on the meta device stays quick; whether a model in range fits the machine is
memory_fit.check_fits's question.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from batchrun.models.errors import ModelFolderError

# field -> (smallest, largest) whole number accepted where the field is present and not null.
SIZES = {
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 19),
    "moe_intermediate_size": (1, 1 << 19),
    "shared_expert_intermediate_size": (0, 1 << 19),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (0, 1 << 24),
    "num_local_experts": (0, 1 << 14),
    "num_experts": (0, 1 << 14),
    "n_routed_experts": (0, 1 << 14),
    "n_shared_experts": (0, 1 << 10),
    "num_experts_per_tok": (0, 1 << 14),
    "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 16),
    "qk_nope_head_dim": (0, 4096),
    "qk_rope_head_dim": (0, 4096),
    "v_head_dim": (1, 4096),
    "image_size": (1, 1 << 16),
    "patch_size": (1, 1 << 12),
    "num_labels": (1, 1 << 20),
}
# Present as null, these leave the model without a shape (transformers would substitute its
# class default, a different model).
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# field -> (exclusive lower bound, inclusive upper bound) of a finite number.
FLOATS = {"rms_norm_eps": (0.0, 1.0), "layer_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e15),
          "partial_rotary_factor": (0.0, 1.0)}
# field -> the JSON types it may hold (None: null).
SHAPES = {"quantization_config": (dict, type(None)), "rope_scaling": (dict, type(None)),
          "rope_parameters": (dict, type(None)), "auto_map": (dict, list, type(None)),
          "architectures": (list, type(None)), "model_type": (str,),
          "layer_types": (list, type(None)), "tie_word_embeddings": (bool,)}
PAIRS = ("image_size", "patch_size")  # a whole number, or a [height, width] pair of them
# field -> the model types whose configs may hold it per layer (Gemma 3n's MLP widths), a list of
# num_hidden_layers whole numbers; elsewhere the modelling code reads one number.
PER_LAYER = {"intermediate_size": ("gemma3n_text",)}
NESTED = ("text_config", "vision_config", "audio_config")


def check_config(raw: Any, source: str | Path) -> None:
    """ModelFolderError (naming `source` and the field) unless every size of `raw` (a config as
    a dict: config.json, or a transformers config's to_dict()) is a whole number in range, its
    floats finite and positive, its heads divide as attention needs, and nested text / vision
    configs likewise."""
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{source}: a config is a JSON object, not {type(raw).__name__}")
    _check(raw, source, "")
    for key in NESTED:
        if isinstance(raw.get(key), dict):
            _check(raw[key], source, f"{key}.")
        elif raw.get(key) is not None:
            _refuse(source, key, raw[key], "must be an object")


def _check(raw: dict, source, prefix: str) -> None:
    for key, types in SHAPES.items():
        if key in raw and not isinstance(raw[key], types):
            names = " or ".join("null" if t is type(None) else _json_type(t) for t in types)
            _refuse(source, prefix + key, raw[key], f"must be {names}")
    for key in ("id2label", "label2id"):  # transformers reads id2label's keys as label ids
        labels = raw.get(key)
        if not isinstance(labels, dict):
            continue
        ids = labels.keys() if key == "id2label" else labels.values()
        if not all(str(i).isdigit() for i in ids):
            _refuse(source, prefix + key, labels, "must map label ids (whole numbers) to names")
    for key in ("architectures", "layer_types"):
        if isinstance(raw.get(key), list) and not all(isinstance(v, str) for v in raw[key]):
            _refuse(source, prefix + key, raw[key], "must be a list of strings")
    for key in REQUIRED:
        if key in raw and raw[key] is None:
            _refuse(source, prefix + key, None, "must be set (a whole number)")
    for key, (low, high) in SIZES.items():
        value = raw.get(key)
        if value is None:
            continue
        if key in PAIRS and isinstance(value, list) and len(value) == 2:
            for side in value:  # InternVL's vision tower: [height, width]
                _check_size(source, prefix + key, side, low, high)
            continue
        if raw.get("model_type") in PER_LAYER.get(key, ()) and isinstance(value, list) and value:
            layers = raw.get("num_hidden_layers")
            if isinstance(layers, int) and len(value) != layers:
                _refuse(source, prefix + key, value, f"must hold one size per layer ({layers})")
            for size in value:
                _check_size(source, prefix + key, size, low, high)
            continue
        _check_size(source, prefix + key, value, low, high)
    _check_floats(raw, source, prefix)
    for key in ("rope_parameters", "rope_scaling"):  # rope_theta may live there instead
        if isinstance(raw.get(key), dict):
            _check_floats(raw[key], source, f"{prefix}{key}.")
    _check_relations(raw, source, prefix)


def _check_size(source, field: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _refuse(source, field, value, "must be a whole number")
    if not low <= value <= high:
        _refuse(source, field, value, f"must be between {low:,} and {high:,}")


def _check_floats(raw: dict, source, prefix: str) -> None:
    for key, (low, high) in FLOATS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or not low < value <= high:
            _refuse(source, prefix + key, value, f"must be a number above {low:g} and at most "
                                                 f"{high:g}")


def _check_relations(raw: dict, source, prefix: str) -> None:
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    kv_heads = raw.get("num_key_value_heads")
    if heads and hidden and raw.get("head_dim") is None and \
            raw.get("qk_nope_head_dim") is None and hidden % heads:
        _refuse(source, prefix + "hidden_size", hidden, f"is not a multiple of "
                f"num_attention_heads {heads} (and head_dim is not given)")
    if heads and kv_heads and heads % kv_heads:
        _refuse(source, prefix + "num_key_value_heads", kv_heads,
                f"does not divide num_attention_heads {heads}")
    experts = next((raw[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if raw.get(k)), 0)
    per_token = raw.get("num_experts_per_tok") or 0
    if experts and per_token > experts:
        _refuse(source, prefix + "num_experts_per_tok", per_token,
                f"is more than the {experts} experts")
    types, layers = raw.get("layer_types"), raw.get("num_hidden_layers")
    if isinstance(types, list) and layers and len(types) != layers:
        _refuse(source, prefix + "layer_types", f"{len(types)} entries",
                f"must name each of the {layers} layers")


def _json_type(t: type) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false"}[t]


def _refuse(source, field: str, value: Any, problem: str):
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ModelFolderError(f"{source}: {field} is {shown}: {problem}")
