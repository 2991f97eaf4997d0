"""The attention backends, in order of preference: the first that runs here is the engine's,
chosen once at start-up. A new backend is a module with its metadata type and builder
(base.AttentionBackend) plus one entry in BACKENDS."""

from __future__ import annotations

from typing import Any, Callable

import torch

from batchrun.engine.attention.base import AttentionBackend, AttentionMetadata, BackendEnv
from batchrun.engine.attention.cpu_kernel import CpuKernelBackend
from batchrun.engine.attention.cuda_triton import TritonBackend
from batchrun.engine.attention import fp8_kv, int8_kv
from batchrun.engine.attention.invariant import InvariantBackend
from batchrun.engine.attention.reference import reference_attention
from batchrun.engine.attention.sdpa import SdpaBackend

BACKENDS: tuple[type[AttentionBackend[Any]], ...] = (InvariantBackend, TritonBackend,
                                                   CpuKernelBackend, SdpaBackend)

# Quantized KV caches: their attend wraps the backend's forward (fp8_kv.py, int8_kv.py).
QUANTIZED = {fp8_kv.FP8: fp8_kv.attend, int8_kv.INT8: int8_kv.attend}
# Each metadata type's forward: what paged_attention dispatches on.
_FORWARD: dict[type[AttentionMetadata], Callable[..., torch.Tensor]] = {
    backend.metadata_type: backend.forward for backend in BACKENDS}
# The metadata types whose forward reads visible_until; the others' steps with it go to the
# reference attention.
_SEES_AHEAD = {b.metadata_type for b in BACKENDS if getattr(b, "sees_ahead", False)}
# The metadata types whose forward takes ALiBi slopes (an `alibi` keyword); the others' ALiBi
# layers go to the reference attention.
_TAKES_ALIBI = {b.metadata_type for b in BACKENDS if getattr(b, "takes_alibi", False)}
# The metadata types whose forward takes an attention chunk (reach.py); the others' chunked
# layers go to the reference attention.
_CHUNKS = {b.metadata_type for b in (InvariantBackend, CpuKernelBackend, SdpaBackend)}


def select_backend(env: BackendEnv) -> AttentionBackend[Any]:
    for backend in BACKENDS:
        chosen = backend.create(env)
        if chosen is not None:
            return chosen
    raise RuntimeError("no attention backend runs here")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None,
                    alibi: torch.Tensor | None = None,
                    chunk: int | None = None) -> torch.Tensor:
    """One layer's attention for the step: q [T, H, D], k/v [T, Hkv, D] of the step's rows (written
    into k_cache/v_cache at meta.slot_mapping); returns [T, H, D]. Runs the backend whose
    builder made `meta`. window: the layer's sliding window (a row at position p sees
    positions p - window < j <= p); softcap: scores become softcap * tanh(score / softcap);
    sinks [H]: a learned logit per head that joins the softmax's denominator only (GPT-OSS).
    alibi [H]: ALiBi's slope per head, a score gaining slope * the key's position (BLOOM,
    Falcon; equal under softmax to slope * (key - query position), MPT's form): the Triton
    backend's and the CPU backend's kernels take it, on other backends the reference attention
    runs it. chunk: the layer's attention chunk (a row at position p sees positions
    p - p % chunk <= j <= p: Llama 4's chunked local attention).
    meta.visible_until set: rows also see later keys of their sequence before it. An fp8 or
    int8 cache carries its scales (fp8_kv.py, int8_kv.py)."""
    if k_cache.dtype in QUANTIZED:
        return QUANTIZED[k_cache.dtype](_attend, q, k, v, k_cache, v_cache, meta, scale, window,
                                        softcap, sinks, alibi, chunk)
    return _attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, alibi, chunk)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
            softcap: float | None, sinks: torch.Tensor | None,
            alibi: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    if alibi is not None and chunk is None and type(meta) in _TAKES_ALIBI \
            and (meta.visible_until is None or type(meta) in _SEES_AHEAD):
        return _FORWARD[type(meta)](q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks,
                                    alibi=alibi)
    if (alibi is not None or (chunk is not None and type(meta) not in _CHUNKS)
            or (meta.visible_until is not None and type(meta) not in _SEES_AHEAD)):
        return reference_attention(q, k, v, k_cache, v_cache, meta, scale,
                                   sliding_window=window, softcap=softcap, sinks=sinks,
                                   alibi=alibi, chunk=chunk)
    if window is None and chunk is None and not softcap and sinks is None:
        return _FORWARD[type(meta)](q, k, v, k_cache, v_cache, meta, scale)
    if chunk is not None:
        return _FORWARD[type(meta)](q, k, v, k_cache, v_cache, meta, scale, window, softcap,
                                    sinks, chunk)
    return _FORWARD[type(meta)](q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks)
