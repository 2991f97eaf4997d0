"""The paged attention kernel's rows and groups (cascade decode over shared prefix blocks,
prefill chunks over a cached context) against attention computed from gathered KV, on every
vector path of simd.h: this CPU's own, AVX2+FMA (-mno-avx512f) and portable C."""

import pytest
import torch
import torch.nn.functional as F

from batchrun.engine import kernels
from batchrun.engine.attention import cascade, int8_kv
from batchrun.engine.attention.kv_write import read_rows
from batchrun.engine.attention.cpu_kernel import kernel_attention
from tests.helpers import cpu_has, kernel_library

pytestmark = pytest.mark.skipif(kernel_library() is None, reason="no C compiler here")
PATHS = {"avx512": 2, "avx2": 1, "portable": 0}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-5,
             torch.float8_e4m3fn: 2e-5, torch.int8: 2e-5}  # the reference reads the same values
# A bfloat16 pool's tiles by VDPBF16PS (AVX512-BF16 builds): the softmax weights are rounded to
# bfloat16 for the values, within 2^-8 of the largest |v| (the test's values are N(0, 1)).
BF16_PRODUCTS = 5e-3


def tolerance(lib, kv_dtype):
    return BF16_PRODUCTS if kv_dtype == torch.bfloat16 and lib.bf16_products() else \
        TOLERANCE[kv_dtype]


def variants():
    """(id, kernels.VARIANTS key, extra flags) of the builds the kernel is tested on."""
    out = [("native", "native", ())]
    if cpu_has("avx512_bf16"):  # AVX-512 without its bfloat16 products
        out.append(("avx512-no-bf16", "native", ("-mno-avx512bf16",)))
    if cpu_has("avx2") and cpu_has("fma"):
        out.append(("avx2", "avx2", ()))
    out.append(("portable", "portable", ()))
    return out


@pytest.fixture(params=variants(), ids=lambda v: v[0])
def lib(request):
    name, variant, flags = request.param
    lib = kernel_library(variant, *flags)
    assert lib is not None
    if name != "native":
        assert kernels.SIMD_PATHS[lib.simd_path()] == name.split("-")[0], "the variant took another path"
        assert not lib.bf16_products()
    return lib


def test_native_build_takes_this_cpus_best_path():
    path = kernels.SIMD_PATHS[kernel_library().simd_path()]
    expected = "avx512" if cpu_has("avx512f") else "avx2" if cpu_has("avx2") and cpu_has("fma") \
        else "portable"
    assert path == expected


def test_batchrun_simd_caps_every_library(monkeypatch):
    monkeypatch.setenv("BATCHRUN_SIMD", "portable")
    assert kernels.SIMD_PATHS[kernel_library().simd_path()] == "portable"
    assert kernels.SIMD_PATHS[kernels.library(("-DNO_SPECIALISED",)).simd_path()] == "portable"
    monkeypatch.setenv("BATCHRUN_SIMD", "avx3")
    with pytest.raises(ValueError, match="BATCHRUN_SIMD='avx3'"):
        kernels.library()


class Pool:
    """A KV pool handing out shuffled physical blocks."""

    def __init__(self, nblocks, bs, Hkv, D, dtype, g):
        self.free = torch.randperm(nblocks, generator=g).tolist()
        self.bs = bs
        k, v = (torch.randn(nblocks * bs, Hkv, D, generator=g) for _ in range(2))
        if dtype == torch.int8:  # a scale per (slot, KV head) beside the pool: int8_kv.py
            (k, ks), (v, vs) = int8_kv.quantize_rows(k), int8_kv.quantize_rows(v)
            self.k, self.v = int8_kv.layer_caches(k, v, ks, vs)
        else:
            self.k, self.v = k.to(dtype), v.to(dtype)

    def take(self, n):
        out, self.free = self.free[:n], self.free[n:]
        return out


