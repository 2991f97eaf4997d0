"""GGUF block types unpacked into integer groups, exactly: w = q * scale (+ min) per group.

Each decoder takes a tensor's raw bytes (rows x cols weights, row-major blocks) and returns
Groups: q [rows, cols] (uint8 0..15 for the 4-bit types, int8 otherwise), scale and min
float32 [rows, cols / group] (min None for the symmetric types). The layouts follow ggml's
block structs (ggml-common.h); gguf.quants.dequantize is the reference the tests hold them to.

| type | block | q | group | scale, min |
|---|---|---|---|---|
| Q4_0 | 32 in 18 B | 4-bit | 32 | d, -8 d |
| Q4_1 | 32 in 20 B | 4-bit | 32 | d, m |
| Q4_K | 256 in 144 B | 4-bit | 32 | d * sc, -dmin * m (6-bit sc, m) |
| Q5_K | 256 in 176 B | 5-bit | 32 | d * sc, -dmin * m (6-bit sc, m) |
| Q6_K | 256 in 210 B | 6-bit, -32..31 | 16 | d * sc (int8 sc) |
| Q8_0 | 32 in 34 B | int8 | 32 | d |
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14  # GGMLQuantizationType values
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
INT4 = (Q4_0, Q4_1, Q4_K)  # q in 0..15, groups of 32 with a min: Int4WeightLinear's form
INT8 = (Q8_0, Q5_K, Q6_K)  # q fits int8: GroupedInt8Linear's form
_K = 256  # a K-quant super-block


class Groups(NamedTuple):
    q: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None
    group: int


def _f16(b: np.ndarray) -> np.ndarray:
    """float32 [..] of little-endian fp16 bytes [.., 2]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[.., 2 * n] of bytes [.., n]: the n low nibbles, then the n high ones."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K's 12 bytes: bytes 0-3 hold scales 0-3 (low
    6 bits), 4-7 mins 0-3; scales/mins 4-7 are bytes 8-11's low/high nibbles plus the top two
    bits of bytes 0-3 / 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((a & 63, (c & 15) | ((a >> 6) << 4)), axis=-1)
    mn = np.concatenate((b & 63, (c >> 4) | ((b >> 6) << 4)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b):
    d = _f16(b[..., 0:2])[..., None]
    return _nibbles(b[..., 2:])[..., None, :], d, -8 * d, 32


def _q4_1(b):
    return _nibbles(b[..., 4:])[..., None, :], _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None], 32


def _q8_0(b):
    return b[..., 2:].view(np.int8)[..., None, :], _f16(b[..., 0:2])[..., None], None, 32


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 weights: 32 low, 32 high
    return _nibbles(qs).reshape(*b.shape[:-1], 8, 32), d * sc, -(dmin * mn), 32


def _q5_k(b):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # bit j of byte l: the fifth bit of weight 32 j + l
    low = _nibbles(b[..., 48:].reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return (low | (high << 4)).astype(np.int8), d * sc, -(dmin * mn), 32


def _q6_k(b):
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])[..., None]
    # per half of 128 weights: 64 bytes of low nibbles (weights 0-63, then 64-127 as high
    # nibbles) and 32 bytes of 2-bit pairs (bits 2j..2j+1 of byte l: weight 32 j + l)
    low = _nibbles(ql.reshape(*b.shape[:-1], 2, 64))
    high = (qh.reshape(*b.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low | (high.reshape(*b.shape[:-1], 2, 128) << 4)).astype(np.int8) - 32
    return q.reshape(*b.shape[:-1], 16, 16), d * sc, None, 16


_DECODERS = {Q4_0: (_q4_0, 32, 18), Q4_1: (_q4_1, 32, 20), Q8_0: (_q8_0, 32, 34),
             Q4_K: (_q4_k, _K, 144), Q5_K: (_q5_k, _K, 176), Q6_K: (_q6_k, _K, 210)}


def supported(kind: int) -> bool:
    return kind in _DECODERS


def groups(raw: np.ndarray, kind: int, rows: int, cols: int) -> Groups:
    """The integer groups of a [rows, cols] tensor stored as `kind` blocks in `raw` (uint8)."""
    decode, block, nbytes = _DECODERS[kind]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block, nbytes)
    q, scale, mn, group = decode(blocks)
    return Groups(np.ascontiguousarray(q.reshape(rows, cols)),
                  np.ascontiguousarray(scale.reshape(rows, cols // group), dtype=np.float32),
                  None if mn is None else np.ascontiguousarray(mn.reshape(rows, cols // group),
                                                               dtype=np.float32), group)
