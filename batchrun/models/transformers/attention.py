"""The attention function transformers' modelling code calls on this backend, registered under
the name "batchrun": it writes the layer's K/V into the engine's paged cache and attends over it.

The step's KV caches and metadata are not arguments transformers passes along, so the model's
forward sets them for the duration of the call (`step`); with several KV groups (a model of
full and sliding-window or chunked layers) each layer reads its group's metadata. Layers go
through the engine's `paged_attention` (the C kernels on the CPU), sliding-window, chunked
(layer_types' `chunked_attention`: Llama 4), soft-capped and attention-sink ones included, and steps whose image tokens attend both ways within an image
(the metadata's visible_until, which the C kernels read). Key and value head dims that
differ (MLA: DeepSeek-V2) are stored zero-padded to the wider one, and the output cut back.

A layer may call attention more than once per step (DiffLlama's differential attention: the
same keys with each half of the values): its n-th call of a step has a KV cache of its own,
cache `layer * calls_per_layer + n`, so no call overwrites the values another one reads later.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchrun.engine.attention import (AttentionMetadata, GroupedMetadata, layer_metadata,
                                       paged_attention)
from batchrun.engine.attention.selected import selected_attention
from batchrun.models.config.windows import layer_chunk
from batchrun.models.transformers import temperature
from batchrun.models.transformers.indexed import dense_mask, indexed, spread
from batchrun.models.transformers.support import UnsupportedModelError

NAME = "batchrun"
# The same attention with a mask of no effect that can be sliced (indexed.py: DeepSeek-V3.2's
# attention slices its mask for its indexer before calling attention)
INDEXED_NAME = "batchrun_indexed"


@dataclass
class Step:
    kv_caches: list
    meta: AttentionMetadata | GroupedMetadata | None  # None: a shape-only probe
    max_context: int  # the longest context in the step: windows at least this long change nothing
    # layer_idx -> (heads, KV heads, K head dim, V head dim), filled while probing a model
    shapes: dict[int, tuple[int, int, int, int]] | None = None
    windows: dict[int, int | None] | None = None  # layer_idx -> its sliding window (probing)
    # Attention calls of each layer per step (the probe counts them: `seen`); None while
    # probing, whose caches are fresh per call and indexed by layer.
    calls_per_layer: int | None = 1
    calls: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # layer_idx -> its calls so far
    bidirectional: bool = False  # a layer attends both ways (probing)
    # layer_idx -> its KV index where only some layers attend (a hybrid's: stateful.py); None:
    # the layer's own index
    layers: dict[int, int] | None = None
    # (KV heads, head dim) of the engine's cache, which layers of fewer KV heads or narrower
    # heads fit (MiMo-V2-Flash); None: each call's own (probing)
    kv_shape: tuple[int, int] | None = None
    # layer_idx -> the step's indexer keys [T, D] (indexed.py), which its V cache keeps
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)

    def peek_index(self, layer: int) -> int:
        """The KV cache of `layer`'s first attention call of the step (none made yet)."""
        if self.calls_per_layer is None:
            return layer
        return (layer if self.layers is None else self.layers[layer]) * self.calls_per_layer

    def cache_index(self, layer: int) -> int:
        """The KV cache of this call of `layer` (its first, second, ... of the step)."""
        n = self.seen.get(layer, 0)
        self.seen[layer] = n + 1
        if self.calls_per_layer is None:
            return layer
        if n >= self.calls_per_layer:
            raise RuntimeError(f"layer {layer} called attention {n + 1} times in one step; the "
                               f"probe saw {self.calls_per_layer}")
        return (layer if self.layers is None else self.layers[layer]) * self.calls_per_layer + n


_current: Step | None = None


@contextlib.contextmanager
def step(kv_caches, meta, max_context: int, shapes: dict | None = None,
         windows: dict | None = None, calls_per_layer: int | None = 1,
         layers: dict[int, int] | None = None, kv_shape: tuple[int, int] | None = None):
    global _current
    previous, _current = _current, Step(kv_caches, meta, max_context, shapes, windows,
                                        calls_per_layer, layers=layers, kv_shape=kv_shape)
    try:
        yield _current
    finally:
        _current = previous


def current_step() -> Step | None:
    """The batchrun step (or probe) running now, if any."""
    return _current


def step_positions(rows: int, device: torch.device) -> torch.Tensor:
    """The current step's positions of its `rows` flat rows (a family that computes its own
    position encoding inside attention reads them); 0.. in a shape-only probe, which has none."""
    if _current is not None and _current.meta is not None:
        return _current.meta.positions
    return torch.arange(rows, device=device)


