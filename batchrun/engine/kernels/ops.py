"""The C kernels as typed ops: tensors in, tensors out.

This module is the only place that holds ctypes, raw pointers, the kernels' dtype codes and
thread counts. `CpuKernels` wraps the loaded library (kernels.library() returns one, or None);
each method declares the C signature of the function it calls beside it (`c_signature`, which
`CpuKernels` applies to the library and tests/unit/test_kernel_signatures.py checks against the
C prototypes). The ops that have a PyTorch path too are in fallback_ops.py.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

# Element types the kernels read and write, and their codes (dtypes.h).
KINDS = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2, "torch.float8_e4m3fn": 3,
         "torch.int8": 4}
P, I, I64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# name -> (restype, argtypes) of every C function the library exports.
SIGNATURES: dict[str, tuple[type | None, Sequence[type]]] = {}


def c_signature(name: str, restype: type | None, argtypes: Sequence[type]) -> Callable:
    """Declare C function `name`'s signature (a decorator for the op that calls it)."""
    SIGNATURES[name] = (restype, argtypes)
    return lambda op: op


# Exported, called by no op: the attention kernel's older entry points (paged_attention.c).
c_signature("paged_attention", I, [P] * 4 + [I] + [P] * 3 + [I] * 4 + [FLOAT] + [I] * 3 + [P] * 3)
c_signature("paged_attention_masked", I, [P] * 4 + [I] + [P] * 3 + [I] * 4 + [FLOAT] + [I] * 3
            + [P] * 4 + [FLOAT, P])


