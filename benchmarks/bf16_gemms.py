"""bfloat16 linears: oneDNN's packed GEMM (PackedLinear, bfloat16 output) against batchrun's own
(engine/kernels/bf16_gemm.c through Bf16GemmLinear: AMX-BF16 tiles where the CPU has them, else
VDPBF16PS or widened FMAs), over a decode step's worth of SmolLM2-135M's layers (--layers copies
of its four per-layer shapes, so the weights stream from memory as in a run), per row count.

    PYTHONPATH=. python benchmarks/bf16_gemms.py [--threads 2] [--rows 1,16,64,131,256,1024]
        [--layers 30]

ms per step: the 10th percentile of repeated calls (on a shared machine the rest are other jobs'
stalls). BATCHRUN_SIMD=avx512 times the kernel's path without the tiles.
"""

from __future__ import annotations

import argparse
import sys

import torch

from batchrun.engine import kernels
from batchrun.models.layers.bf16_gemm_linear import Bf16GemmLinear
from batchrun.models.layers.packed_linear import PackedLinear
from benchmarks.int8_gemms import SHAPES, ms
from benchmarks.scoring import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64,131,256,1024")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.library()
    if lib is None:
        sys.exit("needs the CPU kernel library (a C compiler)")
    layers = []
    for _ in range(args.layers):
        for name, (k, n) in SHAPES.items():
            if name == "logits":
                continue
            w = (torch.randn(n, k) * 0.05).bfloat16()
            ours = Bf16GemmLinear(w)
            ours.kernels = lib
            layers.append((k, PackedLinear(w, None), ours))
    print(f"{cpu_name()}; threads {args.threads}; {args.layers} layers' bfloat16 GEMMs, ms per "
          f"step; batchrun's kernel on {'AMX tiles' if lib.bf16_gemm_amx() else 'vectors'}")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for k, _, _ in layers}}
        onednn = ms(lambda: [packed(xs[k]) for k, packed, _ in layers])
        ours = ms(lambda: [layer(xs[k]) for k, _, layer in layers])
        print(f"{rows:5d} rows: oneDNN {onednn:8.2f}  batchrun {ours:8.2f}  ({onednn / ours:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
