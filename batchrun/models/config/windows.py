"""Sliding windows as a model's config describes them (the load-time probe reads the real ones)."""

from __future__ import annotations


def effective_window(hf) -> int | None:
    """The sliding window the model's attention applies (Qwen2 and its MoE set one they do not
    use)."""
    if getattr(hf, "model_type", "") in ("qwen2", "qwen2_moe", "qwen3_moe") and not getattr(hf, "use_sliding_window", False):
        return None
    return getattr(hf, "sliding_window", None)


def config_layer_windows(hf) -> tuple[int | None, ...]:
    """Each layer's sliding window as the config describes it (None: full attention); () when
    no window is shorter than the context. The probe at load reads the real ones."""
    window = effective_window(hf)
    longest = getattr(hf, "max_position_embeddings", None)
    if not window or (longest and window >= longest):
        return ()
    types = getattr(hf, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * hf.num_hidden_layers


def config_layer_chunks(hf) -> tuple[int | None, ...]:
    """Each layer's attention chunk (None: not chunked) where the config's layer_types name
    `chunked_attention` layers (Llama 4: a query at p sees p - p % chunk <= j <= p); () when
    none is shorter than the context."""
    chunk = getattr(hf, "attention_chunk_size", None)
    types = getattr(hf, "layer_types", None) or ()
    longest = getattr(hf, "max_position_embeddings", None)
    if not chunk or "chunked_attention" not in types or (longest and chunk >= longest):
        return ()
    return tuple(chunk if t == "chunked_attention" else None for t in types)


def layer_chunk(hf, layer: int) -> int | None:
    """Layer `layer`'s attention chunk as config_layer_chunks says (None: not chunked)."""
    chunks = config_layer_chunks(hf)
    return chunks[layer] if layer < len(chunks) else None
