"""The probe at load: a forward pass over a few tokens on fresh per-layer caches, which tells the
real attention shape of every layer (the KV cache is sized from it, not from config fields) and
checks that the wrapper's logits are transformers' own."""

from __future__ import annotations

import torch

from batchrun.engine.attention import AttentionMetadata, StepLayout
from batchrun.engine.attention.sdpa import SdpaBackend
from batchrun.models.transformers import attention
from batchrun.models.transformers.support import BOTH_WAYS, UnsupportedModelError

PROBE_IDS = [3, 5, 7, 11]


class _ProbeCaches:
    """Fresh KV caches of each layer's own shape, as the attention function reports it."""

    def __init__(self, shapes: dict, n: int, dtype: torch.dtype, device):
        self.shapes, self.n, self.dtype, self.device = shapes, n, dtype, device

    def __getitem__(self, layer: int):
        _, kv_heads, dk, dv = self.shapes[layer]
        shape = (self.n, kv_heads, max(dk, dv))
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))


def prefill_meta(n: int, device) -> AttentionMetadata:
    """The metadata of a step that is one fresh prompt of n tokens in slots 0..n-1."""
    return SdpaBackend(torch.float32).build(StepLayout.of([[0]], [0], [n], 0, n, device))


@torch.inference_mode()
def run(hf, fn, windows: dict | None = None, calls: dict | None = None):
    """fn(ids [1, n], positions [1, n]) over the probe tokens on the "batchrun" attention, and
    layer_idx -> (query heads, KV heads, K head dim, V head dim) as the layers attended;
    `windows` gets layer_idx -> the sliding window it attended with (None: full), `calls`
    layer_idx -> how many times it called attention."""
    device, dtype = hf.device, hf.dtype
    n = len(PROBE_IDS)
    shapes: dict = {}
    ids = torch.tensor([PROBE_IDS], device=device) % hf.config.get_text_config().vocab_size
    with attention.step(_ProbeCaches(shapes, n, dtype, device), prefill_meta(n, device), n,
                        shapes, windows, calls_per_layer=None) as current:
        out = fn(ids, torch.arange(n, device=device)[None])
    if calls is not None:
        calls.update(current.seen)
    check_attended(hf.config.model_type, current)
    return out, shapes


def check_attended(model_type: str, current: attention.Step) -> None:
    """UnsupportedModelError where a probe forward (`current`, its step) shows attention the
    backend cannot run: none through the "batchrun" function, or a layer attending both ways
    (the load's probe, and models check's without weights)."""
    if not current.calls:
        raise UnsupportedModelError(f"{model_type}: its attention does not go "
                                    f"through transformers' AttentionInterface")
    if current.bidirectional and model_type not in BOTH_WAYS:
        # (PaliGemma's layers say is_causal=False for their prefix, which its mask bounds:
        # vision.place_both_ways gives the engine that span)
        raise UnsupportedModelError(f"{model_type} attends bidirectionally (causal "
                                    f"decoders only)")


def check_logits(model, hidden: torch.Tensor) -> None:
    """model.compute_logits over the probe's final hidden states must equal transformers' own
    causal-LM forward (final soft-capping, logit scaling, ...); a sequence classifier's
    model.classify of the last position must equal its pooled logits."""
    hf = model.hf
    ref, _ = run(hf, lambda ids, pos: hf(input_ids=ids, position_ids=pos + model.position_offset,
                                         use_cache=False).logits[0].float())
    def agrees(ours):
        return torch.allclose(ours, ref, rtol=1e-3, atol=1e-3 * (1 + float(ref.abs().max())))

    with torch.inference_mode():
        ours = model.classify(hidden[-1:])[0] if model.num_labels else model.compute_logits(hidden)
        if not agrees(ours) and model.transforms and not model.num_labels:
            # a vision-language model's head may leave out its text config's transforms (Aya
            # Vision: Cohere's logit_scale belongs to Cohere's own causal-LM head)
            kept, model.transforms = model.transforms, []
            ours = model.compute_logits(hidden)
            if agrees(ours):
                return
            model.transforms = kept
    if not agrees(ours):
        head = "sequence-classification" if model.num_labels else "causal-LM"
        raise UnsupportedModelError(
            f"{hf.config.model_type}: its {head} head transforms the logits in a way the "
            f"backend does not reproduce (max difference {float((ours - ref).abs().max()):.3g})")
