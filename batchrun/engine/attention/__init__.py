"""Attention over the paged KV cache: one backend per module (sdpa, cpu_kernel, cuda_triton),
each with its own metadata type built once per step from the runner's StepLayout; the engine's
backend is chosen once at start-up (registry.py). Model code calls `paged_attention` per layer;
`reference_attention` is the portable float path over any backend's metadata."""

from batchrun.engine.attention.base import (AttentionBackend, AttentionMetadata, BackendEnv,
                                            GroupedMetadata, StepLayout, layer_metadata)
from batchrun.engine.attention.reference import reference_attention
from batchrun.engine.attention.registry import BACKENDS, paged_attention, select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "BackendEnv", "GroupedMetadata",
           "StepLayout", "layer_metadata", "paged_attention", "reference_attention",
           "select_backend"]
