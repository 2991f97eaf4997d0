"""The Triton attention kernels (batchrun/engine/kernels/triton_*.py) through TritonBackend's
build and forward, against reference_attention on the same paged step: small random shapes
(4 query heads over 2 KV heads, head_dim 16, 4-token blocks), float32."""

from __future__ import annotations

from typing import Callable

import torch

from batchrun.engine.attention.cuda_triton import TritonBackend
from batchrun.engine.attention.registry import paged_attention
from benchmarks.kernel_checks.attention_problems import Problem, make_problem, max_err

TOL = 1e-4  # float32 throughout: the kernels and the reference differ by summation order only
MIXED = dict(starts=[9, 3, 30, 70, 0, 11], counts=[1, 1, 1, 5, 7, 9], num_decode=3)
WINDOW = 5


def _backend(p: Problem, splits: int | None = None, **extras) -> torch.Tensor:
    meta = TritonBackend().build(p.layout)
    meta.decode_splits = splits
    meta.visible_until = extras.pop("visible_until", None)
    kc, vc = p.caches()
    return TritonBackend.forward(p.q, p.k, p.v, kc, vc, meta, p.scale, **extras)


def _both_decodes(p: Problem, **extras) -> float:
    """The largest error of the step with its decodes through the plain and the split-K kernel."""
    ref = p.reference(**{"sliding_window" if k == "window" else k: x for k, x in extras.items()})
    return max(max_err(_backend(p, splits, **extras), ref) for splits in (1, 3))


def check_prefill(device: torch.device) -> tuple[float, float]:
    """Fresh chunks of different lengths (no cached prefix), causal within each."""
    p = make_problem(device, starts=[0, 0, 0], counts=[7, 19, 2], num_decode=0)
    # GQA groups of 3 and a head_dim of 24: padded to powers of two in the kernels, masked
    odd = make_problem(device, starts=[0, 0], counts=[5, 18], num_decode=0, heads=6, dim=24)
    # a chunk long enough for 128-row query tiles, beside a short one
    long = make_problem(device, starts=[0, 10], counts=[3, 140], num_decode=0)
    return max(max_err(_backend(x), x.reference()) for x in (p, odd, long)), TOL


def check_prefix(device: torch.device) -> tuple[float, float]:
    """Chunks over cached prefixes (prefix-cache hits, chunked prefill) beside decodes."""
    p = make_problem(device, **MIXED)  # type: ignore[arg-type]
    return max_err(_backend(p, 1), p.reference()), TOL


def check_decode(device: torch.device) -> tuple[float, float]:
    p = make_problem(device, starts=[9, 0, 22, 4], counts=[1] * 4, num_decode=4)
    odd = make_problem(device, starts=[9, 40], counts=[1, 1], num_decode=2, heads=6, dim=24)
    return max(max_err(_backend(p, 1), p.reference()),
               max_err(_backend(odd, 1), odd.reference())), TOL


def check_decode_splitk(device: torch.device) -> tuple[float, float]:
    """Long contexts in 3 and 4 shares (shares that get no keys included)."""
    p = make_problem(device, starts=[70, 5, 130], counts=[1] * 3, num_decode=3)
    ref = p.reference()
    return max(max_err(_backend(p, s), ref) for s in (3, 4)), TOL


def check_decode_cascade(device: torch.device) -> tuple[float, float]:
    """Decodes in two groups sharing leading blocks (3 and 2 blocks) and one alone, the rest of
    each context plain or in split-K shares; soft-capped and with sinks too."""
    p = make_problem(device, starts=[21, 30, 14, 17, 40, 9], counts=[1] * 6, num_decode=6,
                     shared={1: 0, 2: 0, 4: 3})
    meta = TritonBackend().build(p.layout)
    assert meta.shared is not None and meta.shared.tile_first.shape[0] == 2  # two groups
    sinks = torch.linspace(-1, 1, p.q.shape[1]).to(device)
    many = make_problem(device, starts=[13 + 2 * i for i in range(10)], counts=[1] * 10,
                        num_decode=10, shared={i: 0 for i in range(1, 10)})  # two tiles
    return max(_both_decodes(p), _both_decodes(p, softcap=2.0, sinks=sinks),
               max_err(_backend(many, 1), many.reference())), TOL


def _half(dtype: torch.dtype, tol: float) -> Callable[[torch.device], tuple[float, float]]:
    def check(device: torch.device) -> tuple[float, float]:
        """The mixed step (fresh and prefix chunks, plain and split-K decodes) in `dtype`
        against the reference in float32 rounded to it: tol is a couple of its ulps at |out| ~ 1
        (softmax weights enter the value dot in `dtype`, as flash attention's do)."""
        p = make_problem(device, **MIXED, dtype=dtype)  # type: ignore[arg-type]
        return _both_decodes(p), tol
    return check


def check_alibi(device: torch.device) -> tuple[float, float]:
    """ALiBi slopes (BLOOM's, 2^(-8h/H)) through registry.paged_attention, which hands them to
    this backend: the mixed step with plain and split-K decodes, and shared-prefix decodes."""
    slopes = (2.0 ** (-8.0 * torch.arange(1, 5) / 4)).to(device)
    errs = []
    for p in (make_problem(device, **MIXED),  # type: ignore[arg-type]
              make_problem(device, starts=[21, 30, 14, 9], counts=[1] * 4, num_decode=4,
                           shared={1: 0, 2: 0})):
        ref = p.reference(alibi=slopes)
        for splits in (1, 3):
            meta = TritonBackend().build(p.layout)
            meta.decode_splits = splits
            got = paged_attention(p.q, p.k, p.v, *p.caches(), meta, p.scale, alibi=slopes)
            errs.append(max_err(got, ref))
    return max(errs), TOL


def check_window(device: torch.device) -> tuple[float, float]:
    p = make_problem(device, **MIXED)  # type: ignore[arg-type]
    return _both_decodes(p, window=WINDOW), TOL


def check_softcap(device: torch.device) -> tuple[float, float]:
    p = make_problem(device, **MIXED)  # type: ignore[arg-type]
    return _both_decodes(p, softcap=1.5), TOL


def check_sink(device: torch.device) -> tuple[float, float]:
    p = make_problem(device, **MIXED)  # type: ignore[arg-type]
    sinks = torch.randn(p.q.shape[1], generator=torch.Generator().manual_seed(1)).to(device)
    return _both_decodes(p, sinks=sinks * 2), TOL


def check_bidirectional(device: torch.device) -> tuple[float, float]:
    """An image's rows (positions 5..10 of a 12-row chunk over 3 cached tokens) see each other
    both ways (visible_until, Gemma 3), with and without a window."""
    p = make_problem(device, starts=[4, 3], counts=[1, 12], num_decode=1)
    until = torch.zeros(13, dtype=torch.long)
    until[1 + 2:1 + 8] = 11  # rows at positions 5..10
    until = until.to(device)
    errs = [max_err(_backend(p, visible_until=until, **extras),
                    p.reference(visible_until=until, **ref))
            for extras, ref in (({}, {}), ({"window": 3}, {"sliding_window": 3}))]
    return max(errs), TOL


CHECKS: dict[str, Callable[[torch.device], tuple[float, float]]] = {
    "prefill": check_prefill, "prefix": check_prefix, "decode": check_decode,
    "decode_splitk": check_decode_splitk, "decode_cascade": check_decode_cascade,
    "window": check_window, "softcap": check_softcap,
    "sink": check_sink, "bidirectional": check_bidirectional, "alibi": check_alibi,
    "bf16": _half(torch.bfloat16, 3e-2), "fp16": _half(torch.float16, 4e-3),
}
