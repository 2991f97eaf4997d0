"""Load a model by name or path and build an engine around it (API skeleton; lands with the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun.config import EngineConfig
from batchrun.engine.engine import Engine


@dataclass
class LoadedModel:
    engine: Engine
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str  # served model name, e.g. "smollm2-135m"
    aliases: tuple[str, ...]
    # Sampling defaults from the model's generation_config.json, only the fields it sets:
    # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def load(model: str | None, config: EngineConfig | None = None) -> LoadedModel:
    """Resolve `model` (registry name, HF folder, .gguf, hub id; None = default) and start an engine."""
    raise NotImplementedError
