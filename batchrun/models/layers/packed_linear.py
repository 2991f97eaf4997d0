"""Linear layers with weights pre-packed for oneDNN on the CPU.

`F.linear` on the CPU re-lays out the weight matrix into the GEMM's blocked format on every call.
At batch-decode sizes (tens to a few hundred rows) that repacking is a large share of the
matmul; packing once at load time is worth 1.2-3x per matmul in fp32 and 1.1-1.8x in bf16 on
this project's 2-core machines (`python benchmarks/linear_packing.py`). Results are fp32 (or
bf16 with fp32 accumulation) GEMMs like `F.linear`'s, with a different summation order.

Set BATCHRUN_PACKED_LINEAR=0 to keep plain `nn.Linear`.
"""

from __future__ import annotations

import logging
import os
from typing import Collection

import torch
import torch.nn as nn

log = logging.getLogger(__name__)
ROWS_HINT = 64  # the batch size oneDNN tunes the packed layout for; any row count works


def available(dtype: torch.dtype) -> bool:
    if os.environ.get("BATCHRUN_PACKED_LINEAR", "1") == "0" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w, x = torch.randn(8, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
        got = PackedLinear(w, None)(x)
        return bool(torch.allclose(got.float(), (x @ w.T).float(), rtol=1e-2, atol=1e-2))
    except (RuntimeError, AttributeError) as exc:  # a torch build without these ops
        log.info("packed linear unavailable: %s", exc)
        return False


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.no_grad()
def pack_linears(model: nn.Module, keep: Collection[str] = ()) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear but those whose qualified names are
    in `keep`; returns how many were replaced (quantized modules instead: quant.replace_linears)."""
    count = 0
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and f"{path}.{child_name}".lstrip(".") not in keep:
                setattr(module, child_name, PackedLinear(child.weight, child.bias))
                count += 1
    return count
