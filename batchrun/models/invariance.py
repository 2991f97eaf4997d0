"""Which runs are batch-invariant: what --batch-invariant covers (refused by name where it does
not), and the runs that turn it on by themselves where it covers the model: the --quantization
methods that say so (methods.Method.invariant_by_default) and bfloat16 on a CPU with AMX."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from batchrun.options.engine import EngineConfig


def native_module_name(hf) -> str:
    from batchrun.models.arch import native

    return getattr(native.module_for(hf), "__name__", "")


def invariance_gap(config: EngineConfig, native_path: bool, native_module: str,
                   device: torch.device) -> str | None:
    """What --batch-invariant does not cover in this configuration (None: it covers it)."""
    from batchrun.models.quant import method

    return ("--quantization" if not method(config.device.quantization).batch_invariant else
            "--lora" if config.lora.adapters else
            "the transformers backend" if not native_path else
            # the experts' grouped GEMMs sum over however many rows an expert gets
            "mixture-of-experts models" if native_module.endswith((".moe", ".gpt_oss")) else
            # the delta rule's state is summed chunk by chunk: another prefill split, other bits
            "hybrid linear-attention models" if native_module.endswith(".qwen3_next")
            else "CUDA" if device.type != "cpu" else None)


def invariant_by_default(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """int8 (methods.Method.invariant_by_default), and bfloat16 on a CPU with AMX: there every
    linear runs on batchrun's bfloat16 GEMM, whose rows are invariant as they are
    (models/layers/bf16_gemm_linear.py), and the invariant attention cost 6% on the HumanEval
    chat and few-shot workloads (benchmarks/bench.py, batchrun[batch_invariant=true]), for
    answers that no longer move with the prefix cache (25 of sample_data/chat.jsonl's 30 the
    same with and without it before)."""
    from batchrun.models.quant import method

    how = method(config.device.quantization)
    return how.invariant_by_default or (
        not how.quantizes and dtype == torch.bfloat16 and device.type == "cpu" and bf16_tiles_expected())


def bf16_tiles_expected() -> bool:
    """Whether engine/kernels/bf16_gemm.c will multiply with AMX tiles here, known before the
    kernel library is built: the CPU has AMX-BF16, the kernels are on and BATCHRUN_SIMD does not
    cap them below."""
    from batchrun.engine import kernels
    from batchrun.models.quant.cpu import cpu_flags

    return kernels.enabled() and not kernels.simd_cap() and "amx_bf16" in cpu_flags()


def with_default_invariance(path: Path, config: EngineConfig, device: torch.device,
                            dtype: torch.dtype = torch.float32) -> EngineConfig:
    """config with batch_invariant on where the run is invariant by default
    (invariant_by_default) and --batch-invariant covers the model; where it does not, an int8
    load warns that answers may change with the batch and prefix-cache hits."""
    from batchrun.models.config.hf_config import read_config
    from batchrun.models.quant import method
    from batchrun.models.transformers.support import choose

    if config.batch_invariant or not invariant_by_default(config, device, dtype):
        return config
    hf = read_config(path, config.trust_remote_code)
    gap = invariance_gap(config, choose(hf, config.model_impl).impl == "native",
                         native_module_name(hf), device)
    if gap is None:
        return config.model_copy(update={"batch_invariant": True})
    if not method(config.device.quantization).invariant_by_default:
        return config  # bfloat16: a last-bit difference rarely moves a token, no warning
    logging.getLogger("batchrun").warning(
        "--quantization %s runs batch-invariant where it can, but not with %s: its int8 "
        "rounding can turn last-bit differences into other greedy tokens, so an answer may "
        "change with the batch it runs in and with prefix-cache hits",
        config.device.quantization, gap)
    return config


def check_batch_invariant(config: EngineConfig, native_path: bool, native_module: str,
                          device: torch.device | None = None) -> None:
    """UnsupportedModelError where --batch-invariant would promise what it does not cover."""
    from batchrun.models.transformers.support import UnsupportedModelError

    if not config.batch_invariant:
        return
    beside = invariance_gap(config, native_path, native_module, device or torch.device("cpu"))
    if beside:
        raise UnsupportedModelError(f"--batch-invariant does not cover {beside}: it runs the "
                                    "dense native models (Llama, Mistral, Qwen2, Qwen3, Phi-3, "
                                    "Gemma, StableLM) in float32, bfloat16 or --quantization int8 on the "
                                    "CPU, without LoRA")
