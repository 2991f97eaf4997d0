"""A Llama-architecture .gguf file's config and weights as a Hugging Face safetensors folder,
fast: one pass over the file's header (its 49k-token vocabulary arrays are skipped, not parsed),
numpy-vectorised dequantisation (gguf.quants) on a few threads, q/k rows un-permuted as
transformers does, and one safetensors write. transformers' own GGUF loading parses the whole
file three times and maps tensor names in pure Python (about 15 s for the bundled 135M model);
this takes about one. The tokenizer is still converted by transformers (models/weights/loader.py).
tests/integration/test_gguf_convert.py compares the result with transformers' conversion.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = {"llama"}
# GGUF value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class _Header:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return text

    def value(self, kind: int, keep_arrays: bool) -> Any:
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.take(_SCALARS[kind])
        item, count = self.take("I"), self.take("Q")
        if item in _SCALARS and item != 7:
            size = struct.calcsize(_SCALARS[item])
            if not keep_arrays:
                self.pos += size * count
                return count
            values = list(struct.unpack_from(f"<{count}{_SCALARS[item]}", self.buf, self.pos))
            self.pos += size * count
            return values
        if item == 8 and not keep_arrays:  # a vocabulary: skipped, not decoded
            for _ in range(count):
                n = self.take("Q")
                self.pos += n
            return count
        return [self.value(item, keep_arrays) for _ in range(count)]


def read_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int]:
    """(metadata without its arrays, tensors as (name, dims, type, offset), data start)."""
    with open(path, "rb") as f:
        import mmap

        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    h = _Header(memoryview(mm))
    if bytes(h.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    h.pos = 4
    version, n_tensors, n_kv = h.take("I"), h.take("Q"), h.take("Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string()
        meta[key] = h.value(h.take("I"), keep_arrays=False)
    tensors = []
    for _ in range(n_tensors):
        name = h.string()
        dims = [h.take("Q") for _ in range(h.take("I"))]
        tensors.append((name, dims, h.take("I"), h.take("Q")))
    align = meta.get("general.alignment", 32)
    start = -(-h.pos // align) * align
    h.buf.release()
    mm.close()
    return meta, tensors, start


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json for a llama GGUF, as transformers' conversion writes the keys batchrun reads."""
    p = "llama."
    heads = meta[p + "attention.head_count"]
    hidden = meta[p + "embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": meta[p + "feed_forward_length"],
        "num_hidden_layers": meta[p + "block_count"], "num_attention_heads": heads,
        "num_key_value_heads": meta.get(p + "attention.head_count_kv", heads),
        "head_dim": meta.get(p + "rope.dimension_count", hidden // heads),
        "max_position_embeddings": meta[p + "context_length"],
        "rms_norm_eps": meta[p + "attention.layer_norm_rms_epsilon"],
        "rope_parameters": {"rope_theta": meta.get(p + "rope.freq_base", 10000.0),
                            "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": meta.get(p + "vocab_size", meta.get("tokenizer.ggml.tokens")),
        "attention_bias": False, "mlp_bias": False, "dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key.replace("padding", "pad").replace("unknown", "unk")] = meta[f"tokenizer.ggml.{key}"]
    return config


def supports(path: Path) -> bool:
    meta, tensors, _ = read_header(path)
    if meta.get("general.architecture") not in ARCHITECTURES or meta.get("llama.rope.scaling.type"):
        return False
    try:
        names = {_hf_name(name) for name, *_ in tensors}
    except KeyError:
        return False
    return None not in names


def _hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    if base == "rope_freqs":
        return None  # a RoPE variant: not the fast path's
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def convert(path: Path, out: Path) -> dict[str, Any]:
    """Write out/config.json and out/model.safetensors; returns the config."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    meta, tensors, start = read_header(path)
    config = hf_config(meta, {name for name, *_ in tensors})
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def one(entry):
        name, dims, kind, offset = entry
        qtype = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        shape = list(reversed(dims))  # numpy order: the last dim is GGUF's first (fastest)
        count = int(np.prod(shape))
        raw = data[start + offset:start + offset + count // block * block_bytes]
        values = dequantize(raw.reshape(-1, dims[0] // block * block_bytes), qtype)
        values = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
        if ".attn_q." in name:
            values = unpermute(values, config["num_attention_heads"])
        elif ".attn_k." in name:
            values = unpermute(values, config["num_key_value_heads"])
        return _hf_name(name), torch.from_numpy(values if values.flags.writeable else values.copy())

    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        weights = dict(pool.map(one, tensors))
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config
