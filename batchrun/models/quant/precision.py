"""How a native model's weights are held: the --quantization method (methods.py) and the format
a checkpoint is stored in. Loading (llm.build_model) and sizing (footprint.weights_bytes) both
walk this one object, so what is loaded and what is counted cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from batchrun.models.quant import CheckpointFormat, QuantizationError, check_checkpoint
from batchrun.models.quant.methods import Method, method


@dataclass(frozen=True)
class Precision:
    """`method`: the --quantization method; `stored`: the format of a checkpoint stored quantized
    (None for a float one), its layers kept as stored or, under a method, requantized."""

    method: Method
    stored: CheckpointFormat | None = None

    def __post_init__(self) -> None:
        if self.stored is not None and self.method.quantizes and self.method.linear is None:
            raise QuantizationError(f"--quantization {self.method.name} reads a GGUF file's "
                                    f"blocks; this checkpoint is stored quantized "
                                    f"({self.stored.describe()}): run it with --quantization "
                                    "none, or requantize it with int8 / int8-weight / "
                                    "int4-weight / bf16")

    @classmethod
    def of(cls, hf_config, quantization: str, device: torch.device | None = None) -> Precision:
        """The precision `quantization` gives a checkpoint of `hf_config` (on `device`: a
        QuantizationError where it cannot run there)."""
        how = method(quantization)
        if device is not None:
            how.check_device(device)
        return cls(how, check_checkpoint(hf_config, device))

    @property
    def calibrated(self) -> bool:
        """W8A8 int8 of a float checkpoint: smoothed from the calibration text and gated
        (a stored checkpoint's layers are requantized plainly instead)."""
        return self.method.calibrates and self.stored is None

    @property
    def has_quantized_layers(self) -> bool:
        """Some linears are quantized modules (whose kernels attach at load)."""
        return self.method.quantizes or self.stored is not None

    @property
    def keeps_stored(self) -> bool:
        """A stored checkpoint's layers as stored (no method requantizes them)."""
        return self.stored is not None and not self.method.quantizes

    def layer_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes one replaced linear of that shape holds: the method's layer, or as stored."""
        if self.method.linear is not None:
            return self.method.linear_class().nbytes(out_features, in_features)
        assert self.stored is not None, "layer_bytes of a precision without quantized layers"
        return self.stored.nbytes(out_features, in_features)

    def load_layers(self, model: nn.Module, folder: Path) -> set[str]:
        """Put the quantized layers that do not come from float weights in place (a stored
        checkpoint's; a GGUF source's blocks, for the methods that take them); the checkpoint
        tensor names they stand for, which the float weights' loading skips."""
        from batchrun.models.errors import ModelFolderError, naming

        if self.stored is not None:
            try:
                with naming(folder, f"its {self.stored.method} layers cannot be read"):
                    return self.stored.load_linears(model, folder, self.method)
            except ModelFolderError as exc:  # the format's own refusals keep their type
                if isinstance(exc.__cause__, QuantizationError):
                    raise QuantizationError(f"{folder}: {exc.__cause__}") from exc
                raise
        if not self.method.from_gguf:  # int8 calibrates on the float model
            return set()
        from batchrun.models.quant import gguf

        source = gguf.source_of(folder)
        if source is not None and next(model.parameters()).device.type != "cpu":
            raise QuantizationError(f"--quantization {self.method.name} of a GGUF file reads "
                                    "its blocks on the CPU only; on CUDA use --quantization int8 or "
                                    "fp8 (which quantize its dequantised weights) or none")
        if source is not None:
            return gguf.load_linears(model, source, self.method)
        if self.method.needs_gguf:
            raise QuantizationError("--quantization gguf keeps a GGUF checkpoint's own block "
                                    f"formats; {folder} is not a GGUF model")
        return set()
