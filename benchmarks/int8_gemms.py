"""Per GEMM, SmolLM2-135M's shapes: float32 (F.linear and the packed PackedLinear the float run
uses), bfloat16 (Bf16Linear) and W8A8 (Int8Linear) split into its passes: the activations'
quantization to uint8 (one C pass), the layer's int8 GEMM (the AMX-INT8 kernel on a CPU with
AMX, else oneDNN's) beside oneDNN's int8 linear on the same weights, the per-row rescale. Then a
decode step's worth of layers (--layers copies of the four per-layer shapes, so the weights
stream from memory as in a run): the layer's int8 GEMM against oneDNN's, per row count.

    python benchmarks/int8_gemms.py [--threads N] [--rows 1,32,256] [--layers 30]

ms per call: the 10th percentile of repeated calls (on a shared machine the rest are other jobs'
stalls). ONEDNN_VERBOSE=1 shows the kernels (brg_matmul:avx512_core_vnni for int8 on AVX512-VNNI,
no per-call reorder of the weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from batchrun.engine import kernels  # noqa: E402
from batchrun.models.layers.packed_linear import PackedLinear  # noqa: E402
from batchrun.engine.kernels.fallback_ops import quantize_rows, rescale_rows  # noqa: E402
from batchrun.models.quant.bf16_linear import Bf16Linear  # noqa: E402
from batchrun.models.quant.int8_linear import Int8Linear, onednn_qlinear_u8  # noqa: E402

# hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, vocabulary 49152 (fused qkv, gate_up)
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "logits": (576, 49152)}


def ms(fn, seconds: float = 0.4) -> float:
    fn()
    times, end = [], time.perf_counter() + seconds
    while len(times) < 15 or (time.perf_counter() < end and len(times) < 400):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 10] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,32,256")
    ap.add_argument("--layers", type=int, default=30, help="layers of the streaming comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.library()
    if lib is None:
        sys.exit("needs the CPU kernel library (a C compiler)")
    print(f"threads {args.threads}, ms per call | int8 = quant + gemm + rescale (+ Python)")
    print(f"{'rows':>4} {'shape':>8} {'K->N':>11} | {'fp32':>8} {'fp32 pk':>8} {'bf16':>8} | "
          f"{'int8':>8} {'quant':>7} {'gemm':>8} {'oneDNN':>8} {'rescale':>7} | int8 x fp32 pk, "
          "bf16 x fp32 pk")
    for rows in map(int, args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            w, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
            packed, bf16, int8 = PackedLinear(w, None), Bf16Linear(w, None), Int8Linear(w, None)
            int8.kernels = lib
            ux, scale = quantize_rows(x, lib, unsigned=True)
            onednn = OneDnn(int8)
            y = int8.kernel_gemm(ux)
            r = {"fp32": ms(lambda: F.linear(x, w)), "pk": ms(lambda: packed(x)), "bf16": ms(lambda: bf16(x)),
                 "int8": ms(lambda: int8(x)), "quant": ms(lambda: quantize_rows(x, lib, unsigned=True)),
                 "gemm": ms(lambda: int8.kernel_gemm(ux)), "onednn": ms(lambda: onednn(ux)),
                 "rescale": ms(lambda: rescale_rows(y, scale, None, lib))}
            print(f"{rows:>4} {name:>8} {k:>5}->{n:<5} | {r['fp32']:8.3f} {r['pk']:8.3f} {r['bf16']:8.3f} | "
                  f"{r['int8']:8.3f} {r['quant']:7.3f} {r['gemm']:8.3f} {r['onednn']:8.3f} "
                  f"{r['rescale']:7.3f} | {r['pk'] / r['int8']:5.2f}x {r['pk'] / r['bf16']:5.2f}x",
                  flush=True)
    streaming(lib, args.layers, [int(r) for r in args.rows.split(",")])


class OneDnn:
    """oneDNN's int8 linear on an Int8Linear's weights (what the layer runs without AMX)."""

    def __init__(self, layer: Int8Linear):
        self.packed = torch.ops.onednn.qlinear_prepack(layer.plain_weight(), None)
        self.scale, self.zero = layer.w_scale, torch.zeros(layer.out_features, dtype=torch.int64)

    def __call__(self, ux: torch.Tensor) -> torch.Tensor:
        return onednn_qlinear_u8(ux, self.packed, self.scale, self.zero)


def streaming(lib, layers: int, row_counts: list[int]) -> None:
    """ms per decode step of `layers` layers' four int8 GEMMs: the layer's own and oneDNN's."""
    shapes = [shape for name, shape in SHAPES.items() if name != "logits"]
    gemms = []
    for _ in range(layers):
        for k, n in shapes:
            layer = Int8Linear(torch.randn(n, k) * 0.05, None)
            layer.kernels = lib
            gemms.append((layer, OneDnn(layer), k))
    print(f"\n{layers} layers' int8 GEMMs, weights streaming from memory: ms per step")
    for rows in row_counts:
        ux = {k: torch.randint(0, 256, (rows, k), dtype=torch.uint8) for k in {k for k, _ in shapes}}
        def own_step():  # each output dropped before the next GEMM, as a model step does
            for layer, _, k in gemms:
                layer.kernel_gemm(ux[k])

        def onednn_step():
            for _, onednn, k in gemms:
                onednn(ux[k])

        own, ref = ms(own_step, seconds=1.0), ms(onednn_step, seconds=1.0)
        print(f"{rows:>4} rows: layer's GEMM {own:7.2f}  oneDNN {ref:7.2f}  ({ref / own:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
