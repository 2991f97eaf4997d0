"""Decode attention over the paged KV cache, one layer, at batch-run shapes: kernel vs PyTorch,
for each KV cache dtype (float32, float16, bfloat16, fp8 e4m3, int8 with row scales).

Prints milliseconds per call and the KV bytes read per second, next to a plain memory read
(torch sum) as the machine's ceiling. Run: python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from batchrun.engine import kernels
from batchrun.engine.attention.int8_kv import INT8, layer_caches, quantize_rows, round_trip
from batchrun.engine.attention.kv_write import read_rows


def pool(slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """A layer's random K and V pools in `dtype` (int8: quantized rows with their scales)."""
    k, v = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
    if dtype != INT8:
        return k.to(dtype), v.to(dtype)
    (kq, ks), (vq, vs) = quantize_rows(k), quantize_rows(v)
    return layer_caches(kq, vq, ks, vs)


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=150)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8, help="distinct KV pools, so reads miss the cache")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    B, H, Hkv, D, bs = args.seqs, args.heads, args.kv_heads, args.head_dim, args.block_size
    lens = torch.randint(args.ctx // 2, args.ctx * 3 // 2, (B,), dtype=torch.long)
    blocks_per = (lens + bs - 1) // bs
    width = int(blocks_per.max())
    perm = torch.randperm(int(blocks_per.sum()))  # scattered blocks, as after a while in the pool
    tables = torch.zeros(B, width, dtype=torch.long)
    at = 0
    for b in range(B):
        n = int(blocks_per[b])
        tables[b, :n] = perm[at:at + n]
        at += n
    slots = at * bs
    q = torch.randn(B, H, D)
    scale = D ** -0.5
    lib = kernels.library()
    kv_bytes = {}
    rows = []
    order = torch.arange(B + 1, dtype=torch.int32)
    # every sequence a group of its own (no shared prefix)
    groups = SimpleNamespace(tables=tables, row_table=torch.arange(B), row_len=lens, groups=B,
                             order=order, group_start=order, group_shared=torch.zeros(B, dtype=torch.int32))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        pools = [pool(slots, Hkv, D, dtype) for _ in range(args.layers)]
        layer = [0]

        def kernel():
            k, v = pools[layer[0] % args.layers]
            layer[0] += 1
            ks, vs = (getattr(c, "row_scales", None) for c in (k, v))
            return lib.paged_attention(q, k, v, groups, bs, scale, k_scales=ks, v_scales=vs)

        grid = torch.arange(int(lens.max()))[None, :]
        valid = grid < lens[:, None]
        gslots = (tables.gather(1, (grid // bs).expand(B, -1)) * bs + grid % bs).masked_fill(~valid, 0)
        bias = torch.zeros(valid.shape).masked_fill(~valid, float("-inf"))[:, None, None, :]

        def torch_sdpa():
            k, v = pools[layer[0] % args.layers]
            layer[0] += 1
            kd = read_rows(k, gslots, torch.float32).transpose(1, 2)
            vd = read_rows(v, gslots, torch.float32).transpose(1, 2)
            F.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, D), kd, vd, attn_mask=bias,
                                           scale=scale)

        read = int(lens.sum()) * Hkv * D * 2 * dtype.itemsize
        kv_bytes[dtype] = read
        # reference check: kernel against SDPA on the first pool
        k, v = pools[0]
        layer[0] = 0
        out = kernel()
        kd = read_rows(k, gslots, torch.float32).transpose(1, 2)
        vd = read_rows(v, gslots, torch.float32).transpose(1, 2)
        qr = round_trip(q) if dtype == INT8 else q  # an int8 cache scores a rounded query
        ref = F.scaled_dot_product_attention(qr.view(B, Hkv, H // Hkv, D), kd, vd, attn_mask=bias,
                                             scale=scale).reshape(B, H, D)
        err = (out - ref).abs().max().item()
        for name, fn in (("kernel", kernel), ("torch gather+sdpa", torch_sdpa)):
            sec = timed(fn, args.repeat)
            rows.append((f"{name} {str(dtype)[6:]}", sec * 1e3, read / sec / 1e9, err if name == "kernel" else 0.0))
    big = torch.randn(64 * 1024 * 1024)
    sec = timed(lambda: big.sum(), args.repeat)
    print(f"{B} seqs, mean context {lens.float().mean():.0f}, {H} heads / {Hkv} kv heads x {D}, "
          f"{torch.get_num_threads()} threads; KV read per layer {kv_bytes[torch.float32] / 1e6:.1f} MB fp32")
    print(f"{'path':28} {'ms/layer':>9} {'GB/s':>7} {'max err':>9}")
    for name, ms, gbs, err in rows:
        print(f"{name:28} {ms:9.2f} {gbs:7.1f} {err:9.1e}")
    print(f"{'memory read (torch sum)':28} {sec * 1e3:9.2f} {big.numel() * 4 / sec / 1e9:7.1f}")


if __name__ == "__main__":
    main()
