"""The Triton kernels compile for a GPU target without a GPU (benchmarks/compile_kernels.py:
triton.compile to PTX and cubin for sm_90 through the ptxas Triton ships), so what only a GPU
compile rejects fails here rather than in a lent GPU's few minutes. A few checks' kernels only
(the whole set takes minutes): the shared-prefix decode (split-K partials with a skip, the prefix
kernel, the reduce) and the fp8 cache (uint8 bytes widened in-kernel, prefill and decode)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent
                         / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                    reason="this triton has no ptxas")
def test_attention_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_kernels.py"),
                          "--arch", "90", "--only", "decode_cascade,fp8"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "kernel variants compiled for sm_90" in run.stdout
    for kernel in ("_shared_prefix_kernel", "_splitk_partial_kernel", "_splitk_reduce_kernel",
                   "_paged_prefill_kernel", "_paged_decode_kernel"):
        assert kernel in run.stdout
