"""batchrun's own model files, by model type: the one place a native architecture plugs in.

A native module exposes `ModelConfig` (`from_hf(hf)` raises ValueError saying what it cannot run),
the model class `Model` (built by llm.build_model: embed_tokens, lm_head, rope, load_weights,
cpu_kernels, forward(ids, positions, kv_caches, meta), compute_logits, lora_targets() for
LoRA: models/lora/targets.py) and
`unsupported(hf) -> str | None` for what from_hf accepts but the model would not run exactly.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from types import ModuleType
from typing import Protocol, runtime_checkable

NATIVE_MODULES = {
    "llama": "batchrun.models.arch.llama",
    "mistral": "batchrun.models.arch.llama",
    "qwen2": "batchrun.models.arch.llama",
    "qwen3": "batchrun.models.arch.llama",
    "qwen3_moe": "batchrun.models.arch.moe",
    "qwen2_moe": "batchrun.models.arch.moe",
    "mixtral": "batchrun.models.arch.moe",
    "olmoe": "batchrun.models.arch.moe",
    "gpt_oss": "batchrun.models.arch.gpt_oss",
    "phi3": "batchrun.models.arch.llama",
    "gemma": "batchrun.models.arch.gemma",
    "gemma2": "batchrun.models.arch.gemma",
    "gemma3_text": "batchrun.models.arch.gemma",
    "stablelm": "batchrun.models.arch.stablelm",
    "bloom": "batchrun.models.arch.bloom",
    "falcon": "batchrun.models.arch.falcon",
    "gpt_neo": "batchrun.models.arch.gpt_neo",
    "qwen3_next": "batchrun.models.arch.qwen3_next",
    "qwen3_5_text": "batchrun.models.arch.qwen3_next",
}


@runtime_checkable
class FromCheckpoint(Protocol):
    """A native model as llm loads it: the folder and files its float weights came from, which
    the calibrations (int8, fp8 KV scales) key their caches by."""

    checkpoint: tuple[Path, list[Path]]


def checkpoint_name(name: str, strip: str, inner: tuple[tuple[str, str], ...] = (),
                    prefixes: tuple[tuple[str, str], ...] = ()) -> str:
    """A checkpoint tensor's name as a native model names it: `strip` removed from its front,
    each `inner` part replaced, then the first matching `prefixes` entry swapped."""
    name = name.removeprefix(strip)
    for old, new in inner:
        name = name.replace(old, new)
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def module_for(hf) -> ModuleType | None:
    """The native module for `hf`'s model type (None: no native path)."""
    name = NATIVE_MODULES.get(getattr(hf, "model_type", "llama"))
    return None if name is None else importlib.import_module(name)


def native_module(hf) -> ModuleType:
    """module_for where the caller knows `hf` has a native path."""
    module = module_for(hf)
    if module is None:
        raise ValueError(f"no native model for model type {getattr(hf, 'model_type', 'llama')!r}")
    return module


def native_reason(hf) -> str | None:
    """Why no native model runs `hf` exactly (None: one does)."""
    module = module_for(hf)
    if module is None:
        return (f"model type {getattr(hf, 'model_type', 'llama')!r} (native: "
                f"{', '.join(sorted(NATIVE_MODULES))})")
    try:
        module.ModelConfig.from_hf(hf)
    except ValueError as exc:
        return str(exc)
    return module.unsupported(hf)


def architectures() -> list[str]:
    """The `architectures` names the native models run."""
    names: set[str] = set()
    for name in set(NATIVE_MODULES.values()):
        names |= importlib.import_module(name).SUPPORTED_ARCHITECTURES
    return sorted(names)


@contextlib.contextmanager
def no_init():
    """nn.Module constructors allocate their parameters without the random initialisation
    (every parameter is then overwritten, or never touched: the meta device)."""
    import torch

    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)
