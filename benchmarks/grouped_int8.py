"""Grouped-int8 weight-only linear (GGUF Q8_0 / Q5_K / Q6_K kept quantized): the C kernel
(engine/kernels/grouped_int8.c) against PyTorch ops (dequantize the layer, one dense GEMM in
cpu.weight_only_dtype) and the float32 linear it replaces, side by side, at decode-sized and
prefill-sized row counts. Prints ms per call and each way's ratio to float32.
Run: python benchmarks/grouped_int8.py [--shapes 960x576,3072x576,576x1536] [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from batchrun.engine import kernels
from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear
from benchmarks.machine import best_time as timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="960x576,3072x576,576x1536,4096x4096",
                    help="out x in of each layer (SmolLM2-135M's fused qkv, gate_up, down; a 7B's q)")
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--cold-mib", type=int, default=256, help="float32 MiB of distinct copies "
                    "of each layer, cycled (0: one copy, cache-hot)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = kernels.library(("-DNO_SPECIALISED",))
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, group {args.group}, with min, weights cycled over "
          f"{args.cold_mib} MiB of float32 copies; ms per call (fastest of {args.repeat}), "
          "(x float32) = float32 time / this time")
    print(f"{'shape':>10} {'rows':>5} {'float32':>9} {'C kernel':>16} {'dequant+GEMM':>16}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        # distinct copies, cycled, so each call reads its weights from memory as a model's
        # layers do (one layer called again and again would sit in the cache)
        copies = max(1, min(64, (args.cold_mib << 20) // (4 * n * k)))
        layers = []
        for _ in range(copies):
            q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
            scale, minimum = torch.rand(n, k // args.group) / 50, torch.randn(n, k // args.group) / 50
            layers.append(GroupedInt8Linear(q, scale, minimum, args.group))
        dense = [layer.dequantized_weight() for layer in layers]
        turn = [0]

        def cycled(fn):
            def call():
                turn[0] = (turn[0] + 1) % copies
                return fn(turn[0])
            return call

        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            base = timed(cycled(lambda i: F.linear(x, dense[i])), args.repeat)
            for layer in layers:
                layer.kernels = lib
            kernel = (timed(cycled(lambda i: layers[i].kernel_forward(x)), args.repeat)
                      if lib else float("nan"))
            for layer in layers:
                layer.kernels = None  # forward() takes the PyTorch ops
            ops = timed(cycled(lambda i: layers[i](x)), args.repeat)
            print(f"{shape:>10} {rows:>5} {base * 1e3:9.3f} {kernel * 1e3:9.3f} ({base / kernel:4.2f}x)"
                  f" {ops * 1e3:9.3f} ({base / ops:4.2f}x)")


if __name__ == "__main__":
    main()
