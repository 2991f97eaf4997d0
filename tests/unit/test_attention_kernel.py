"""The in-place CPU decode-attention kernel against the PyTorch gather + SDPA path."""

import subprocess
import sys

import pytest
import torch

from batchrun.engine.attention import fp8_kv, int8_kv, paged_attention
from batchrun.engine.attention.cpu_kernel import CpuKernelMetadata
from batchrun.engine.attention.sdpa import SdpaMetadata
from tests.helpers import kernel_library

pytestmark = pytest.mark.skipif(kernel_library() is None, reason="no C compiler here")


def paged_problem(kv_dtype, B=7, H=6, Hkv=2, D=32, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 60, (B,), generator=g)
    per_seq = (lens + bs - 1) // bs
    nblocks = int(per_seq.sum()) + 3
    order = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(B, int(per_seq.max()), dtype=torch.long)
    used = 0
    for b in range(B):
        tables[b, :per_seq[b]] = order[used:used + per_seq[b]]
        used += int(per_seq[b])
    k_cache = torch.randn(nblocks * bs, Hkv, D, generator=g).to(kv_dtype)
    v_cache = torch.randn(nblocks * bs, Hkv, D, generator=g).to(kv_dtype)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(B, Hkv, D, generator=g)
    v = torch.randn(B, Hkv, D, generator=g)
    pos = lens - 1
    slot_mapping = tables[torch.arange(B), pos // bs] * bs + pos % bs
    grid = torch.arange(int(lens.max()))[None]
    valid = grid < lens[:, None]
    slots = (tables.gather(1, (grid // bs).expand(B, -1)) * bs + grid % bs).masked_fill(~valid, 0)
    bias = torch.zeros(valid.shape).masked_fill(~valid, float("-inf"))[:, None, None, :]
    layout = dict(slot_mapping=slot_mapping, block_size=bs, block_tables=tables,
                  query_start=torch.arange(B + 1), context_lens=lens, positions=pos)
    reference = SdpaMetadata(**layout, num_decode=B, decode_slots=slots, decode_bias=bias)
    kernel = CpuKernelMetadata(**layout, num_decode=B, decode_tables=tables,
                               decode_lens=lens.clone(), lib=kernel_library())
    return q, k, v, k_cache, v_cache, reference, kernel


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2,
             torch.float8_e4m3fn: 1e-5, torch.int8: 1e-5}  # both read the same values, scales


# The AVX-512 path is compiled for (query heads per KV head, head_dim) in {1..8} x {64, 128};
# head_dim 32 and (16, 48) take the portable path.
@pytest.mark.parametrize("kv_dtype", list(TOLERANCE))
@pytest.mark.parametrize("H,Hkv,D,bs", [(6, 2, 32, 4), (9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 64, 8), (16, 1, 48, 4)])
def test_kernel_matches_gather_sdpa(kv_dtype, H, Hkv, D, bs):
    q, k, v, kc, vc, reference, kernel = paged_problem(kv_dtype, H=H, Hkv=Hkv, D=D, bs=bs)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    if kv_dtype == torch.float8_e4m3fn:  # a layer's scales (attention/fp8_kv.py)
        kc, vc = fp8_kv.layer_caches(kc, vc, 0.5, 3.0)
        kc_ref, vc_ref = fp8_kv.layer_caches(kc_ref, vc_ref, 0.5, 3.0)
    if kv_dtype == torch.int8:  # a scale per (slot, KV head) beside the pool (int8_kv.py)
        scales = [torch.rand(kc.shape[:2]) + 0.01 for _ in range(2)]
        kc, vc = int8_kv.layer_caches(kc, vc, *scales)
        kc_ref, vc_ref = int8_kv.layer_caches(kc_ref, vc_ref, *(s.clone() for s in scales))
    expected = paged_attention(q, k, v, kc_ref, vc_ref, reference, D ** -0.5)
    got = paged_attention(q, k, v, kc, vc, kernel, D ** -0.5)
    tol = TOLERANCE[kv_dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # the step's own K/V went into the cache exactly as index_copy_ puts them (bytes: fp8 has
    # no torch.equal)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((kc, kc_ref), (vc, vc_ref)))
    if kv_dtype == torch.int8:
        assert torch.equal(kc.row_scales, kc_ref.row_scales)


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone():
    # A library built with -ffast-math by GCC < 13 switches on flush-to-zero for the process.
    code = ("from batchrun.engine import kernels; "
            "assert kernels.library(kernels.shape_flags(9, 3, 64)) is not None; "
            "import sys; sys.exit(0 if 5e-324 > 0 else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr or "denormals flushed to zero"
