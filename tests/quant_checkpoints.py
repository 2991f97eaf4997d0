"""Quantized checkpoints written here, in numpy, from a tiny model's float weights: GPTQ, AWQ,
compressed-tensors, FP8 and MXFP4 (GPT-OSS's experts), each packed as its format's spec says,
with the reference dequantisation of each (the format's formula, or transformers' own MXFP4
conversion, independent of batchrun's reading)."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# a decoder projection's weight: Llama's and Qwen-MoE's experts' names, and Mixtral's experts'
PROJECTION_SUFFIXES = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight


def pack_nibbles(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """int32 words of eight 4-bit values along the last axis: nibble i holds value order[i]."""
    v = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i, j in enumerate(order):
        words |= v[..., j] << np.uint32(4 * i)
    return words.view(np.int32)


def int4_groups(w: np.ndarray, group: int, sym: bool):
    """(q [N, K] in 0..15, scale float16 [N, G], zero [N, G] in 0..15), w ~ scale * (q - zero)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if sym:
        scale = (np.abs(g).max(-1) / 7.5).astype(np.float16)
        zero = np.full(scale.shape, 8)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = ((hi - lo) / 15).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / scale.astype(np.float32)[..., None]) + zero[..., None], 0, 15)
    return q.reshape(n, k).astype(np.int64), scale, zero


def dequantize_groups(q, scale, zero, group, g_idx=None):
    """w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]) in float32, g = g_idx[k] (k // group)."""
    cols = np.arange(q.shape[1]) // group if g_idx is None else g_idx
    return scale.astype(np.float32)[:, cols] * (q - zero[:, cols]).astype(np.float32)


def act_order_groups(w, size, sym, act_order):
    """int4_groups of w's inputs in a permuted order when act_order (the same order for every
    K-wide layer, as q/k/v share theirs), else in their own: (q in w's input order, scale,
    zero, g_idx: each input's group)."""
    k = w.shape[1]
    perm = np.random.default_rng(k).permutation(k) if act_order else np.arange(k)
    q_sorted, scale, zero = int4_groups(w[:, perm], size, sym)
    q = np.empty_like(q_sorted)
    q[:, perm] = q_sorted
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // size
    return q, scale, zero, g_idx


def gptq(w, group, sym, v2, act_order=False):
    """GPTQ's tensors of w [N, K] and their dequantisation (act_order: act_order_groups)."""
    size = w.shape[1] if group == -1 else group
    q, scale, zero, g_idx = act_order_groups(w, size, sym, act_order)
    if not v2:
        zero = np.maximum(zero, 1)  # the original packing stores zero - 1, so zero 0 cannot be stored
        q = np.clip(q, 0, 15)
    stored = zero if v2 else zero - 1
    tensors = {"qweight": pack_nibbles(q).T.copy(),  # eight input rows a word
               "qzeros": pack_nibbles(stored.T), "scales": scale.T.copy(), "g_idx": g_idx}
    return tensors, dequantize_groups(q, scale, zero, size, g_idx)


def awq(w, group):
    q, scale, zero = int4_groups(w, group, sym=False)
    tensors = {"qweight": pack_nibbles(q.T, AWQ_ORDER), "qzeros": pack_nibbles(zero.T, AWQ_ORDER),
               "scales": scale.T.copy()}
    return tensors, dequantize_groups(q, scale, zero, group)


def ct_int4(w, group, sym, act_order=False):
    """compressed-tensors pack-quantized: weight_packed [N, K/8] of q + 8, zero points packed
    down the output dimension; with act_order ("group" ordering) the groups are of the inputs in
    a permuted order, and weight_g_idx [K] says each input's group (vLLM's reading)."""
    n, k = w.shape
    q, scale, zero, g_idx = act_order_groups(w, group, sym, act_order)
    tensors = {"weight_packed": pack_nibbles(q), "weight_scale": np.ascontiguousarray(scale, dtype=np.float32),
               "weight_shape": np.array([n, k], dtype=np.int64)}
    if act_order:
        tensors["weight_g_idx"] = g_idx
    if not sym:
        tensors["weight_zero_point"] = pack_nibbles(zero.T).T.copy()
    return tensors, dequantize_groups(q, scale, zero, group, g_idx)


