"""One layer of decode attention over shared prefixes: the per-sequence kernel against cascade
groups, for each vector path (this CPU's, -mno-avx512f AVX2+FMA, portable), one thread, best of 8.

    python benchmarks/cascade_attention.py [--prefixes 20] [--per-prefix 8] [--shared 1600]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from batchrun.engine import kernels  # noqa: E402
from batchrun.engine.attention import cascade  # noqa: E402
from batchrun.engine.attention.cpu_kernel import kernel_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--per-prefix", type=int, default=8)
    ap.add_argument("--shared", type=int, default=1600, help="prefix tokens (whole blocks)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    H, Hkv, D, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    nshared = args.shared // bs
    tables, lens, used = [], [], 0
    for _ in range(args.prefixes):
        prefix = list(range(used, used + nshared))
        used += nshared
        for _ in range(args.per_prefix):
            tail = int(torch.randint(1, 100, (1,), generator=g))
            own = -(-tail // bs)
            tables.append(prefix + list(range(used, used + own)))
            used += own
            lens.append(nshared * bs + tail)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    k, v = (torch.randn(used * bs, Hkv, D, generator=g) for _ in range(2))
    q = torch.randn(len(lens), H, D, generator=g)
    lens_t = torch.tensor(lens)
    for name, flags in kernels.VARIANTS.items():
        lib = kernels.library(flags)
        rows, _ = cascade.plan_rows(lib, table, [n - 1 for n in lens], [1] * len(lens), len(lens), bs)

        def plain():
            lib.paged_decode_attention(q, k, v, table, lens_t, bs, D ** -0.5)

        def grouped():
            kernel_attention(lib, q, k, v, rows, bs, D ** -0.5)

        best = {}
        for _ in range(8):
            for fn in (plain, grouped):
                t = time.perf_counter()
                fn()
                best[fn.__name__] = min(best.get(fn.__name__, 1e9), time.perf_counter() - t)
        print(f"{name:9} ({kernels.SIMD_PATHS[lib.simd_path()]}): per-sequence "
              f"{best['plain'] * 1e3:.1f} ms, cascade {best['grouped'] * 1e3:.1f} ms "
              f"({best['plain'] / best['grouped']:.2f}x)")


if __name__ == "__main__":
    main()
