"""What a request may ask of this engine, one small object per feature: each checks a new
request against what the engine serves (its adapters, its model's heads, its image support) and
refuses it with a ValueError saying why. Engine.add_request runs them in order; a feature that
brings a new request field adds its check here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from batchrun.engine.lora import AdapterSlots
from batchrun.engine.model import TakesImages
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.sampling_params import SamplingParams


class RequestCheck(Protocol):
    def check(self, prompt: Sequence[int], params: SamplingParams,
              multimodal: MultiModalInputs | None) -> None: ...


@dataclass
class LoraCheck:
    """A request's adapter must be one the engine serves."""

    adapters: AdapterSlots | None

    def check(self, prompt, params, multimodal) -> None:
        if params.lora is not None and (self.adapters is None or not self.adapters.known(params.lora)):
            raise ValueError(f"unknown LoRA adapter {params.lora!r}")


@dataclass
class PoolingCheck:
    """A pooling request is prefill-only, and reads a head the model has."""

    num_labels: int

    def check(self, prompt, params, multimodal) -> None:
        pooling = params.pooling
        if pooling is None:
            return
        if params.max_tokens != 0 or params.n != 1:
            raise ValueError("a pooling request is prefill-only: it needs max_tokens=0 and n=1")
        if pooling.head and not self.num_labels:
            raise ValueError("this model has no sequence-classification head")
        if pooling.token_ids and self.num_labels:
            raise ValueError("a sequence classifier has no LM head to read token logits from")


@dataclass
class ImagesCheck:
    """A request's images go to a model that takes them (placed now, by its place_images), and
    an image whose tokens attend both ways fits in one step's token budget."""

    model: object
    step_budget: int

    def check(self, prompt, params, multimodal) -> None:
        if multimodal is None:
            return
        if not isinstance(self.model, TakesImages):
            raise ValueError("this model takes text only; the request has images")
        self.model.place_images(list(prompt), multimodal)
        budget = self.step_budget
        if any(b - a > budget for a, b in multimodal.both_ways):
            raise ValueError(f"an image (or the prompt prefix over it) takes more tokens than a "
                             f"step computes (--max-num-batched-tokens {budget}), and this "
                             f"model's tokens there attend both ways: one step must hold them")