def tables_tensor(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def reference(q, pool, tables, lens, scale, sinks=None, window=None):
    """Attention of row r (q[r], [H, D]) over positions [0, lens[r]) of tables[r] (the last
    `window` of them), float64; sinks [H]: a logit per head in the softmax's denominator only.
    An int8 pool's kernel scores the query rounded to int8 per (row, head) (int8_kv.py), a
    bfloat16 pool's the query rounded to bfloat16."""
    H, Hkv = q.shape[1], pool.k.shape[1]
    if pool.k.dtype == torch.int8:
        q = int8_kv.dequantize(*int8_kv.quantize_rows(q), torch.float32)
    if pool.k.dtype == torch.bfloat16:
        q = q.to(torch.bfloat16).float()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, (t, n) in enumerate(zip(tables, lens)):
        if n == 0:
            continue
        pos = torch.arange(0 if window is None else max(0, n - window), n)
        slots = torch.tensor(t)[pos // pool.bs] * pool.bs + pos % pool.bs
        k = read_rows(pool.k, slots, torch.float64).repeat_interleave(H // Hkv, 1).transpose(0, 1)
        v = read_rows(pool.v, slots, torch.float64).repeat_interleave(H // Hkv, 1).transpose(0, 1)
        if sinks is None:
            out[r] = F.scaled_dot_product_attention(q[r].double()[:, None], k, v, scale=scale)[:, 0]
            continue
        scores = torch.einsum("hd,hld->hl", q[r].double(), k) * scale
        weights = torch.softmax(torch.cat([scores, sinks.double()[:, None]], -1), -1)[:, :-1]
        out[r] = torch.einsum("hl,hld->hd", weights, v)
    return out.float()


def shared_prefix_batch(g, pool, bs, prefixes, per_prefix, loners):
    """Block tables of sequences in `prefixes` groups sharing 1-6 leading physical blocks (a
    group's sequences then own their tails, of random lengths that end mid-block or on a block
    boundary), plus sequences sharing nothing. Shuffled, so groups are not contiguous."""
    tables, lens = [], []
    for _ in range(prefixes):
        nshared = int(torch.randint(1, 7, (1,), generator=g))
        prefix = pool.take(nshared)
        for _ in range(per_prefix):
            tail = int(torch.randint(1, 3 * bs, (1,), generator=g))
            tables.append(prefix + pool.take(-(-tail // bs)))
            lens.append(nshared * bs + tail)
    for _ in range(loners):
        n = int(torch.randint(1, 5 * bs, (1,), generator=g))
        tables.append(pool.take(-(-n // bs)))
        lens.append(n)
    perm = torch.randperm(len(tables), generator=g).tolist()
    return [tables[i] for i in perm], [lens[i] for i in perm]


@pytest.mark.parametrize("kv_dtype", list(TOLERANCE))
@pytest.mark.parametrize("H,Hkv,D,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8),
                                        (6, 1, 32, 4), (12, 4, 48, 16), (9, 3, 64, 6)])
def test_cascade_decode_matches_reference(lib, kv_dtype, H, Hkv, D, bs):
    g = torch.Generator().manual_seed(H * 100 + D)
    pool = Pool(600, bs, Hkv, D, kv_dtype, g)
    tables, lens = shared_prefix_batch(g, pool, bs, prefixes=4, per_prefix=5, loners=6)
    table = tables_tensor(tables)
    rows, _ = cascade.plan_rows(lib, table, [n - 1 for n in lens], [1] * len(lens), len(lens), bs)
    assert rows is not None and int(rows.group_shared.max()) > 0, "no group found"
    q = torch.randn(len(lens), H, D, generator=g)
    got = kernel_attention(lib, q, pool.k, pool.v, rows, bs, D ** -0.5)
    tol = tolerance(lib, kv_dtype)
    torch.testing.assert_close(got, reference(q, pool, tables, lens, D ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("H,Hkv,D,bs", [(9, 3, 64, 16), (12, 4, 48, 16)])
def test_a_build_for_one_models_shape_matches_the_reference(H, Hkv, D, bs):
    """What the engine loads: the kernel specialised for its model's shape only (9/3 heads of
    64: SmolLM2's), or none (head_dim 48: the generic loop)."""
    flags = kernels.shape_flags(H, Hkv, D)
    assert flags == (("-DONLY_G=3", "-DONLY_D=64") if D == 64 else ("-DNO_SPECIALISED",))
    lib = kernels.library(flags)
    assert lib is not None and lib is not kernel_library()
    g = torch.Generator().manual_seed(7)
    pool = Pool(600, bs, Hkv, D, torch.float32, g)
    tables, lens = shared_prefix_batch(g, pool, bs, prefixes=3, per_prefix=4, loners=4)
    rows, _ = cascade.plan_rows(lib, tables_tensor(tables), [n - 1 for n in lens],
                                [1] * len(lens), len(lens), bs)
    q = torch.randn(len(lens), H, D, generator=g)
    got = kernel_attention(lib, q, pool.k, pool.v, rows, bs, D ** -0.5)
    torch.testing.assert_close(got, reference(q, pool, tables, lens, D ** -0.5), atol=2e-5,
                               rtol=2e-5)


def test_groups_share_only_whole_equal_blocks():
    lib, bs = kernel_library(), 4
    g = torch.Generator().manual_seed(1)
    pool = Pool(400, bs, 1, 16, torch.float32, g)
    tables, lens = shared_prefix_batch(g, pool, bs, prefixes=5, per_prefix=4, loners=5)
    # One more sequence sharing only the first block of some group: it must not drag that
    # group's shared run down to one block.
    tables.append(tables[0][:1] + pool.take(3))
    lens.append(4 * bs)
    order, start, shared = cascade.decode_groups(lib, tables_tensor(tables), torch.tensor(lens), bs)
    assert sorted(order.tolist()) == list(range(len(lens)))
    seen_long = False
    for gi in range(len(shared)):
        members = order[start[gi]:start[gi + 1]].tolist()
        s = int(shared[gi])
        assert len(members) <= cascade.TILE
        if len(members) == 1:
            assert s == 0
            continue
        assert s >= 1
        for m in members:
            assert s <= lens[m] // bs  # whole blocks inside every member's context
            assert tables[m][:s] == tables[members[0]][:s]
        seen_long |= s > 1
    assert len(shared) < len(lens) and seen_long


def test_large_groups_are_cut_at_the_kernels_limit():
    lib, bs = kernel_library(), 16
    g = torch.Generator().manual_seed(2)
    pool = Pool(200, bs, 3, 64, torch.float32, g)
    tables, lens = shared_prefix_batch(g, pool, bs, prefixes=1, per_prefix=40, loners=0)
    order, start, shared = cascade.decode_groups(lib, tables_tensor(tables), torch.tensor(lens), bs)
    sizes = (start[1:] - start[:-1]).tolist()
    assert max(sizes) == cascade.TILE and sum(sizes) == 40 and (shared > 0).all()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("H,Hkv,D,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 2, 32, 8)])
def test_prefill_chunks_over_cached_context_match_sdpa(lib, kv_dtype, H, Hkv, D, bs):
    """A step of decodes, a chunk with no cached context (left to SDPA) and chunks over cached
    contexts of various lengths (ending mid-block and on a boundary), through plan_rows."""
    g = torch.Generator().manual_seed(D + bs)
    pool = Pool(800, bs, Hkv, D, kv_dtype, g)
    dec_tables, dec_lens = shared_prefix_batch(g, pool, bs, prefixes=2, per_prefix=3, loners=2)
    chunks = [(0, 20), (37, 50), (3 * bs, 2 * bs), (150, 1), (5, 33)]  # (cached, new tokens)
    tables = list(dec_tables)
    for c, n in chunks:
        tables.append(pool.take(-(-(c + n) // bs)))
    starts = [n - 1 for n in dec_lens] + [c for c, _ in chunks]
    counts = [1] * len(dec_lens) + [n for _, n in chunks]
    rows, in_kernel = cascade.plan_rows(lib, tables_tensor(tables), starts, counts,
                                        len(dec_lens), bs)
    assert in_kernel == [c > 0 for c, _ in chunks]
    q = torch.randn(sum(counts), H, D, generator=g)
    got = kernel_attention(lib, q, pool.k, pool.v, rows, bs, D ** -0.5)
    row_tables, row_lens = [], []
    for i, (c, n) in enumerate(zip(starts, counts)):
        row_tables += [tables[i]] * n
        row_lens += [c + j + 1 for j in range(n)]
    expected = reference(q, pool, row_tables, row_lens, D ** -0.5)
    kernel_rows = torch.tensor([int(r) for r in rows.order])
    tol = tolerance(lib, kv_dtype)
    torch.testing.assert_close(got[kernel_rows], expected[kernel_rows], atol=tol, rtol=tol)
    assert len(kernel_rows) == sum(counts) - 20  # every row but the uncached chunk's


def test_nothing_shared_and_no_cached_chunk_keeps_the_plain_kernel():
    lib, bs = kernel_library(), 4
    g = torch.Generator().manual_seed(3)
    pool = Pool(100, bs, 1, 16, torch.float32, g)
    tables, lens = shared_prefix_batch(g, pool, bs, prefixes=0, per_prefix=0, loners=6)
    tables.append(pool.take(3))
    rows, in_kernel = cascade.plan_rows(lib, tables_tensor(tables), [n - 1 for n in lens] + [0],
                                        [1] * len(lens) + [10], len(lens), bs)
    assert rows is None and in_kernel == [False]


@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("H,Hkv,D,bs", [(8, 2, 64, 16), (6, 3, 32, 4)])
def test_attention_sinks_join_the_softmax_denominator(lib, H, Hkv, D, bs, window):
    """GPT-OSS's sinks (a logit per query head, some far above the scores, some far below) on
    cascade decode groups sharing prefix blocks and on chunks over a cached context, with and
    without a sliding window, against float64."""
    g = torch.Generator().manual_seed(H + D)
    pool = Pool(800, bs, Hkv, D, torch.float32, g)
    dec_tables, dec_lens = shared_prefix_batch(g, pool, bs, prefixes=2, per_prefix=3, loners=2)
    chunks = [(37, 9), (3 * bs, 2 * bs)]
    tables = dec_tables + [pool.take(-(-(c + n) // bs)) for c, n in chunks]
    starts = [n - 1 for n in dec_lens] + [c for c, _ in chunks]
    counts = [1] * len(dec_lens) + [n for _, n in chunks]
    rows, _ = cascade.plan_rows(lib, tables_tensor(tables), starts, counts, len(dec_lens), bs)
    assert int(rows.group_shared.max()) > 0, "no group found"
    q = torch.randn(sum(counts), H, D, generator=g)
    sinks = torch.linspace(-30.0, 30.0, H)  # beyond and below every score
    row_tables, row_lens = [], []
    for i, (c, n) in enumerate(zip(starts, counts)):
        row_tables += [tables[i]] * n
        row_lens += [c + j + 1 for j in range(n)]
    got = kernel_attention(lib, q, pool.k, pool.v, rows, bs, D ** -0.5, window=window,
                           sinks=sinks)
    expected = reference(q, pool, row_tables, row_lens, D ** -0.5, sinks, window)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    without = reference(q, pool, row_tables, row_lens, D ** -0.5, None, window)
    assert not torch.allclose(got, without, atol=1e-2)  # the sinks changed the output
