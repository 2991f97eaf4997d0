"""A model folder's config.json read as plain JSON, without transformers' AutoConfig (which
imports the model's transformers code: about a second of every cold start).

`read_config(folder)` gives an object with the attributes ModelConfig.from_hf and the RoPE table
read, with the defaults transformers' Llama / Mistral / Qwen2 / Qwen3 configs give the keys
config.json may leave out. A config it cannot promise to read the same (another model type, a
RoPE variant other than the default, keys whose defaults differ between those classes left
out) goes through AutoConfig. tests/unit/test_hf_config.py compares both. Either way the file's
values pass sizes.check_config first, and a folder that ships code is refused unless trusted
(weights/remote_code.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from batchrun.models.weights.json_file import read_object
from batchrun.models.weights.remote_code import auto_kwargs, check_folder
from batchrun.models.config.sizes import check_config
from batchrun.models.errors import ModelFolderError, naming

PLAIN_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
# Keys whose transformers default differs between those classes (or that every real config sets).
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size", "max_position_embeddings")
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "rope_theta": 10000.0}
# The JSON types those classes (strict dataclasses) accept for the fields they declare: a value
# of another type goes through AutoConfig, whose refusal then names the file.
_NONE = type(None)
FIELD_TYPES = {
    **dict.fromkeys(("attention_bias", "mlp_bias", "tie_word_embeddings", "use_cache",
                     "use_sliding_window", "is_encoder_decoder"), (bool,)),
    **dict.fromkeys(("output_hidden_states", "return_dict"), (bool, _NONE)),
    **dict.fromkeys(("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                     "num_attention_heads", "max_position_embeddings", "max_window_layers",
                     "chunk_size_feed_forward", "num_labels"), (int,)),
    **dict.fromkeys(("bos_token_id", "pad_token_id", "pretraining_tp", "sliding_window",
                     "head_dim", "num_key_value_heads"), (int, _NONE)),
    "eos_token_id": (int, list, _NONE), "hidden_act": (str,),
    **dict.fromkeys(("dtype", "torch_dtype", "transformers_version", "problem_type"),
                    (str, _NONE)),
    **dict.fromkeys(("architectures", "layer_types"), (list, _NONE)),
    **dict.fromkeys(("id2label", "label2id", "rope_parameters", "rope_scaling"), (dict, _NONE)),
    **dict.fromkeys(("rms_norm_eps", "initializer_range", "attention_dropout"), (int, float)),
}


def plain_config(folder: Path) -> SimpleNamespace | None:
    """config.json as attributes, or None when AutoConfig must read it."""
    return _plain(read_object(Path(folder) / "config.json"))


def _plain(raw: dict[str, Any]) -> SimpleNamespace | None:
    model_type = raw.get("model_type", "llama")
    if model_type not in PLAIN_TYPES or any(raw.get(k) is None for k in REQUIRED) \
            or not all(_accepted(k, v) for k, v in raw.items()) \
            or "text_config" in raw or "vision_config" in raw:
        return None
    if model_type == "qwen3" and raw.get("head_dim") is None:  # Qwen3's default is 128
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    values = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    theta = rope.get("rope_theta", values["rope_theta"])
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    values["rope_theta"] = theta
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
    values.setdefault("architectures", None)
    values["model_type"] = model_type
    return SimpleNamespace(**values)


def read_raw(folder: str | Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """config.json as JSON, its sizes checked (sizes.py), after refusing a folder that ships
    code unless `trust_remote_code` (weights/remote_code.py); ModelFolderError naming the file."""
    check_folder(folder, trust_remote_code)
    source = Path(folder) / "config.json"
    raw = read_object(source)
    check_config(raw, source)
    return raw


def _accepted(key: str, value: Any) -> bool:
    """Whether the plain classes take `value` for `key` (FIELD_TYPES; other keys they keep as
    they are)."""
    types = FIELD_TYPES.get(key)
    if types is None:
        return True
    if isinstance(value, bool) and bool not in types:
        return False
    if isinstance(value, list):
        item = int if key == "eos_token_id" else str
        return list in types and all(isinstance(v, item) and not isinstance(v, bool)
                                     for v in value)
    return isinstance(value, types)


def read_config(folder: str | Path, trust_remote_code: bool = False) -> Any:
    """plain_config(folder), else transformers' AutoConfig; ModelFolderError (naming the file)
    for a value out of type or range, code the folder ships unless `trust_remote_code`, or a
    config transformers cannot read."""
    folder = Path(folder)
    source = folder / "config.json"
    config = _plain(read_raw(folder, trust_remote_code))
    if config is not None:
        return config
    from transformers import AutoConfig

    with naming(source, "transformers cannot read it"):
        config = AutoConfig.from_pretrained(folder, **auto_kwargs(trust_remote_code))
    check_config(config.to_dict(), source)  # with the defaults of the keys the file left out
    for key in ("text_config", "vision_config"):  # sub-configs the class has no place for
        value = config.get_text_config() if key == "text_config" else getattr(config, key, None)
        if value is not None and not hasattr(value, "to_dict"):
            raise ModelFolderError(f"{source}: {key} is not one transformers reads for model "
                                   f"type {config.model_type!r}")
    return config

