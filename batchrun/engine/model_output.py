"""What a forward pass hands back to the engine (engine/update.py applies it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchrun.engine.request import Request


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [N, V] for the N requests that sample, in `samplers` order
    samplers: list[Request] = field(default_factory=list)
    # Prompt entries computed this step: (request, first token scored, logprobs, ranks,
    # top ids, top logprobs) each.
    scored: list[tuple] = field(default_factory=list)
