"""Families whose attention classes compute attention inline instead of calling transformers'
AttentionInterface (BLOOM, Falcon, GPT-Neo, OpenAI-GPT, MPT, XGLM, TrOCR's decoder,
GPT-NeoX-Japanese, Megatron-BERT and RoFormer as decoders): the backend replaces each attention
module's forward, on the loaded model's own instances, with one that computes q/k/v with the
module's own projections, applies the family's positional scheme (its RoPE, ALiBi's slopes,
GPT-Neo's local windows) and attends on the engine's paged cache (attention.attend_layer).
Only self-attention is replaced: a decoder's cross-attention modules (of the same class in
XGLM, TrOCR, Megatron-BERT) run only with encoder states, which a causal LM is not given.

Such a model loads with transformers' "eager" attention (the only implementation some of
these families' class tables hold), and then its config names the "batchrun" attention, so
the masks transformers builds per step are none (attention.no_mask): the paged attention
knows each row's context.
"""

from __future__ import annotations

import contextlib
from types import MethodType
from typing import Any, Callable

from batchrun.models.transformers.inline import families, fairseq
from batchrun.models.transformers.inline.gpt_neox_japanese import gpt_neox_japanese_forward
from batchrun.models.transformers.inline.megatron_bert import megatron_bert_forward
from batchrun.models.transformers.inline.roformer import install_roformer_positions, roformer_forward
from batchrun.models.transformers.support import INLINE_ATTENTION

# model_type -> our forward for the attention class support.INLINE_ATTENTION names
FORWARDS: dict[str, Callable[..., Any]] = {
    "bloom": families.bloom_forward,
    "falcon": families.falcon_forward,
    "gpt_neo": families.gpt_neo_forward,
    "openai-gpt": families.openai_gpt_forward,
    "mpt": families.mpt_forward,
    "xglm": fairseq.fairseq_forward,
    "trocr": fairseq.fairseq_forward,
    "gpt_neox_japanese": gpt_neox_japanese_forward,
    "megatron-bert": megatron_bert_forward,
    "roformer": roformer_forward,
}
assert set(FORWARDS) == set(INLINE_ATTENTION)
# Families whose decoder uses the mask it builds (MPT casts it): they keep transformers' eager
# mask, which their replaced attention ignores.
KEEPS_MASK = {"mpt"}
# Where cross-attention modules of the replaced class sit (left as they are).
CROSS_ATTENTION = ("encoder_attn", "crossattention")


def replaces(config) -> bool:
    """Whether the model of `config` (a text config) runs on replaced attention modules."""
    return getattr(config, "model_type", None) in FORWARDS


def load_implementation(config, name: str) -> str:
    """The attn_implementation to load a model of `config` with: `name` (the "batchrun"
    attention), or "eager" for the families whose attention this module replaces."""
    return "eager" if replaces(config.get_text_config()) else name


def install(hf, name: str) -> None:
    """Replace the forward of each of `hf`'s attention modules of its family, numbering them
    in order as the layers whose KV cache they read; its config then names attention `name`
    (its masks none), except where KEEPS_MASK keeps them."""
    model_type = hf.config.get_text_config().model_type
    class_name, forward = INLINE_ATTENTION[model_type], FORWARDS[model_type]
    layer = 0
    for name, module in hf.named_modules():
        if type(module).__name__ == class_name and type(module).__module__.startswith(
                "transformers.models.") and not any(c in name for c in CROSS_ATTENTION):
            module.batchrun_layer = layer
            module.batchrun_replaced = True
            module.forward = MethodType(forward, module)
            layer += 1
    if model_type == "trocr":
        fairseq.install_trocr_positions(hf)
    if model_type == "roformer":
        install_roformer_positions(hf)
    if model_type not in KEEPS_MASK:
        hf.config._attn_implementation = name


@contextlib.contextmanager
def suspended(hf):
    """transformers' own attention forwards for the duration (the load check's reference, the
    int8 calibration), on the implementation transformers picks by default (SDPA where the
    class has it: Falcon's eager and SDPA paths scale ALiBi differently, and generate runs
    SDPA), the replaced ones back afterwards; nothing where none were replaced."""
    replaced = [m for m in hf.modules() if "forward" in vars(m) and hasattr(m, "batchrun_replaced")]
    saved = [vars(m).pop("forward") for m in replaced]
    implementation = hf.config._attn_implementation
    if replaced:  # what transformers loads it with by default (Falcon's ALiBi differs between)
        hf.config._attn_implementation = "sdpa" if getattr(hf, "_supports_sdpa", False) else "eager"
    try:
        yield
    finally:
        for module, forward in zip(replaced, saved):
            module.forward = forward
        hf.config._attn_implementation = implementation