def kind(dtype: torch.dtype) -> int:
    """The kernels' code for a tensor's element type."""
    return KINDS[str(dtype)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


class AttentionRows(Protocol):
    """The rows the attention kernel attends (engine/attention/cascade.py's KernelRows)."""
    tables: torch.Tensor
    row_table: torch.Tensor
    row_len: torch.Tensor
    groups: int
    order: torch.Tensor
    group_start: torch.Tensor
    group_shared: torch.Tensor
    per_row: bool  # each row scored as alone, over shared blocks too (--batch-invariant)


class CpuKernels:
    """The loaded library's functions as typed ops (no PyTorch fallback here)."""

    def __init__(self, lib: ctypes.CDLL):
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._c = lib

    @c_signature("simd_path", I, [])
    def simd_path(self) -> int:
        """The vector path built in: 2 AVX-512, 1 AVX2+FMA, 0 portable (kernels.SIMD_PATHS)."""
        return self._c.simd_path()

    @c_signature("bf16_products", I, [])
    def bf16_products(self) -> bool:
        """Whether the attention kernel multiplies bfloat16 pairs (AVX512-BF16)."""
        return bool(self._c.bf16_products())

    @c_signature("bf16_gemm_dot", I, [])
    def bf16_gemm_dot(self) -> int:
        return self._c.bf16_gemm_dot()

    @c_signature("bf16_gemm_amx", I, [])
    def bf16_gemm_amx(self) -> bool:
        """Whether bf16_gemm multiplies with AMX-BF16 tiles (built for them, and the OS lets
        this process use them)."""
        return bool(self._c.bf16_gemm_amx())

    @c_signature("add_rms_norm", None, [P] * 4 + [I64] * 2 + [FLOAT, I, I, I])
    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """residual [rows, n] += x in place (x None: nothing added), and the RMS norm of the sum
        in the weight's dtype (into `out`, which may be the residual itself)."""
        out = torch.empty(residual.shape, dtype=weight.dtype) if out is None else out
        x = None if x is None else x.to(weight.dtype).contiguous()
        self._c.add_rms_norm(_ptr(x), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                             residual.shape[0], residual.shape[1], eps, kind(weight.dtype),
                             kind(residual.dtype), _threads())
        return out

    def rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The RMS norm of x (converted to the weight's dtype) in place."""
        x = x.to(weight.dtype).contiguous()
        return self.add_rms_norm(None, x, weight, eps, out=x)

    @c_signature("silu_mul", None, [P, P, I64, I64, I, I])
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of contiguous rows [gate | up]."""
        return self._gated(self._c.silu_mul, gate_up)

    @c_signature("gelu_tanh_mul", None, [P, P, I64, I64, I, I])
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of contiguous rows [gate | up]."""
        return self._gated(self._c.gelu_tanh_mul, gate_up)

    @staticmethod
    def _gated(fn, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[-1] // 2
        act = gate_up.new_empty((gate_up.shape[0], n))
        fn(gate_up.data_ptr(), act.data_ptr(), gate_up.shape[0], n, kind(act.dtype), _threads())
        return act

    @c_signature("softcap_inplace", None, [P, I64, I64, FLOAT, I])
    def softcap_(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """x = cap * tanh(x / cap) in place, float32 contiguous."""
        n = x.shape[-1]
        self._c.softcap_inplace(x.data_ptr(), x.numel() // n, n, cap, _threads())
        return x

    @c_signature("rope_inplace", I, [P, P, P, P, I64, I64, I, I, I, I])
    def rope_(self, qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first `heads` heads of each row of qkv [T, >= heads * head_dim] in place by
        the cos/sin tables [positions, head_dim] at int64 `positions` [T]."""
        rc = self._c.rope_inplace(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                                  sin.data_ptr(), qkv.shape[0], qkv.stride(0), heads, head_dim,
                                  kind(qkv.dtype), _threads())
        if rc != 0:
            raise RuntimeError(f"rope_inplace failed for head_dim {head_dim}")
        return qkv

    @c_signature("kv_write", None, [P] * 5 + [I64] * 3 + [I] * 2)
    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """k/v [T, Hkv, D] (heads contiguous, same row stride) into the caches' int64 `slots`,
        converted to the cache's dtype."""
        self._c.kv_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         slots.data_ptr(), k.shape[0], k.stride(0), k.shape[1] * k.shape[2],
                         kind(k.dtype), kind(k_cache.dtype))

    @c_signature("int8_kv_rows", None, [P, I, I64, I64, I, I] + [P] * 4)
    def int8_round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] quantized to int8 per row and back, float32."""
        out = torch.empty(x.shape, dtype=torch.float32)
        self._c.int8_kv_rows(x.data_ptr(), kind(x.dtype), x.shape[0], x.stride(0), x.shape[1],
                             x.shape[2], None, None, None, out.data_ptr())
        return out

    def int8_kv_store(self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                      scales: torch.Tensor) -> None:
        """rows [T, heads, D] quantized into int8 cache[slots], their scales into scales[slots]."""
        self._c.int8_kv_rows(rows.data_ptr(), kind(rows.dtype), rows.shape[0], rows.stride(0),
                             rows.shape[1], rows.shape[2], slots.data_ptr(), cache.data_ptr(),
                             scales.data_ptr(), None)

    @c_signature("quantize_rows_int8", None, [P] * 3 + [I64] * 2 + [I] * 2)
    @c_signature("quantize_rows_u8", None, [P] * 3 + [I64] * 2 + [I] * 2)
    def quantize_rows(self, x: torch.Tensor, unsigned: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 q, float32 scales [M, 1]) of contiguous x [M, K]; unsigned: uint8 q + 128."""
        q = torch.empty(x.shape, dtype=torch.uint8 if unsigned else torch.int8)
        scale = torch.empty((x.shape[0], 1), dtype=torch.float32)
        fn = self._c.quantize_rows_u8 if unsigned else self._c.quantize_rows_int8
        fn(x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.shape[0], x.shape[1], kind(x.dtype),
           _threads())
        return q, scale

    @c_signature("quantize_rows_split_u8", None, [P] * 3 + [I64] + [P] * 3 + [I64] * 2 + [I] * 2)
    def quantize_rows_split(self, x: torch.Tensor, mult: torch.Tensor, outliers: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """quantize_rows(x * mult, unsigned=True) and the bfloat16 outlier columns, one pass."""
        rows, cols = x.shape
        q = torch.empty((rows, cols), dtype=torch.uint8)
        scale = torch.empty((rows, 1), dtype=torch.float32)
        x_out = torch.empty((rows, len(outliers) + len(outliers) % 2), dtype=torch.bfloat16)
        self._c.quantize_rows_split_u8(x.data_ptr(), mult.data_ptr(), outliers.data_ptr(),
                                       len(outliers), x_out.data_ptr(), q.data_ptr(),
                                       scale.data_ptr(), rows, cols, kind(x.dtype), _threads())
        return q, scale, x_out

    @c_signature("scale_rows", None, [P] * 5 + [I64] * 3 + [I])
    def scale_rows_(self, y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    x_out: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> None:
        """y [M, N] float32 = y * scale (+ bias) (+ x_out @ pairs) in place."""
        pairs_ptr, num_pairs = None, 0
        if x_out is not None:
            assert pairs is not None  # the outlier columns come with their weight pairs
            x_out, pairs = x_out.contiguous(), pairs.contiguous()
            pairs_ptr, num_pairs = pairs.data_ptr(), pairs.shape[0]
        self._c.scale_rows(y.data_ptr(), scale.data_ptr(), _ptr(bias), _ptr(x_out), pairs_ptr,
                           num_pairs, y.shape[0], y.shape[1], _threads())

    @c_signature("expert_gemm", None, [P] * 5 + [I64] * 3 + [I] * 2)
    def expert_gemm(self, rows: torch.Tensor, weights: torch.Tensor, active: torch.Tensor,
                    bounds: torch.Tensor) -> torch.Tensor:
        """rows [pairs, in] sorted by expert times each one's weights [experts, out, in]
        transposed; active [groups] int64 experts, bounds [groups + 1] int64 their runs."""
        out = rows.new_empty((len(rows), weights.shape[1]))
        self._c.expert_gemm(rows.contiguous().data_ptr(), weights.data_ptr(), out.data_ptr(),
                            active.data_ptr(), bounds.data_ptr(), len(active), weights.shape[1],
                            weights.shape[2], kind(rows.dtype), _threads())
        return out

    @c_signature("grouped_int8_linear", None, [P] * 5 + [I64] * 4 + [I] * 2)
    def grouped_int8_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                            minimum: torch.Tensor | None, group: int) -> torch.Tensor:
        """x [rows, k] times int8 weights q [n, k] of float32 scale (and min) per group."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
        self._c.grouped_int8_linear(x.data_ptr(), q.data_ptr(), scale.data_ptr(), _ptr(minimum),
                                    y.data_ptr(), x.shape[0], q.shape[0], q.shape[1], group,
                                    kind(x.dtype), _threads())
        return y

    @c_signature("int8_amx", I, [])
    def int8_amx(self) -> bool:
        """Whether int8_amx_gemm runs here (AMX-INT8 built in, and allowed by the OS)."""
        return bool(self._c.int8_amx())

    @c_signature("int8_amx_gemm", I, [P] * 5 + [I64] * 3 + [I])
    def int8_amx_gemm(self, ux: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor,
                      w_scale: torch.Tensor, n: int) -> torch.Tensor:
        """float32 [M, n] = (ux [M, k] uint8 (q + 128) . w^T - 128 * wsum) * w_scale, w packed
        by models/quant/int8_amx.pack (k % 64 == 0), wsum int32 [n], w_scale float32 [n]."""
        out = torch.empty(ux.shape[0], n)
        rc = self._c.int8_amx_gemm(ux.data_ptr(), packed.data_ptr(), wsum.data_ptr(),
                                   w_scale.data_ptr(), out.data_ptr(), ux.shape[0], n,
                                   ux.shape[1], _threads())
        if rc != 0:
            raise RuntimeError("int8_amx_gemm: no AMX-INT8 here, or k not a multiple of 64")
        return out

    @c_signature("bf16_gemm", None, [P] * 4 + [I64] * 3 + [I, I])
    def bf16_gemm(self, rows: torch.Tensor, packed: torch.Tensor, n: int,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[M, n] of out_dtype (float32 or bfloat16: float32 sums rounded once) = bfloat16 rows
        [M, k] (contiguous) times the weight bf16_gemm_linear.pack laid out, plus bias (float32
        [n]). A row's result does not depend on M."""
        out = torch.empty(rows.shape[0], n, dtype=out_dtype)
        self._c.bf16_gemm(rows.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                          out.data_ptr(), rows.shape[0], n, rows.shape[1],
                          int(out_dtype == torch.bfloat16), _threads())
        return out

    @c_signature("gated_delta_rule", I, [P] * 8 + [I64] + [I] * 4 + [P, I])
    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                         slots: torch.Tensor, query_start: torch.Tensor) -> torch.Tensor:
        """The gated delta rule (gated_delta.c) over packed sequences: q, k [T, Hk, dk]
        (normalised, q scaled), v [T, Hv, dv], g (log decay) and beta [T, Hv]; sequence i owns
        rows query_start[i]:query_start[i + 1] and continues state[slots[i]] ([slots, Hv, dk,
        dv] float32, updated in place). float32 [T, Hv, dv]."""
        q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
        slots, query_start = slots.long().contiguous(), query_start.long().contiguous()
        out = torch.empty_like(v)
        rc = self._c.gated_delta_rule(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
            state.data_ptr(), slots.data_ptr(), query_start.data_ptr(), len(slots), k.shape[1],
            v.shape[1], k.shape[2], v.shape[2], out.data_ptr(), _threads())
        if rc != 0:
            raise RuntimeError(f"gated_delta_rule cannot run value heads of {v.shape[2]}")
        return out

    @c_signature("causal_conv_silu", None, [P] * 6 + [I64] * 2 + [I, P, I])
    def causal_conv_silu(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                         slots: torch.Tensor, query_start: torch.Tensor,
                         fresh: torch.Tensor) -> torch.Tensor:
        """silu of the depthwise causal convolution (causal_conv.c) of packed rows x [T, C]
        float32, weight [C, K] (tap j reads K - 1 - j rows back), each sequence i (rows
        query_start[i]:query_start[i + 1]) after state[slots[i]] ([slots, K - 1, C] float32, its
        last inputs; zeros where fresh[i]), which then keeps its last K - 1 inputs. [T, C]."""
        x, w = x.contiguous(), weight.float().t().contiguous()
        slots, query_start = slots.long().contiguous(), query_start.long().contiguous()
        fresh = fresh.to(torch.uint8).contiguous()
        out = torch.empty_like(x)
        self._c.causal_conv_silu(x.data_ptr(), w.data_ptr(), state.data_ptr(), slots.data_ptr(),
                                 query_start.data_ptr(), fresh.data_ptr(), len(slots), x.shape[1],
                                 w.shape[0], out.data_ptr(), _threads())
        return out

    @c_signature("fp8_from_floats", None, [P, P, I64])
    def fp8_from_floats(self, x: torch.Tensor) -> torch.Tensor:
        """float32 x (contiguous) as e4m3 bytes (uint8)."""
        out = torch.empty(x.shape, dtype=torch.uint8)
        self._c.fp8_from_floats(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    @c_signature("fp8_to_floats", None, [P, P, I64])
    def fp8_to_floats(self, codes: torch.Tensor) -> torch.Tensor:
        """e4m3 bytes (uint8, contiguous) as float32."""
        out = torch.empty(codes.shape, dtype=torch.float32)
        self._c.fp8_to_floats(codes.data_ptr(), out.data_ptr(), codes.numel())
        return out

    @c_signature("paged_attention_scaled", I, [P] * 4 + [I] + [P] * 3 + [I] * 4 + [FLOAT]
                 + [I] * 3 + [P] * 4 + [FLOAT, P, P, P, P, I])
    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        rows: AttentionRows, block_size: int, scale: float,
                        first: torch.Tensor | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None,
                        alibi: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `rows` of q [T, H, D] over the paged caches, float32 [T, H, D] (rows
        outside the groups left uninitialised). first: int64 [rows] each row's first visible
        position; sinks: float32 [H]; k/v_scales: an int8 cache's row scales; alibi: float32
        [H] ALiBi slopes (a score gains slope * (key position - the row's last position))."""
        qf = q.float().contiguous()  # the kernel computes in float32 whatever the model's dtype
        of = torch.empty_like(qf)
        rc = self._c.paged_attention_scaled(
            qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.tables.data_ptr(),
            rows.tables.shape[1], rows.row_table.data_ptr(), rows.row_len.data_ptr(),
            of.data_ptr(), q.shape[1], k_cache.shape[1], q.shape[2], block_size, scale,
            kind(k_cache.dtype), _threads(), rows.groups, rows.order.data_ptr(),
            rows.group_start.data_ptr(), rows.group_shared.data_ptr(), _ptr(first),
            softcap or 0.0, _ptr(sinks), _ptr(k_scales), _ptr(v_scales), _ptr(alibi),
            int(rows.per_row))
        if rc != 0:
            raise RuntimeError("paged_attention failed")
        return of

    @c_signature("paged_decode_attention", I, [P] * 6 + [I] * 6 + [FLOAT] + [I] * 2)
    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                               block_size: int, scale: float) -> torch.Tensor:
        """One row per sequence: q [B, H, D], int64 tables [B, W] and lens [B]; float32 out."""
        qd = q.float().contiguous()
        od = torch.empty_like(qd)
        rc = self._c.paged_decode_attention(
            qd.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), od.data_ptr(), q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2],
            block_size, tables.shape[1], scale, kind(k_cache.dtype), _threads())
        if rc != 0:
            raise RuntimeError("paged_decode_attention failed")
        return od

    @c_signature("cascade_groups", I, [P, P] + [I] * 4 + [P] * 3)
    def cascade_groups(self, tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                       max_group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, group_start, shared) int32 arrays grouping decode sequences (int64 tables
        [B, W] contiguous, lens [B]) that share prefix blocks."""
        b = tables.shape[0]
        order, start, shared = (np.empty(n, np.int32) for n in (b, b + 1, b))
        groups = self._c.cascade_groups(tables.data_ptr(), lens.data_ptr(), b, tables.shape[1],
                                        block_size, max_group, order.ctypes.data,
                                        start.ctypes.data, shared.ctypes.data)
        if groups <= 0:
            raise RuntimeError("cascade_groups failed")
        return order, start[:groups + 1], shared[:groups]
