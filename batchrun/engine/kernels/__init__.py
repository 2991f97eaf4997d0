"""CPU kernels in plain C, compiled once with the system C compiler and loaded through ctypes.

No torch headers are involved; the shared object is cached under $BATCHRUN_CACHE/kernels keyed
by the source, the flags and the CPU. Without a compiler (or if the build fails) callers fall
back to pure PyTorch. The library is handed out as ops.CpuKernels: its functions as typed ops
over tensors, with their ctypes signatures (ops.py).

`library()` is the build for this CPU (-march=native), with the attention kernel specialised
for every shape it has constants for (about two minutes to build on a 2-core AMD EPYC);
`library(shape_flags(...))`, what the engine loads, only for its model's (seconds), and
`shapes_flags` for a few (the tests'). `library(VARIANTS["avx2"])` and
`library(VARIANTS["portable"])` add flags that turn off AVX-512 (and AVX2/FMA), so the vector
paths of simd.h other than this CPU's own are built and tested here too (`VARIANTS["avx512"]`
turns off AMX alone); `simd_path()` in a
library says which one it took (2 AVX-512, 1 AVX2+FMA, 0 portable).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from batchrun.engine.kernels.ops import KINDS, CpuKernels  # noqa: F401 (KINDS: the dtypes they take)

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(n) for n in ("paged_attention.c", "elementwise.c",
                                                          "quantize.c", "expert_gemm.c",
                                                          "grouped_int8.c", "fp8.c",
                                                          "bf16_gemm.c", "gated_delta.c",
                                                          "causal_conv.c", "int8_amx.c")]
HEADERS = [Path(__file__).with_name(n) for n in ("amx.h", "dtypes.h", "parallel.h", "simd.h")]
# -ffast-math's parts, not the flag: with it (or -funsafe-math-optimizations) GCC before 13 links
# crtfastmath.o into the library, whose constructor turns on flush-to-zero for the whole process
# once it is loaded (every denormal in numpy, torch and Python then reads as 0).
FAST_MATH = ["-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
             "-freciprocal-math", "-ffinite-math-only"]
FLAGS = ["-O3", "-march=native", *FAST_MATH, "-fopenmp-simd", "-shared", "-fPIC"]
# Extra flags that force simd.h's other paths on a CPU that has more.
VARIANTS = {"native": (), "avx512": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
            "avx2": ("-mno-avx512f",),
            "portable": ("-mno-avx2", "-mno-avx512f", "-mno-fma")}
SIMD_PATHS = {2: "avx512", 1: "avx2", 0: "portable"}


def _cpu_signature() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(target: Path, flags: list[str]) -> None:
    compiler_path = compiler()
    if not compiler_path:
        raise RuntimeError("no C compiler found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        base = [compiler_path, *flags, "-o", str(out), *map(str, SOURCES), "-lpthread", "-lm"]
        try:  # OpenMP shares PyTorch's thread pool; without it the kernels start pthreads
            subprocess.run(base + ["-fopenmp"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError:
            subprocess.run(base, check=True, capture_output=True, text=True)
        os.replace(out, target)


# (query heads per KV head, head_dim) pairs paged_attention.c compiles with constant loop bounds.
SPECIALISED = {(g, d) for g in range(1, 9) for d in (64, 128)}


def shape_flags(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[str, ...]:
    """Flags that build only one model's specialisation of the attention kernel (a build of
    seconds instead of minutes; other shapes take its generic loop either way)."""
    g = num_heads // max(1, num_kv_heads)
    if (g, head_dim) in SPECIALISED:
        return (f"-DONLY_G={g}", f"-DONLY_D={head_dim}")
    return ("-DNO_SPECIALISED",)


def shapes_flags(shapes) -> tuple[str, ...]:
    """shape_flags for several (query heads per KV head, head_dim) pairs (the test suite's)."""
    cases = [f"CASE({g},{d})" for g, d in sorted(set(shapes)) if (g, d) in SPECIALISED]
    return (f"-DONLY_CASES={' '.join(cases)}",) if cases else ("-DNO_SPECIALISED",)


def enabled() -> bool:
    """False with BATCHRUN_DISABLE_KERNELS set: PyTorch ops only."""
    return not os.environ.get("BATCHRUN_DISABLE_KERNELS")


def simd_cap() -> tuple[str, ...]:
    """The flags of BATCHRUN_SIMD's vector path (none when unset)."""
    name = os.environ.get("BATCHRUN_SIMD") or "native"
    if name not in VARIANTS:
        raise ValueError(f"BATCHRUN_SIMD={name!r}: expected one of {', '.join(VARIANTS)}")
    return VARIANTS[name]


def library(extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The loaded kernel library (built with FLAGS + BATCHRUN_SIMD's flags + extra_flags), or
    None when it cannot be built here or kernels are disabled."""
    return _library(simd_cap() + tuple(extra_flags)) if enabled() else None


@lru_cache(maxsize=None)
def _library(extra_flags: tuple[str, ...]) -> CpuKernels | None:
    from batchrun.paths import cache_dir

    flags = FLAGS + list(extra_flags)
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(flags).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    try:
        if not target.exists():
            _build(target, flags)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels unavailable, using PyTorch ops: %s", detail)
        return None
    return CpuKernels(lib)
