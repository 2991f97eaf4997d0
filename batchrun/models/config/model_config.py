"""ModelConfig: the shape of a native decoder, read from its transformers config (llama.py's
architectures, and the shared readers the other native files build theirs with)."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.models.config.classifier import classifier_labels

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "LlamaForSequenceClassification", "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
}


def layer_windows(hf) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it (None: the whole context): the
    config's window on its `sliding_attention` layers, or on every layer without layer_types."""
    from batchrun.models.config.windows import effective_window

    window = effective_window(hf)
    if window is not None and window >= hf.max_position_embeddings:
        window = None  # no sequence is long enough for it to change anything
    types = getattr(hf, "layer_types", None)
    if types is None:
        return (window,) * hf.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hf_config: object  # the transformers config, kept for RoPE parameters
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: whole context)
    # A *ForSequenceClassification checkpoint's labels (its `score` head's outputs); 0: a causal LM.
    num_labels: int = 0
    qk_norm_across_heads: bool = False  # OLMoE: one q norm over all heads (and one over k's)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        require_architecture(hf, SUPPORTED_ARCHITECTURES, "LlamaForCausalLM")
        model_type = getattr(hf, "model_type", "llama")
        return cls(**swiglu_fields(hf),
                   qkv_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
                   qk_norm=model_type == "qwen3")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The layers' sliding windows for the KV groups (engine/kv_groups.py); () when none
        binds."""
        return self.windows if any(w is not None for w in self.windows) else ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def require_architecture(hf, supported: set[str], default: str) -> None:
    """ValueError unless `hf` lists one of the `supported` architectures (none listed: default)."""
    archs = set(getattr(hf, "architectures", None) or [default])
    if not archs & supported:
        raise ValueError(f"unsupported architecture {sorted(archs)}; this native model file "
                         f"runs {sorted(supported)}")


def shape_fields(hf, eps: str = "rms_norm_eps") -> dict:
    """The ModelConfig fields every decoder of this shape reads the same way from `hf` (`eps`:
    the attribute its norms' epsilon is read from)."""
    heads = hf.num_attention_heads
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=getattr(hf, eps),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        hf_config=hf,
        windows=layer_windows(hf),
        num_labels=len(classifier_labels(hf) or ()),
    )


def swiglu_fields(hf) -> dict:
    """shape_fields of a SwiGLU decoder; ValueError for another activation."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {hf.hidden_act!r} (SwiGLU/silu only)")
    return shape_fields(hf)