def ct_int8(w):
    scale = (np.abs(w).max(1, keepdims=True) / 127).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return {"weight": q, "weight_scale": scale}, q.astype(np.float32) * scale


def fp8(w, block, scale_name):
    """e4m3 weights with a float32 scale per tensor (block None), per row (block (1, K)) or per
    (bn, bk) block, and w = weight * scale of its block."""
    n, k = w.shape
    bn, bk = block or (n, k)
    rows, cols = -(-n // bn), -(-k // bk)
    padded = np.zeros((rows * bn, cols * bk), np.float32)
    padded[:n, :k] = w
    amax = np.abs(padded.reshape(rows, bn, cols, bk)).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-6) / 448).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
    weight = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
    stored = scale.reshape(-1) if block is None else scale
    return {"weight": weight, scale_name: stored}, weight.float().numpy() * full


def quantize_checkpoint(folder, quantize, config: dict) -> dict[str, np.ndarray]:
    """Rewrite the float checkpoint in `folder` with each decoder projection as
    quantize(weight) stores it; returns the projections' reference dequantisations by name."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    reference = {}
    for name in [n for n in tensors if n.endswith(PROJECTION_SUFFIXES) and ".layers." in n]:
        prefix = name.removesuffix(".weight")
        stored, reference[prefix] = quantize(tensors.pop(name).numpy())
        for key, value in stored.items():
            tensors[f"{prefix}.{key}"] = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
    save_file(tensors, path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(cfg))
    return reference


def dequantised_copy(folder, reference: dict[str, np.ndarray], out) -> None:
    """A float checkpoint in `out` with the original's config and each quantized projection
    replaced by its reference dequantisation (what transformers runs as the reference)."""
    import shutil

    shutil.copytree(folder, out)
    path = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items()
               if k.rsplit(".", 1)[0] not in reference}
    tensors.update({f"{prefix}.weight": torch.from_numpy(np.ascontiguousarray(w, np.float32))
                    for prefix, w in reference.items()})
    save_file(tensors, path)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)  # OCP MX FP4 magnitudes


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 [..., k / 32, 16], scales uint8 [..., k / 32]) of w [..., k]: per 32 inputs
    the E8M0 scale putting the largest magnitude at or under 6, each value rounded to the nearest
    E2M1 code (sign in bit 3), element 2j in byte j's low nibble and 2j + 1 in its high one."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(g).max(-1), 2.0 ** -100)
    e = np.clip(np.ceil(np.log2(amax / 6)) + 127, 1, 254)
    v = g / np.exp2(e - 127)[..., None]
    codes = np.abs(np.abs(v)[..., None] - E2M1).argmin(-1) | np.where(v < 0, 8, 0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(e, np.uint8)


def mxfp4_experts(folder) -> None:
    """Rewrite the tiny GPT-OSS checkpoint in `folder` as OpenAI ships GPT-OSS: each layer's
    experts' gate_up_proj [experts, hidden, 2I] and down_proj [experts, I, hidden] as MXFP4
    blocks and scales over [experts, out, in] (the biases float), quant_method "mxfp4"."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales = mxfp4(tensors.pop(name).transpose(1, 2).contiguous().numpy())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = map(torch.from_numpy, (blocks, scales))
    save_file(tensors, path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))


def mxfp4_dequantised_copy(folder, out) -> None:
    """A float checkpoint in `out` of the MXFP4 one in `folder`: the experts as transformers'
    own conversion (convert_moe_packed_tensors) dequantises them, in its layout."""
    import shutil

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(folder, out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        tensors[base] = convert_moe_packed_tensors(tensors.pop(name), tensors.pop(f"{base}_scales"),
                                                   dtype=torch.float32)
    save_file(tensors, path)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
