"""Grouped-int8 weight-only linear (GGUF Q8_0 / Q5_K / Q6_K kept quantized): the C kernel
(engine/kernels/grouped_int8.c) against PyTorch ops (dequantize the layer, one dense GEMM in
cpu.weight_only_dtype) and the float32 linear it replaces, side by side, at decode-sized and
prefill-sized row counts. Prints ms per call and each way's ratio to float32.
Run: python benchmarks/grouped_int8.py [--shapes 960x576,3072x576,576x1536] [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from batchrun.engine import kernels
from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear


def timed(fn, repeat: int) -> float:
    """The fastest of `repeat` calls (the machine is shared: the minimum is the least disturbed)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="960x576,3072x576,576x1536,4096x4096",
                    help="out x in of each layer (SmolLM2-135M's fused qkv, gate_up, down; a 7B's q)")
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = kernels.library(("-DNO_SPECIALISED",))
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, group {args.group}, with min; ms per call, "
          "(x float32) = float32 time / this time")
    print(f"{'shape':>10} {'rows':>5} {'float32':>9} {'C kernel':>16} {'dequant+GEMM':>16}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
        scale, minimum = torch.rand(n, k // args.group) / 50, torch.randn(n, k // args.group) / 50
        layer = GroupedInt8Linear(q, scale, minimum, args.group)
        dense = layer.dequantized_weight()
        layer.kernels = lib
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            base = timed(lambda: F.linear(x, dense), args.repeat)
            kernel = timed(lambda: layer.kernel_forward(x), args.repeat) if lib else float("nan")
            layer.kernels = None
            ops = timed(lambda: layer(x), args.repeat)
            layer.kernels = lib
            print(f"{shape:>10} {rows:>5} {base * 1e3:9.3f} {kernel * 1e3:9.3f} ({base / kernel:4.2f}x)"
                  f" {ops * 1e3:9.3f} ({base / ops:4.2f}x)")


if __name__ == "__main__":
    main()
