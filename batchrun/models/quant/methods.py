"""One object per --quantization method: what loading, footprint, KV sizing and the batch
invariance check ask of it. `method(name)` is the one place the option's string is read; every
other module asks the object (does it replace linears, calibrate, take a GGUF's blocks, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from batchrun.models.quant.errors import QuantizationError


class LinearClass(Protocol):
    """A quantized linear layer's class: made from float weights, and the bytes one holds."""

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module: ...

    def nbytes(self, out_features: int, in_features: int) -> int: ...


@dataclass(frozen=True)
class Method:
    """A --quantization method.

    quantizes: the decoder's linears become quantized modules (`linear`'s class);
    calibrates: W8A8 int8, smoothed from the float checkpoint's activation maxima and judged by
      the load gate (a checkpoint stored quantized is requantized plainly instead);
    from_gguf: where the checkpoint came from a GGUF file, its layers are built from the file's
      blocks (dequantised and requantized by the method, or kept as stored: `keeps_gguf`);
    kept_gguf: the block kinds kept as stored ("all": --quantization gguf, which needs a GGUF
      file; "int4": int4-weight keeps Q4 blocks, whose groups are its own layout);
    batch_invariant: its GEMMs give a row the same bits whatever the batch (--batch-invariant:
      int8's are exact int32 sums of per-row int8 activations, rescaled and given their outlier
      channels row by row);
    on_backend: the transformers backend can quantize with it;
    bf16_gemms: its GEMMs are bfloat16 ones in a float32 model (slow without AVX512-BF16 / AMX);
    on_cuda: its layers run on CUDA through the Triton GEMMs (engine/kernels/triton_*_gemm.py;
      a GGUF source's blocks still load on the CPU only: precision.py).
    """

    name: str
    linear: str | None = None  # the quantized linear's class, in models/quant/ (linear_class)
    calibrates: bool = False
    from_gguf: bool = False
    kept_gguf: str | None = None
    batch_invariant: bool = False
    on_backend: bool = True
    bf16_gemms: bool = False
    on_cuda: bool = False

    @property
    def quantizes(self) -> bool:
        return self.name != "none"

    @property
    def needs_gguf(self) -> bool:
        """Keeps a GGUF file's own block formats: the model must come from one."""
        return self.kept_gguf == "all"

    def keeps_gguf(self, kinds) -> bool:
        """Whether GGUF tensors of block `kinds` (one fused projection's parts) are kept as
        stored rather than dequantised and requantized."""
        from batchrun.models.quant import gguf_blocks

        return self.kept_gguf == "all" or (self.kept_gguf == "int4" and
                                           all(k in gguf_blocks.INT4 for k in kinds))

    def check_device(self, device: torch.device, backend: bool = False) -> None:
        """QuantizationError where the method has no kernels on `device` (the transformers
        backend's quantized linears, calibrated on CPU tensors there: the CPU only)."""
        if not self.quantizes or device.type == "cpu":
            return
        if backend:
            raise QuantizationError(f"--quantization {self.name} on the transformers backend runs "
                                    f"on the CPU only; on {device.type} the native models take it")
        if self.on_cuda and device.type == "cuda":
            return
        cuda = ", ".join(m.name for m in METHODS.values() if m.on_cuda)
        raise QuantizationError(f"quantization {self.name!r} runs on the CPU only (it has no "
                                f"Triton kernels); on {device.type} use --dtype bfloat16, or on "
                                f"CUDA one of --quantization {cuda}")

    def linear_class(self) -> LinearClass:
        """The quantized linear's class; QuantizationError for a method without one (none, and
        gguf, whose layers are the file's blocks)."""
        import importlib

        if self.linear is None:
            raise QuantizationError(f"--quantization {self.name} has no linear layer of its own")
        module, _, cls = self.linear.rpartition(".")
        return getattr(importlib.import_module(f"batchrun.models.quant.{module}"), cls)

    def logits_in_bf16(self) -> bool:
        """An uncalibrated logits layer computed in bfloat16 (a Bf16Linear): int8 on a CPU with
        fast bfloat16, where the float32 logits GEMM was half of an int8 run's linear time (a
        calibrated int8 model's logits layer is int8 already: smoothquant.py)."""
        from batchrun.models.quant import cpu

        return self.calibrates and cpu.has_fast_bf16()

    @property
    def invariant_by_default(self) -> bool:
        """W8A8 int8 runs batch-invariant wherever --batch-invariant covers it, asked or not:
        rounding activations to int8 turns a last-bit difference (another attention kernel for
        a prefix-cache hit, a GEMM of another row count) into a whole quantization step, and
        greedy answers followed the prefix cache (20 of sample_data/chat.jsonl's 30 the same
        with and without it; 30 of 30 invariant) while the invariant path costs nothing
        measurable here (benchmarks/batch_invariant.py --quantization int8)."""
        return self.calibrates

    def default_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """--kv-cache-dtype auto's element type: W8A8 int8 keeps a bfloat16 cache in a float32
        model (as vLLM's W8A8 models, whose activations are 16-bit): over benchmarks/quality.py's
        16 windows read through the cache it agreed with float32 on 97.40% of next tokens
        against 97.38% with a float32 cache, and decode attention reads half the bytes."""
        return torch.bfloat16 if self.calibrates and dtype == torch.float32 else dtype


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", batch_invariant=True),
    # int8 calibrates on the float model: a GGUF source is read as floats
    Method("int8", "int8_linear.Int8Linear", calibrates=True, batch_invariant=True, on_cuda=True),
    Method("int8-weight", "int8_linear.Int8WeightLinear", from_gguf=True, on_cuda=True),
    Method("int4-weight", "int4_linear.Int4WeightLinear", from_gguf=True, kept_gguf="int4",
           on_cuda=True),
    # W8A8 float8: per-channel weights, per-token activations (emulated exactly on the CPU)
    Method("fp8", "fp8_linear.Fp8Linear", on_cuda=True),
    Method("gguf", from_gguf=True, kept_gguf="all", on_backend=False),
    Method("bf16", "bf16_linear.Bf16Linear", from_gguf=True, bf16_gemms=True),
)}


def method(name: str) -> Method:
    """The method --quantization `name` means; QuantizationError naming the choices for another."""
    if name not in METHODS:
        raise QuantizationError(f"unknown quantization {name!r}: use one of {', '.join(METHODS)}")
    return METHODS[name]
