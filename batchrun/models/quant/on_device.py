"""Where a quantized layer computes: its Triton kernels (engine/kernels/triton_*_gemm.py) for
tensors on a CUDA device, its CPU kernels otherwise.

BATCHRUN_TRITON_LINEARS=1 (or `FORCED = True`, which the tests set) sends CPU tensors through
the Triton path too, under Triton's interpreter (TRITON_INTERPRET=1): how the CUDA path is
tested on a machine without a GPU. Read at import and per layer as it is built, so a layer built
forced keeps the plain weights its Triton path reads (no oneDNN packing).
"""

from __future__ import annotations

import os

import torch
from torch import nn

FORCED = os.environ.get("BATCHRUN_TRITON_LINEARS") == "1"


def runs_triton(device: torch.device) -> bool:
    """Whether a layer's tensors on `device` go through the Triton kernels."""
    return device.type == "cuda" or FORCED


class DeviceTensors(nn.Module):
    """A layer holding its quantized tensors as plain attributes (named in DEVICE_TENSORS), so a
    dtype cast of the model leaves them as they are, while a device move takes them along."""

    DEVICE_TENSORS: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        device = fn(torch.empty(0, device=self._device())).device
        if device != self._device():
            for name in self.DEVICE_TENSORS:
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.to(device))
            self.moved()
        return super()._apply(fn, recurse)

    def _device(self) -> torch.device:
        for name in self.DEVICE_TENSORS:
            value = getattr(self, name, None)
            if isinstance(value, torch.Tensor):
                return value.device
        return torch.device("cpu")

    def moved(self) -> None:
        """Drop what was derived on the old device (caches)."""
