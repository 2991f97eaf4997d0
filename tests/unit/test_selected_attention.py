"""Attention to selected keys (engine/attention/selected.py) against float64 attention over the
same keys, and the indexer keys' place beside V in the cache (models/transformers/indexed.py)."""

import pytest
import torch

from batchrun.engine.attention import selected
from batchrun.engine.attention.selected import selected_attention
from batchrun.models.transformers.indexed import gathered, spread, widened
from tests.unit.test_transformers_backend import _paged_layout


@pytest.mark.parametrize("slice_elements", [1 << 24, 64])  # all rows at once; a few at a time
def test_selected_attention_matches_float64_over_the_chosen_keys(slice_elements, monkeypatch):
    monkeypatch.setattr(selected, "SLICE_ELEMENTS", slice_elements)
    gen = torch.Generator().manual_seed(3)
    h, hkv, d, bs, top = 4, 2, 8, 4, 5
    ctx, q_lens = [9, 1, 14, 6, 3], [1, 1, 6, 6, 2]  # decodes, a chunk over context, fresh prompts
    tables, meta = _paged_layout(ctx, q_lens, bs, 32, gen)
    pool = (32 * bs, hkv, d)
    k_cache = torch.randn(pool, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(pool, generator=gen, dtype=torch.float64)
    t = sum(q_lens)
    q = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    keys = torch.full((t, top), -1)
    row = 0
    for c, n in zip(ctx, q_lens):
        for i in range(n):
            p = c - n + i  # up to `top` of the positions <= p, in any order, -1 after them
            chosen = torch.randperm(p + 1, generator=gen)[:top]
            keys[row + i, :len(chosen)] = chosen
        row += n
    out = selected_attention(q, k, v, k_cache, v_cache, meta, 0.3, keys)
    row = 0
    for s, (c, n) in enumerate(zip(ctx, q_lens)):
        for i in range(n):
            kpos = keys[row + i][keys[row + i] >= 0]
            kslots = tables[s, kpos // bs] * bs + kpos % bs
            ks, vs = (cache[kslots].repeat_interleave(h // hkv, 1) for cache in (k_cache, v_cache))
            probs = torch.softmax(torch.einsum("hd,lhd->hl", q[row + i], ks) * 0.3, -1)
            expected = torch.einsum("hl,lhd->hd", probs, vs)
            torch.testing.assert_close(out[row + i], expected, rtol=1e-10, atol=1e-10)
        row += n


@pytest.mark.parametrize("heads,dk,dv,dim,width", [
    (4, 32, 24, 32, 32),  # room beside V: 4 heads x 8 columns
    (4, 32, 32, 32, 40),  # none: widened by 32 / 4 columns a head
    (3, 16, 16, 10, 20)])  # 10 over 3 heads: 4 columns each, the last head's partly used
def test_indexer_keys_round_trip_beside_v(heads, dk, dv, dim, width):
    assert widened(heads, dk, dv, dim) == width
    gen = torch.Generator().manual_seed(1)
    v = torch.nn.functional.pad(torch.randn(6, heads, dv, generator=gen), (0, width - dv))
    keys = torch.randn(6, dim, generator=gen)
    rows = spread(v, keys, dv)
    assert torch.equal(rows[..., :dv], v[..., :dv])  # V as it was
    cache = torch.zeros(16, heads, width)
    slots = torch.tensor([7, 0, 3, 12, 5, 9])
    cache[slots] = rows
    assert torch.equal(gathered(cache, slots[[2, 0]], dv, dim), keys[[2, 0]])
