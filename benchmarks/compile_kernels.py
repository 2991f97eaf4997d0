"""Compile every Triton kernel the kernel checks launch for a GPU target, without a GPU: the
checks (benchmarks/kernel_checks) run on the CPU with each launch replaced by triton.compile for
that target (PTX and cubin through the ptxas Triton ships), so what only a GPU compile rejects
(a loop-carried value changing type, a dot below its minimum shape, an op a backend lacks) shows
before a GPU is lent. The checks' results are meaningless here (nothing runs); each distinct
(kernel, argument types, constexprs) compiles once.

    python benchmarks/compile_kernels.py [--arch 90] [--only prefill,decode]

Prints each kernel variant and exits 1 when any fails to compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8",
         torch.float8_e4m3fn: "fp8e4nv"}


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


class Compiler:
    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)
        self.done: dict[str, str | None] = {}  # variant -> error (None: compiled)

    def launch(self, fn: JITFunction, args, kwargs) -> None:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        names = fn.arg_names
        bound = dict(zip(names, args)) | kwargs
        consts = {n: bound[n] for n in names if n in kwargs}
        signature = {n: "constexpr" if n in consts else arg_type(bound[n]) for n in names}
        key = f"{fn.__name__} {sorted(signature.items())} {sorted(consts.items(), key=str)}"
        if key in self.done:
            return
        start = time.perf_counter()
        try:
            triton.compile(ASTSource(fn, signature, consts), target=self.target, options=options)
            self.done[key] = None
            status = f"ok {time.perf_counter() - start:.1f}s"
        except Exception as exc:  # report every failing variant, not the first only
            error = f"{type(exc).__name__}: {exc}"
            self.done[key] = error
            status = "FAIL " + error.splitlines()[0][:200]
        flags = ",".join(f"{k}={v}" for k, v in consts.items() if isinstance(v, bool) and v)
        types = ",".join(sorted({t for t in signature.values() if t.startswith("*")}))
        print(f"{fn.__name__:28s} {types:36s} {flags:50s} {status}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: Hopper)")
    ap.add_argument("--only", help="comma-separated kernel check names (default: all)")
    args = ap.parse_args(argv)
    from benchmarks.gpu_suite import discover_checks

    compiler = Compiler(args.arch)
    JITFunction.__getitem__ = lambda fn, grid: (
        lambda *a, **kw: compiler.launch(fn, a, kw))
    only = None if args.only is None else set(args.only.split(","))
    for name, check in discover_checks().items():
        if only is None or name in only:
            try:
                check(torch.device("cpu"))
            except Exception:  # nothing ran, so results are garbage; only compiles count
                pass
    failed = [k for k, err in compiler.done.items() if err is not None]
    for key in failed:
        print("failed:", key, "\n", compiler.done[key], file=sys.stderr)
    print(f"{len(compiler.done) - len(failed)} of {len(compiler.done)} kernel variants compiled "
          f"for sm_{args.arch}")
    return 1 if failed or not compiler.done else 0


if __name__ == "__main__":
    sys.exit(main())
