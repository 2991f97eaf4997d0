"""The load check: before a model is served, a short random prompt runs through it as the engine
runs it (a chunked prefill, then decode steps, every step reading the paged KV cache the earlier
ones wrote, on the attention backend the engine picks) and its logits are compared with
transformers' own forward (its own attention, no cache) on the same weights. A model whose
logits differ beyond the dtype's tolerance is refused (LoadCheckError) with the largest
difference and where it first appears, never served wrong.

The reference is the caller's (models/transformers/model.py: the backend's own module with
transformers' eager attention; llm.py: a native model's checkpoint in transformers, cached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from batchrun.engine import kernels
from batchrun.engine.attention import BackendEnv, StepLayout, select_backend
from batchrun.engine.model import KeepsState
from batchrun.engine.state_slots import StepState, state_tensors

# The prompt: a prefill in two chunks (the second reads the first's cache), then decode steps.
CHUNKS = (7, 5, 1, 1, 1)
BLOCK_SIZE = 4  # blocks smaller than a chunk: reads and writes cross block boundaries
SEED = 41
# float32 agrees to rounding: max |Δlogit| at most FLOAT32_TOLERANCE of (1 + the reference's
# largest |logit|) (measured: under 1% of that on every tiny architecture). bfloat16, float16
# and quantized linears round every op through every layer (and a quantized model's int8
# activations round differently when the attention's last digits do), so there the judge is each
# position's RMS of Δlogit over the standard deviation of its logits: measured at most 0.08 on
# the tiny architectures in those modes, 1.3 for a cache that serves the wrong values.
FLOAT32_TOLERANCE = 2e-4
SPREAD_TOLERANCE = 0.25


class LoadCheckError(ValueError):
    """The model's logits on the engine differ from transformers' on the same weights (a
    ValueError: the command's usage exit, as the other load refusals)."""


@dataclass(frozen=True)
class Verdict:
    max_diff: float  # max |Δlogit| over every position
    spread: float  # the largest position's RMS of Δlogit over its logits' standard deviation
    rule: str  # what was judged, and its bound
    position: int  # the first position past the bound (-1: none)

    @property
    def agrees(self) -> bool:
        return self.position < 0


def prompt_ids(vocab_size: int, avoid: tuple = ()) -> torch.Tensor:
    """The check's prompt: sum(CHUNKS) fixed random ids above the usual special ids."""
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, vocab_size, (sum(CHUNKS),), generator=gen)
    for special in avoid:  # a pad id would change a classifier's pooled position
        if special is not None:
            ids[ids == special] = 3 if special != 3 else 4
    return ids


