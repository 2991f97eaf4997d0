"""Q4_K / Q5_K / Q6_K blocks built in numpy from ggml's block spec (gguf-py dequantizes these
types but cannot quantize them): a plain round-to-nearest encoder, for tests' GGUF files. The
tests check what it writes against gguf.quants.dequantize."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _scale_min_k(w: np.ndarray, levels: int):
    """Per 32-weight sub-block of [n, 8, 32]: d, dmin (fp16-rounded), 6-bit sc, m, and q."""
    lo = np.minimum(w.min(-1), 0)
    step = np.maximum((w.max(-1) - lo) / levels, 1e-8)
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.maximum(d[:, None], 1e-12)), 1, 63)
    m = np.clip(np.round(-lo / np.maximum(dmin[:, None], 1e-12)), 0, 63)
    scale, mn = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round((w + mn[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def _pack_k_scales(sc, m):
    return np.concatenate((sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)), axis=-1)


def _low_nibbles(q):  # [n, 256] 0..15 -> 128 bytes: per 64 weights, byte l = q[l] | q[32 + l] << 4
    c = q.reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)


def q4_k(w):
    d, dmin, sc, m, q = _scale_min_k(w.reshape(-1, 8, 32), 15)
    return np.concatenate((_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m),
                           _low_nibbles(q.reshape(-1, 256))), axis=-1)


def q5_k(w):
    d, dmin, sc, m, q = _scale_min_k(w.reshape(-1, 8, 32), 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)  # [n, 32]
    return np.concatenate((_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh,
                           _low_nibbles(q.reshape(-1, 256) & 15)), axis=-1)


def q6_k(w):
    w = w.reshape(-1, 16, 16)
    step = np.maximum(np.abs(w).max(-1) / 31, 1e-8)
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d[:, None]), 1, 127)
    q = (np.clip(np.round(w / (d[:, None] * sc)[..., None]), -32, 31) + 32).astype(np.uint8)
    halves = q.reshape(-1, 2, 128)
    ql = (halves[:, :, :64] & 15) | ((halves[:, :, 64:] & 15) << 4)  # [n, 2, 64]
    pairs = (halves >> 4).reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = pairs.sum(axis=2, dtype=np.uint8)  # [n, 2, 32]
    return np.concatenate((ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)), axis=-1)


ENCODERS = {Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}


def quantize(w: np.ndarray, kind) -> np.ndarray:
    """Blocks of float32 [rows, cols] as `kind`: gguf-py's quantizer where it has one."""
    if kind not in ENCODERS:
        return gguf_quantize(w, kind)
    rows, cols = w.shape
    return ENCODERS[kind](np.ascontiguousarray(w, dtype=np.float32)).reshape(rows, -1)
