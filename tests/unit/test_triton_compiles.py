"""The Triton kernels compile for a GPU target without a GPU (benchmarks/compile_kernels.py:
triton.compile to PTX and cubin for sm_90 through the ptxas Triton ships), so what only a GPU
compile rejects fails here rather than in a lent GPU's few minutes. A few checks' kernels only
(the whole set takes minutes): the shared-prefix decode (split-K partials with a skip, the prefix
kernel, the reduce) and the fp8 cache (uint8 bytes widened in-kernel, prefill and decode); the
quantized GEMMs (int8 and float8 scaled, weight-only) for sm_90 and, through their integer
float8 decoding, sm_80 (whose Triton has no e4m3 type)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


NEEDS_PTXAS = pytest.mark.skipif(not (Path(__import__("triton").__file__).parent
                                      / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                                 reason="this triton has no ptxas")


def _compile(arch: str, only: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_kernels.py"),
                          "--arch", arch, "--only", only],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"kernel variants compiled for sm_{arch}" in run.stdout
    return run.stdout


@NEEDS_PTXAS
def test_attention_kernels_compile_for_hopper():
    out = _compile("90", "decode_cascade,fp8")
    for kernel in ("_shared_prefix_kernel", "_splitk_partial_kernel", "_splitk_reduce_kernel",
                   "_paged_prefill_kernel", "_paged_decode_kernel"):
        assert kernel in out


@NEEDS_PTXAS
@pytest.mark.parametrize("arch, only", [
    ("90", "w8a8_int8_gemm,fp8_gemm,w8a8_int8_gemm_prefill,fp8_gemm_prefill,weight_int8_gemm,"
           "weight_fp8_gemm"),
    ("80", "w8a8_int8_gemm,fp8_gemm_widened,weight_fp8_gemm_bits"),
])
def test_quantized_gemm_kernels_compile(arch, only):
    out = _compile(arch, only)
    assert "_scaled_gemm_kernel" in out and "_weight_gemm_kernel" in out
