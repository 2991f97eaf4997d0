"""MXFP4 checkpoints (quant_method "mxfp4": GPT-OSS as OpenAI ships it). Only the routed experts
are quantized; attention, router, embeddings and logits are stored float (modules_to_not_convert).

Per experts block: gate_up_proj_blocks uint8 [experts, 2I, hidden / 32, 16] and gate_up_proj_scales
uint8 [experts, 2I, hidden / 32] (gate and up rows alternating), down_proj_blocks / _scales
likewise over [experts, hidden, I / 32]; the biases float. Each block of 32 weights along the
input is 16 bytes of E2M1 values (OCP Microscaling FP4: element 2j in byte j's low nibble, 2j + 1
in its high one) sharing an E8M0 scale byte e: w = value * 2^(e - 127).

Twice an E2M1 value is an integer in -12..12, so each expert loads exactly as GroupedInt8Linear's
groups of 32: q = 2 * value, scale = 2^(e - 128). That holds a byte a weight and a float32 scale
a block (1.125 bytes a weight, 2.1x the file's 0.53), and runs on the grouped int8 kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.quant.checkpoint import Tensors
from batchrun.models.quant.errors import QuantizationError
from batchrun.models.quant.grouped_int8_linear import GroupedInt8Linear

METHOD = "mxfp4"
HOLDS = "routed experts"  # what the format quantizes (the others: linears)
BLOCK = 32
# twice each E2M1 code's value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (codes 8-15)
_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def check(config: dict) -> None:
    """Nothing to refuse: the method has no variants."""


def describe(config: dict) -> str:
    return "mxfp4 (e2m1 in blocks of 32 with e8m0 scales, held as grouped int8)"


def nbytes(config: dict, out_features: int, in_features: int) -> int:
    return GroupedInt8Linear.nbytes(out_features, in_features, BLOCK, has_min=False)


def read(tensors: Tensors, prefix: str, config: dict):
    raise QuantizationError(f"{prefix}: MXFP4 checkpoints quantize routed experts only; this "
                            "linear's quantized tensors are not read")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., rows, k], scale float32 [..., rows, k / 32]) of MXFP4 blocks [..., rows,
    k / 32, 16] and scales [..., rows, k / 32]: w = q * scale per block, exactly."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != BLOCK // 2 \
            or blocks.shape[:-1] != scales.shape:
        raise QuantizationError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} with scales "
                                f"{tuple(scales.shape)} {scales.dtype}: expected uint8 [..., k / 32, "
                                "16] and uint8 [..., k / 32]")
    if bool((scales == 255).any()):
        raise QuantizationError("MXFP4 scales of 255 (NaN in E8M0): the checkpoint is damaged")
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).long()  # [..., k/32, 16, 2]
    q = _DOUBLED[codes].reshape(*scales.shape[:-1], -1)
    scale = torch.exp2(scales.double() - 128).float()  # a power of two, exact down to 2^-128
    return q, scale


def read_fused(tensors: Tensors, base: str, experts: nn.Module):
    """Per expert its gate_up and down GroupedInt8Linear (gate rows first, biases in), or None
    where the block's experts are stored float."""
    if f"{base}.gate_up_proj_blocks" not in tensors:
        return None
    layers = []
    for which in ("gate_up_proj", "down_proj"):
        names = [f"{base}.{which}_{part}" for part in ("blocks", "scales")]
        if names[1] not in tensors or names[0] not in tensors:
            raise QuantizationError(f"{base}: the MXFP4 checkpoint lacks {names[1]}")
        blocks, scales = tensors[names[0]], tensors[names[1]]
        want = tuple(getattr(experts, which).shape)  # [experts, out, in]
        if tuple(scales.shape) != (*want[:2], want[2] // BLOCK) or want[2] % BLOCK:
            raise QuantizationError(f"{names[1]} is {tuple(scales.shape)}: the model's {which} "
                                    f"{want} takes {(*want[:2], want[2] // BLOCK)}")
        bias = tensors.get(f"{base}.{which}_bias")
        order = torch.arange(want[1])
        if which == "gate_up_proj" and experts.interleaved_gate_up:  # -> [gate | up] rows
            order = torch.cat((order[0::2], order[1::2]))
        made = []
        for e in range(want[0]):  # one expert at a time: the codes' index tensor is 8 bytes a weight
            q, scale = dequantize(blocks[e, order], scales[e, order])
            made.append(GroupedInt8Linear(q, scale, None, BLOCK, None if bias is None else bias[e, order]))
        layers.append(made)
    return layers[0], layers[1]
