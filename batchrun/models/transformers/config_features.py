"""What a model's config says it has that the engine treats apart — sliding windows, chunked
attention, experts, soft-capping, MLA, sinks, indexed attention — as `models check` lists
them (check.py decides the path; this module words the features of the one it decided)."""

from __future__ import annotations

from batchrun.models.config.windows import config_layer_chunks, effective_window
from batchrun.models.transformers.indexed import dense_context, selects


def expert_counts(hf) -> tuple[int, int]:
    """(routed experts, experts per token) the config names; (0, 0) for a dense model."""
    experts = next((getattr(hf, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(hf, n, None)), 0)
    return experts, (getattr(hf, "num_experts_per_tok", None) or 0) if experts else 0


def features(hf, impl: str, lora: str) -> list[tuple[str, str]]:
    out = [("prefix caching", "yes"), ("chunked prefill", "yes"), ("LoRA", lora)]
    window = effective_window(hf)
    types = list(getattr(hf, "layer_types", None) or [])
    if window and window < getattr(hf, "max_position_embeddings", window + 1):
        sliding = types.count("sliding_attention") if types else hf.num_hidden_layers
        out.append(("sliding window", f"{window} tokens on {sliding} of {hf.num_hidden_layers} "
                                      f"layers (their KV kept over the window only)"))
    else:
        out.append(("sliding window", "no"))
    chunks = [c for c in config_layer_chunks(hf) if c]
    if chunks:
        out.append(("chunked attention", f"{chunks[0]} tokens on {len(chunks)} of "
                                         f"{hf.num_hidden_layers} layers (a query sees its own "
                                         f"chunk; their KV kept as over a window of as many)"))
    experts, per_token = expert_counts(hf)
    out.append(("MoE", f"{experts} experts, {per_token} per token" if experts else "no"))
    caps = [n for n in ("attn_logit_softcapping", "final_logit_softcapping")
            if getattr(hf, n, None)]
    if caps:
        out.append(("logit soft-capping", ", ".join(caps)))
    if getattr(hf, "qk_nope_head_dim", None) is not None:
        out.append(("MLA", "K/V expanded per head, the narrower zero-padded in the cache"))
    if getattr(hf, "model_type", "") == "gpt_oss":
        out.append(("attention sinks", "yes (in the engine's attention kernels)"))
    if dense_context(hf):
        out.append(("indexed (sparse) attention", f"run dense, which is exact up to the "
                    f"indexer's top-k ({dense_context(hf)} tokens): the context is capped there "
                    f"(the selection of {hf.model_type}'s indexer over longer contexts is not "
                    f"run yet)"))
    elif selects(hf):
        out.append(("indexed (sparse) attention", f"each query attends to its indexer's top-k "
                    f"({hf.index_topk} tokens) of the cache; the indexer's keys "
                    f"({hf.index_head_dim} wide) kept beside V; dense while every context is "
                    f"within the top-k"))
    return out