def batchrun_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, softcap: float | None = None,
                       s_aux: torch.Tensor | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D(v)] -> ([1, T, H, Dv], None)."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedModelError(f"{type(module).__name__} has no layer_idx: the backend "
                                    f"cannot tell which layer's KV cache it reads")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    # the window of a family whose mask, not its attention call, applies it (WINDOW_FROM_MASK)
    sliding_window = sliding_window or getattr(module, "batchrun_window", None)
    if _current is not None and _current.meta is not None:
        q = temperature.tune(module, q, _current.meta.positions)
    out = attend_layer(layer, q, k, v, scaling, sliding_window, softcap, s_aux,
                       causal=getattr(module, "is_causal", True) is not False,
                       chunk=layer_chunk(getattr(module, "config", None), layer),
                       selected=kwargs.get("indices"))
    return out.unsqueeze(0), None


def attend_layer(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None,
                 alibi: torch.Tensor | None = None, causal: bool = True,
                 chunk: int | None = None, selected: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Layer `layer`'s attention on the step's paged cache (this call's KV cache: a layer that
    calls attention twice has two): q [T, H, D], k/v [T, Hkv, D(v)] -> [T, H, Dv]. alibi:
    ALiBi's per-head slopes [H] (a score gains slope * key position); chunk: the layer's
    attention chunk (a row at p sees p - p % chunk <= j <= p); selected [1, T, K]: the key
    positions each row attends to alone (an indexer's top-k: indexed.py; -1 none; K = 0:
    all)."""
    current = _current
    if current is None:
        raise RuntimeError("the batchrun attention function runs only inside a batchrun step")
    current.calls += 1
    index = current.cache_index(layer)
    dv = v.shape[-1]
    if current.shapes is not None:
        shape = (q.shape[1], k.shape[1], k.shape[2], dv)
        if current.shapes.setdefault(layer, shape) != shape:
            raise UnsupportedModelError(f"layer {layer}'s attention calls differ in shape "
                                        f"({current.shapes[layer]}, {shape}); the KV cache has one")
        current.bidirectional |= not causal
    if current.windows is not None:
        current.windows[layer] = window or None
    if current.kv_caches is None:  # a shape-only probe (check.shapes_from_config): no cache
        return q.new_zeros(q.shape[0], q.shape[1], dv)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    q, k, v = fit_cache(q, k, v, current.kv_shape)
    if layer in current.index_keys and current.kv_shape is not None:
        v = spread(v, current.index_keys[layer], dv)  # the indexer's keys beside V
    k_cache, v_cache = current.kv_caches[index]
    assert current.meta is not None  # a step with caches has its metadata
    meta = layer_metadata(current.meta, index)
    if selected is not None and selected.shape[-1]:
        return selected_attention(q.contiguous(), k, v, k_cache, v_cache, meta, scale,
                                  selected[0])[..., :dv]
    window = window if window and window < current.max_context else None
    chunk = chunk if chunk and chunk < current.max_context else None
    out = paged_attention(q.contiguous(), k, v, k_cache, v_cache, meta, scale,
                          window=window, softcap=softcap or None, sinks=sinks, alibi=alibi,
                          chunk=chunk)
    return out[..., :dv]


def fit_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_shape: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    """q, k, v shaped as the cache holds them: K and V heads zero-padded to the cache's head dim
    (zeros added to q and k leave the scores as they are; V's are cut from the output), and
    a layer's fewer KV heads each repeated as its query heads share it (a query head h reads KV
    head h // (H / Hkv) either way)."""
    heads, width = kv_shape or (k.shape[1], max(k.shape[-1], v.shape[-1]))
    if v.shape[-1] < width:
        v = F.pad(v, (0, width - v.shape[-1]))
    if k.shape[-1] < width:
        q, k = F.pad(q, (0, width - k.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
    if k.shape[1] < heads:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    return q, k, v


def implementation(config, text_config, name: str = NAME) -> str | dict:
    """What set_attn_implementation gets: `name` ("batchrun"; INDEXED_NAME for indexed
    attention) for a text model; for a vision-language model, `name` on its decoder's
    sub-config only, so the vision tower keeps its own (SDPA: its attention is per image,
    outside the KV cache)."""
    if name == NAME and indexed(text_config):
        name = INDEXED_NAME
    if text_config is config:
        return name
    for key in config.sub_configs:
        if getattr(config, key, None) is text_config:
            return {key: name}
    raise UnsupportedModelError(f"{config.model_type}: no sub-config holds its text config")


def no_mask(*args, **kwargs):
    """Transformers builds no attention mask: the paged attention knows each row's context."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, batchrun_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    AttentionInterface.register(INDEXED_NAME, batchrun_attention)
    AttentionMaskInterface.register(INDEXED_NAME, dense_mask)
