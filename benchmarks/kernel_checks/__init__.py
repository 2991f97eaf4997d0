"""Checks of the GPU kernels against torch references, one module per kernel family.

Each module exposes CHECKS: dict[str, Callable[[torch.device], tuple[float, float]]]: a kernel
name (what it is: prefill, decode, decode_splitk, window, fp8, ...) -> a function that runs the
kernel on small random shapes on that device against the torch reference and returns
(max_err, tolerance). benchmarks/gpu_suite.py discovers every module here; on a CPU the Triton
kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""
