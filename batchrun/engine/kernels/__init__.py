"""CPU kernels in plain C, compiled once with the system C compiler and loaded through ctypes.

No torch headers are involved, so a build takes about a second; the shared object is cached
under $BATCHRUN_CACHE/kernels keyed by the source, the flags and the CPU. Without a compiler
(or if the build fails) callers fall back to pure PyTorch.
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

log = logging.getLogger(__name__)
# KV element types the kernel reads, and the code it takes for each.
KV_KINDS = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}
SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC"]


def _cpu_signature() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE), "-lpthread", "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(out, target)


@lru_cache(maxsize=1)
def library():
    """The loaded kernel library, or None when it cannot be built here."""
    if os.environ.get("BATCHRUN_DISABLE_KERNELS"):
        return None
    from batchrun.models.loader import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_attention-{key}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU attention kernel unavailable, using PyTorch attention: %s", detail)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
    return lib
