"""Per-layer time of the layers a stored-quantized checkpoint loads into, side by side in one run
on Qwen2.5-0.5B's decoder shapes (every dimension a multiple of 128, as FP8 block checkpoints
need): float32 (oneDNN pre-packed, the float path), int4 groups of 128 (GPTQ / AWQ /
compressed-tensors W4A16), int8 weights (W8A16), W8A8, and FP8 e4m3 weights per channel and in
128x128 blocks (dequantised per call). Prints each layer's time over the
float32 layer's, summed over the four projections, for 1, 16 and 256 rows; then what
`--quantization int8-weight` on an FP8 checkpoint costs in accuracy (each layer's FP8 weights
dequantised and requantised to int8 per channel): the relative RMS error against the FP8 weights,
beside the FP8 weights' own against the float weights they came from (Gaussian weights).

    python benchmarks/stored_quant_linears.py [--rows 1,16,256] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from batchrun.models.layers.packed_linear import PackedLinear
from batchrun.models.quant.fp8_linear import fp8_layer
from batchrun.models.quant.int4_linear import Int4WeightLinear, quantize_groups
from batchrun.models.quant.int8_linear import Int8Linear, Int8WeightLinear

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down


def _fp8(w: torch.Tensor, block: tuple[int, int] | None):
    n, k = w.shape
    bn, bk = block or (1, k)  # per channel: one block a row
    scale = w.abs().reshape(n // bn, bn, -1, bk).amax(dim=(1, 3)).clamp(min=1e-6) / 448
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    layer = fp8_layer((w / full).to(torch.float8_e4m3fn), scale, block or None)
    return layer.make(bias=None, **layer.rows, **layer.options)


def systems(w: torch.Tensor) -> dict[str, torch.nn.Module]:
    q, scale, minimum = quantize_groups(w, 128)
    return {"float32": PackedLinear(w, None),
            "int4 g128": Int4WeightLinear(None, None, q=q, scale=scale, minimum=minimum, group=128),
            "int8-weight": Int8WeightLinear(w, None),
            "W8A8": Int8Linear(w, None),
            "fp8 channel": _fp8(w, None),
            "fp8 block": _fp8(w, (128, 128))}


def _time(layer, x, repeats: int) -> float:
    for _ in range(3):
        layer(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    layers = [systems(w) for w in weights]
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}; median of {args.repeats} calls per layer")
    names = list(layers[0])
    print(f"{'rows':>5} " + " ".join(f"{n:>12}" for n in names) + "   (time / float32's; float32 in ms)")
    for rows in (int(r) for r in args.rows.split(",")):
        totals = dict.fromkeys(names, 0.0)
        for (n, k), layer in zip(SHAPES, layers):
            x = torch.randn(rows, k)
            for name in names:
                totals[name] += _time(layer[name], x, args.repeats)
        base = totals["float32"]
        print(f"{rows:>5} " + " ".join(f"{totals[n] / base:>12.2f}" for n in names)
              + f"   ({base * 1e3:.3f} ms)")
    requantisation_error([{**layer, "float weights": w} for layer, w in zip(layers, weights)])


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@torch.no_grad()
def requantisation_error(layers: list[dict]) -> None:
    for name in ("fp8 channel", "fp8 block"):
        to_int8 = from_float = 0.0
        for (n, k), layer in zip(SHAPES, layers):
            fp8 = layer[name].dequantized_weight()
            to_int8 += _rel_rms(Int8WeightLinear(fp8, None).dequantized_weight(), fp8) / len(SHAPES)
            from_float += _rel_rms(fp8, layer["float weights"]) / len(SHAPES)
        print(f"{name}: int8 per channel vs the fp8 weights: relative RMS error {to_int8:.2e} "
              f"(the fp8 weights vs their float source: {from_float:.2e})")


if __name__ == "__main__":
    main()
