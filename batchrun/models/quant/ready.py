"""A native model's linears and CPU kernels made ready for the engine once its weights are in:
what loading (llm.build_model) and the plan's calibration benchmark (a random-weight copy) both
do, so the model the plan measures is the model a run computes with."""

from __future__ import annotations

import torch
from torch import nn

from batchrun.models.quant.methods import Method


def ready_linears(model: nn.Module, how: Method, pack_float: bool, float32_logits: bool,
                  batch_invariant: bool = False) -> None:
    """Pack (pack_float: oneDNN's float layout) or quantize the model's linears by `how`. Where
    the model runs in bfloat16 on the CPU kernels (float32_logits) the logits come out in float32
    (models/layers/bf16_logits.py) and an unquantized model's linears are made for batchrun's
    bfloat16 GEMM (models/layers/bf16_gemm_linear.py; attach_cpu_kernels hands them to oneDNN
    where the CPU has no AMX). With batch_invariant every other linear runs on fixed-size row
    slices (models/layers/fixed_rows.py)."""
    from batchrun.models.layers import bf16_gemm_linear, bf16_logits
    from batchrun.models.quant import replace_linears

    if pack_float or how.quantizes or batch_invariant or float32_logits:
        if model.lm_head is None and not getattr(model, "num_labels", 0):
            # a linear (packed) over the tied embeddings for the logits (a classifier has none)
            embed = model.embed_tokens.weight
            model.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
            model.lm_head.weight = model.embed_tokens.weight
        if float32_logits:
            bf16_logits.use_float32_logits(model)
            if not how.quantizes:
                bf16_gemm_linear.use_for_linears(model)
        replace_linears(model, how, pack_float)
    if batch_invariant:
        from batchrun.models.layers.fixed_rows import fix_rows

        fix_rows(model)


def attach_cpu_kernels(model: nn.Module, kernels, quantized: bool, batch_invariant: bool = False) -> None:
    """The CPU kernel library on the model, its bfloat16 GEMM layers (the float32 logits layer
    among them) and (quantized: some linears are models/quant/ modules) its quantized layers."""
    from batchrun.models.layers import bf16_gemm_linear, packed_linear

    model.cpu_kernels = kernels
    bf16_gemm_linear.attach_all(model, kernels, packed_linear.PackedLinear, keep_without_amx=batch_invariant)
    if quantized:
        from batchrun.models.quant.int8_linear import attach_kernels

        attach_kernels(model, kernels)


def uses_float32_logits(kernels_present: bool, dtype: torch.dtype) -> bool:
    """A bfloat16 model on the CPU kernels computes its logits in float32 (bf16_logits.py)."""
    return kernels_present and dtype == torch.bfloat16
