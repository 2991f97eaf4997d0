"""The load check of a transformers-backend model (models/load_check.py) against transformers'
own forward of the very module the backend holds (no second copy of the weights): its decoder
switched to transformers' eager attention for the reference, then back to "batchrun".
"""

from __future__ import annotations

import contextlib

import torch

from batchrun.models import load_check
from batchrun.models.transformers import attention, inline, temperature


@contextlib.contextmanager
def own_attention(hf):
    """hf's decoder on transformers' eager attention for the duration (a family whose attention
    forwards the backend replaced: its own forwards, inline.suspended), with its own
    temperature tuning (temperature.py)."""
    text = hf.config.get_text_config()
    if inline.replaces(text):
        with inline.suspended(hf), temperature.restored(hf):
            yield
        return
    hf.set_attn_implementation(attention.implementation(hf.config, text, "eager"))
    try:
        with temperature.restored(hf):
            yield
    finally:
        hf.set_attn_implementation(attention.implementation(hf.config, text))


@torch.inference_mode()
def reference_logits(hf, ids: torch.Tensor, num_labels: int) -> torch.Tensor:
    """transformers' logits of `ids` (every position; a classifier's pooled [1, labels])."""
    with own_attention(hf):
        logits = hf(input_ids=ids[None].to(hf.device), use_cache=False).logits
    return (logits if num_labels else logits[0]).float()


def layer_outputs(layers, run) -> list[torch.Tensor]:
    """Each decoder layer's hidden-state output while run() runs, its calls joined along the
    sequence (the engine's steps come in chunks)."""
    seen: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(i):
        def record(module, args, out):
            hidden = out[0] if isinstance(out, (tuple, list)) else out
            seen[i].append(hidden.detach().reshape(-1, hidden.shape[-1]).float())
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(parts) if parts else torch.empty(0) for parts in seen]


def first_differing_layer(model, ids: torch.Tensor, tolerance: float) -> str:
    """Which decoder layer's output first differs between the engine's path and transformers'
    own forward, by more than `tolerance` of (1 + its largest value) ("" where none does)."""
    from batchrun.models.lora.targets import decoder_layers

    hf = model.hf
    try:
        _, layers = decoder_layers(hf, model.decoder, model.config.decoder_layers
                                   or model.config.num_layers)
    except ValueError:
        return ""
    device, dtype = hf.device, hf.dtype
    ours = layer_outputs(layers, lambda: load_check.engine_hidden(model, ids, device, dtype))
    ref = layer_outputs(layers, lambda: reference_logits(hf, ids, model.num_labels))
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a.shape != b.shape:
            continue
        diff = float((a - b).abs().max())
        if diff > tolerance * (1 + float(b.abs().max())):
            kind = type(getattr(layers[i], "self_attn", layers[i])).__name__
            return f"the first layer whose output differs: {i} ({kind}, max |Δ| {diff:.3g})"
    return ""


def check(model, name: str, quantized: bool = False) -> load_check.Verdict:
    """load_check.verify of the backend's `model` against its own module's forward."""
    hf = model.hf
    # a layer's output within rounding of float32, else within bfloat16's 3 digits, twice
    tolerance = load_check.FLOAT32_TOLERANCE if load_check.exact(hf.dtype, quantized) else 2e-2
    attention.register()
    return load_check.verify(
        model, lambda ids: reference_logits(hf, ids, model.num_labels), name, hf.device,
        hf.dtype, quantized, locate=lambda ids: first_differing_layer(model, ids, tolerance))
