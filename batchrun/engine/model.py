"""What the engine asks of the model it is handed.

`NativeModel` is every model object the engine runs (the native architectures of models/arch/
and the transformers backend's wrapper alike): one step's hidden states from the flat row of
tokens, logits (or a classifier's scores) from hidden states, and the shape the KV cache is laid
out from. A capability only some models have is a Protocol of its own (`TakesImages`), tested
with isinstance: the engine asks, never reaches in with getattr. The engine imports no model
definition; the models satisfy these structurally (tests/unit/test_model_protocol.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from batchrun.engine.attention.base import AttentionMetadata, GroupedMetadata
    from batchrun.engine.multimodal import MultiModalInputs, StepImages
    from batchrun.engine.state_slots import StateSpec, StepState


class ModelShape(Protocol):
    """The configuration fields the engine lays its KV cache and buffers out from."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@runtime_checkable
class NativeModel(Protocol):
    config: ModelShape
    num_labels: int  # a sequence classifier's labels; 0 for a causal LM

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata | GroupedMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] for one step's flat row of T tokens."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 next-token logits [N, vocab] of hidden states [N, hidden]."""
        ...

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 classifier scores [N, num_labels] (a model with num_labels > 0)."""
        ...


@runtime_checkable
class TakesImages(Protocol):
    """A vision-language model: places a prompt's images (their features, their token spans)
    before the prompt's first step."""

    def place_images(self, prompt: list[int], mm: MultiModalInputs) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata | GroupedMetadata,
                 images: Sequence[StepImages] = ()) -> torch.Tensor:
        """NativeModel's step, with the step's rows of images (StepImages) to encode."""
        ...


@runtime_checkable
class KeepsState(Protocol):
    """A model whose layers keep recurrent state (engine/state_slots.py): it declares one
    sequence's state, and each step reads and writes its sequences' slots (and, where
    state_spec.checkpoints says it can, the step's state checkpoints: state_checkpoints.py)."""

    state_spec: StateSpec

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata | GroupedMetadata,
                 state: StepState | None = None) -> torch.Tensor:
        """NativeModel's step, reading and updating the state of the step's sequences."""
        ...
