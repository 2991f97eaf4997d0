"""ServedModel: what the OpenAI adapters, the batch runner and the server may ask of a loaded
model, written down once.

Three things implement it: batchrun.llm.LoadedModel (weights and engine in this process),
batchrun.distributed.client.RayModel (the tokenizer here, the engine on Ray replicas) and
TokenizerModel below (the tokenizer only: `batchrun plan`, `validate`, a sweep's request
files). tests/unit/test_served_model.py checks that all three satisfy it.

No torch here: the protocol and TokenizerModel load no model code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

from batchrun import __version__

if TYPE_CHECKING:
    from batchrun.engine.client import EngineClient
    from batchrun.options.engine import EngineConfig


@runtime_checkable
class ServedModel(Protocol):
    # Read-only properties: an implementation may hold them as attributes or properties.
    @property
    def name(self) -> str:
        """The served model name: responses carry it, a request's `model` may name it."""
        ...

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other names a request's `model` may use for this model."""
        ...

    @property
    def tokenizer(self) -> Any:
        """models.tokenizer.Tokenizer or a transformers tokenizer: encode, decode, chat template."""
        ...

    @property
    def max_model_len(self) -> int:
        """Context length in tokens: prompt plus generated tokens of one request at most."""
        ...

    @property
    def generation_defaults(self) -> Mapping[str, Any]:
        """Sampling defaults of the model's generation_config.json, under SamplingParams names."""
        ...

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters served on it (--lora NAME=PATH): a request's `model` may name one."""
        ...

    @property
    def path(self) -> Path | None:
        """The model folder (its sentence-transformers pooling config), None when not local."""
        ...

    @property
    def engine(self) -> EngineClient | None:
        """The engine client to run requests on; None for a tokenizer-only model."""
        ...

    @property
    def engine_config(self) -> EngineConfig | None:
        """The engine's configuration (KV cache, scheduler, LoRA); None for a tokenizer-only
        model."""
        ...

    @property
    def processor(self) -> Any:
        """A vision-language model's transformers processor (models/transformers/processor.py):
        renders chats with images; None for a text-only model."""
        ...

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """The ids that end a generation as the engine knows them; empty where the engine is
        elsewhere (then the tokenizer's EOS is the one to use)."""
        ...

    @property
    def hidden_size(self) -> int | None:
        """The width of the model's final hidden states (its embeddings' dimensions); None
        when unknown here."""
        ...

    @property
    def fingerprint(self) -> str:
        """The responses' system_fingerprint: the served name, batchrun's version and the
        engine configuration."""
        ...


def system_fingerprint(name: str, engine_config: object) -> str:
    """`fp_` and 12 hex digits of the model name, batchrun's version and the engine config."""
    digest = hashlib.sha256(f"{name}|{__version__}|{engine_config!r}".encode()).hexdigest()
    return f"fp_{digest[:12]}"


@dataclass(frozen=True)
class TokenizerModel:
    """A ServedModel without weights or engine: enough to validate, render and count the
    requests of a batch file."""

    tokenizer: Any
    name: str
    aliases: tuple[str, ...] = ()
    max_model_len: int = 2048
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()
    path: Path | None = None
    engine: None = None
    engine_config: None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_size: int | None = None
    processor: Any = None

    @property
    def fingerprint(self) -> str:
        return system_fingerprint(self.name, self.engine_config)
