"""This machine's limits and a workload's floor under them: the GEMM rate (GFLOP/s of torch
matmuls of the model's linear shapes at a decode-sized and a prefill-sized batch) and the
memory bandwidth (GB/s of a large copy), then a workload's compute floor (its linear and
attention FLOPs at that rate) and memory floor (weights read once per engine step, plus the KV
cache decode attention reads, at that bandwidth)."""

from __future__ import annotations

import os
import sys
import time

import torch


# Environment that makes PyTorch's own kernels, oneDNN, MKL and batchrun's C kernels use no more
# than an instruction set (read when each library loads): an AVX2-only (or pre-AVX2) CPU's code
# paths on this one (avx512: an AVX-512 CPU with bfloat16 and VNNI dot products but no AMX
# tiles). The memory system and the core stay this machine's.
ISA_CAPS = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "BATCHRUN_SIMD": "avx512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "BATCHRUN_SIMD": "avx2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "BATCHRUN_SIMD": "portable"},
}


def isa_cap_in_force() -> str | None:
    """The name of the ISA_CAPS entry this process's environment holds, if any."""
    return next((name for name, caps in ISA_CAPS.items()
                 if all(os.environ.get(k) == v for k, v in caps.items())), None)


def cap_isa(name: str) -> None:
    """Re-execute this process with ISA_CAPS[name] in its environment (once; the libraries read
    it when they load, so setting it after `import torch` would be too late)."""
    if isa_cap_in_force() == name:
        return
    os.environ.update(ISA_CAPS[name])
    os.execv(sys.executable, [sys.executable, *sys.argv])


def isa_cap_note() -> str:
    """', instruction set capped at ...' when ISA_CAPS are in force, else ''."""
    name = isa_cap_in_force()
    if name is None:
        return ""
    return f", instruction set capped at {name} ({', '.join(f'{k}={v}' for k, v in ISA_CAPS[name].items())})"


def best_time(fn, repeat: int = 5) -> float:
    """Seconds of the fastest of `repeat` calls after a warm-up (the least disturbed on a shared
    machine)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_gflops(cfg, rows: int = 256, dtype=torch.float32) -> float:
    """GFLOP/s of [rows, in] @ [in, out] over the model's linear shapes (the best of 5 runs)."""
    shapes = [(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
              (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              (cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)]
    mats = [(torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for k, n in shapes]
    seconds = best_time(lambda: [a @ b for a, b in mats])
    return sum(2 * rows * k * n for k, n in shapes) / seconds / 1e9


def bandwidth_gbs(mib: int = 512) -> float:
    """GB/s of copying `mib` MiB (read + write bytes) — the best of 5 runs."""
    src = torch.ones(mib << 18)  # float32
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / seconds / 1e9


def linear_params(cfg) -> int:
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size)
    return cfg.num_layers * per_layer


def workload_flops(cfg, prompts: list[int], outputs: list[int], cached: int = 0) -> float:
    """FLOPs of the linears (every computed token), the logits (every sampled token) and
    attention (query x key pairs, causal) of a workload: prompt and output lengths per request,
    `cached` prompt tokens served by the prefix cache (not computed)."""
    computed = sum(prompts) + sum(outputs) - cached
    linear = 2 * linear_params(cfg) * computed + 2 * cfg.hidden_size * cfg.vocab_size * len(
        prompts) + 2 * cfg.hidden_size * cfg.vocab_size * sum(outputs)
    pairs = sum((p + o) * (p + o + 1) // 2 for p, o in zip(prompts, outputs))
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
    return float(linear + attention)


def workload_bytes(cfg, prompts: list[int], outputs: list[int], steps: int,
                   elem: int = 4) -> float:
    """Bytes an engine must read: the weights once per step, and each decode token's KV
    context (K and V of every layer) once."""
    weights = (linear_params(cfg) + cfg.vocab_size * cfg.hidden_size) * elem
    kv_per_token = cfg.kv_bytes_per_token * elem
    context = sum(p * o + o * (o + 1) // 2 for p, o in zip(prompts, outputs))
    return float(weights * steps + kv_per_token * context)


# Multiply-adds per instruction against float32's on AVX-512: VNNI's vpdpbusd (int8) and
# AVX512-BF16's vdpbf16ps. The reduced-precision floors are the measured float32 rate times these.
REDUCED_RATE = {"int8": 4, "bf16": 2}


def limits_report(cfg, prompts: list[int], outputs: list[int], results, dtype=torch.float32) -> str:
    """The machine's measured rates and each system's time against the workload's floors; over a
    float32 rate also the int8 and bf16 compute floors (REDUCED_RATE times that rate)."""
    gemm, bw = gemm_gflops(cfg, dtype=dtype), bandwidth_gbs()
    elem = torch.tensor([], dtype=dtype).element_size()
    reduced = REDUCED_RATE if dtype == torch.float32 else {}
    lines = [f"machine: GEMM {gemm:.1f} GFLOP/s ({dtype}, the model's linear shapes x 256 rows), "
             f"memory bandwidth {bw:.1f} GB/s (copy)"
             + "".join(f"; {name} peak {k}x float32 = {k * gemm:.1f} GFLOP/s"
                       for name, k in reduced.items())]
    for r in results:
        cached = round((r.cache_hit_rate or 0) * sum(prompts))
        flops = workload_flops(cfg, prompts, outputs, cached)
        compute = flops / (gemm * 1e9)
        memory = (workload_bytes(cfg, prompts, outputs, r.steps, elem) / (bw * 1e9)
                  if r.steps else None)
        floor = f"memory floor {memory:.1f} s ({r.steps} steps)" if memory else "memory floor -"
        others = "".join(f", {name} {compute / k:.1f} s" for name, k in reduced.items())
        lines.append(f"{r.system:<22}{r.seconds:>8.1f} s: compute floor {compute:.1f} s "
                     f"({flops / 1e12:.2f} TFLOP, {compute / r.seconds:.0%} of the time{others}), "
                     f"{floor}")
    return "\n".join(lines)
