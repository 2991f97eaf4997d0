"""The Triton attention kernels over an fp8 e4m3 KV cache with fp8_kv.py's layer scales: through
registry.paged_attention (which folds the scales into the query scale and the output) against the
reference attention over the same cache, and through the kernels' own in-kernel scales against
the reference over the dequantised cache."""

from __future__ import annotations

from typing import Callable

import torch

from batchrun.engine.attention import fp8_kv
from batchrun.engine.attention.cuda_triton import TritonBackend
from batchrun.engine.attention.kv_write import store_rows
from batchrun.engine.attention.reference import reference_attention
from batchrun.engine.attention.registry import paged_attention
from batchrun.engine.kernels.triton_decode import paged_decode_attention
from batchrun.engine.kernels.triton_prefill import paged_prefill_attention
from benchmarks.kernel_checks.attention import MIXED, TOL
from benchmarks.kernel_checks.attention_problems import Problem, make_problem, max_err

SCALES = (0.02, 0.01)  # K, V: values up to 448 * scale, past the random data's largest


def _fp8_caches(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc = (fp8_kv.quantize(c, s) for c, s in zip(p.caches(), SCALES))
    return fp8_kv.layer_caches(kc, vc, *SCALES)


def _reference_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, alibi):
    return reference_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window=window,
                               softcap=softcap, sinks=sinks, alibi=alibi)


def folded_scales(p: Problem) -> float:
    """registry.paged_attention over the fp8 cache, window and soft-cap on."""
    meta = TritonBackend().build(p.layout)
    got = paged_attention(p.q, p.k, p.v, *_fp8_caches(p), meta, p.scale, window=6, softcap=3.0)
    ref = fp8_kv.attend(_reference_forward, p.q, p.k, p.v, *_fp8_caches(p), meta, p.scale, 6,
                        3.0, None, None)
    return max_err(got, ref)


def in_kernel_scales(p: Problem) -> float:
    """The decode and prefill kernels reading the fp8 cache with k_scale / v_scale themselves."""
    lay = p.layout
    kc, vc = _fp8_caches(p)
    ks, vs = SCALES
    store_rows(kc, lay.slot_mapping, fp8_kv.quantize(p.k, ks))
    store_rows(vc, lay.slot_mapping, fp8_kv.quantize(p.v, vs))
    kd, vd = kc.float() * ks, vc.float() * vs  # the values the kernels must see
    ref = reference_attention(p.q, kd[lay.slot_mapping], vd[lay.slot_mapping], kd, vd,
                              TritonBackend().build(lay), p.scale)
    b = lay.num_decode
    out = torch.empty_like(p.q)
    out[:b] = paged_decode_attention(p.q[:b], kc, vc, lay.block_tables[:b].contiguous(),
                                     lay.context_lens[:b], lay.block_size, p.scale, k_scale=ks,
                                     v_scale=vs)
    paged_prefill_attention(p.q, kc, vc, out, lay.block_tables, lay.query_start,
                            lay.context_lens, range(b, len(lay.counts)), max(lay.counts[b:]),
                            lay.block_size, p.scale, k_scale=ks, v_scale=vs)
    return max_err(out, ref)


def check_fp8(device: torch.device) -> tuple[float, float]:
    p = make_problem(device, **MIXED)  # type: ignore[arg-type]
    return max(folded_scales(p), in_kernel_scales(p)), TOL


CHECKS: dict[str, Callable[[torch.device], tuple[float, float]]] = {"fp8": check_fp8}