def step_layout(start: int, count: int, device) -> StepLayout:
    blocks = list(range(-(-sum(CHUNKS) // BLOCK_SIZE)))
    decode = 1 if count == 1 and start > 0 else 0
    return StepLayout.of([blocks], [start], [count], decode, BLOCK_SIZE, device)


def fresh_cache(model, tokens: int, device: torch.device, dtype: torch.dtype):
    """(the attention backend the engine would pick, zeroed paged KV caches of every layer for
    `tokens` tokens in BLOCK_SIZE blocks) for `model`."""
    cfg = model.config
    lib = kernels.library(kernels.shape_flags(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)) \
        if device.type == "cpu" and str(dtype) in kernels.KINDS and cfg.num_layers else None
    backend = select_backend(BackendEnv(device, dtype, dtype, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim, BLOCK_SIZE, lib))
    slots = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE
    caches = [tuple(torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                                device=device) for _ in range(2))
              for _ in range(cfg.num_layers)]
    return backend, caches


@torch.inference_mode()
def engine_hidden(model, ids: torch.Tensor, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """Final hidden states [T, hidden] of `ids` through `model` step by step (CHUNKS) on a fresh
    paged KV cache of its own shape, as the engine's runner would run them."""
    backend, caches = fresh_cache(model, sum(CHUNKS), device, dtype)
    # a model with recurrent state: one slot, carried from chunk to chunk (engine/state_slots.py)
    states = state_tensors(model.state_spec, 1, device) if isinstance(model, KeepsState) else None
    out, start = [], 0
    for count in CHUNKS:
        layout = step_layout(start, count, device)
        args = (ids[start:start + count].to(device), layout.positions, caches, backend.build(layout))
        out.append(model(*args) if states is None else
                   model(*args, state=StepState.of(states, [0], [start], [count], device)))
        start += count
    return torch.cat(out)


@torch.inference_mode()
def engine_logits(model, ids: torch.Tensor, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """float32 logits of every position [T, vocab] (a classifier: its scores of the last
    position [1, labels]) of `ids` on the engine's path."""
    hidden = engine_hidden(model, ids, device, dtype)
    if model.num_labels:
        return model.classify(hidden[-1:]).float()
    return model.compute_logits(hidden).float()


def exact(dtype: torch.dtype, quantized: bool) -> bool:
    """Whether the model computes in float32 throughout: judged by max |Δlogit|."""
    return dtype == torch.float32 and not quantized


def compare(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
            quantized: bool = False) -> Verdict:
    ref = ref.float().to(ours.device)
    diff = (ours - ref).abs()
    diff = torch.where(torch.isfinite(ours), diff, torch.full_like(diff, float("inf")))
    worst = diff.amax(-1)
    spread = diff.pow(2).mean(-1).sqrt() / ref.std(-1).clamp_min(1e-6) if ref.shape[-1] > 1 \
        else worst
    if exact(dtype, quantized):
        allowed = FLOAT32_TOLERANCE * (1 + float(ref.abs().max()))
        rule, bad = f"max |Δlogit| allowed {allowed:.3g}", (worst > allowed).nonzero()
    else:
        rule = f"RMS Δlogit / std(logits) allowed {SPREAD_TOLERANCE}"
        bad = (spread > SPREAD_TOLERANCE).nonzero()
    return Verdict(float(worst.max()), float(spread.max()), rule,
                   int(bad[0, 0]) if len(bad) else -1)


def where(position: int, rows: int) -> str:
    """Which step of the check's prompt a position of its logits belongs to."""
    if rows == 1:
        return "the last position"
    prefill = CHUNKS[0] + CHUNKS[1]
    if position < CHUNKS[0]:
        return f"position {position} (the prefill's first chunk)"
    if position < prefill:
        return f"position {position} (the prefill's second chunk, reading the first's KV cache)"
    return f"position {position} (a decode step, reading the KV cache)"


def verify(model, reference: Callable[[torch.Tensor], torch.Tensor], name: str,
           device: torch.device, dtype: torch.dtype, quantized: bool = False,
           locate: Callable[[torch.Tensor], str] | None = None) -> Verdict:
    """The check of `model` (named `name` in the error) against reference(ids [T]) -> float32
    logits as engine_logits gives them; LoadCheckError where they differ, naming the layer
    `locate(ids)` finds first differs (when given)."""
    cfg = model.config
    hf = getattr(cfg, "hf_config", None)
    avoid = (getattr(hf, "pad_token_id", None),) if model.num_labels else ()
    ids = prompt_ids(cfg.vocab_size, avoid)
    verdict = compare(engine_logits(model, ids, device, dtype), reference(ids), dtype, quantized)
    if not verdict.agrees:
        rows = 1 if model.num_labels else len(ids)
        layer = f"; {locate(ids)}" if locate is not None else ""
        mode = f"{str(dtype).removeprefix('torch.')}{', quantized' if quantized else ''}"
        raise LoadCheckError(
            f"{name}: the engine's logits differ from transformers' own forward on the same "
            f"weights (max |Δlogit| {verdict.max_diff:.3g}, RMS Δ / std {verdict.spread:.3g}; "
            f"{verdict.rule} in {mode}; first at {where(verdict.position, rows)}{layer}); "
            f"refusing to serve wrong output")
    return verdict
