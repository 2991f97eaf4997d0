"""Per-request generation parameters, as the engine understands them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.pooling import PoolingParams


@dataclass(frozen=True)
class GrammarSpec:
    """Constrained decoding: the output must match exactly one of these.

    json_schema: a JSON schema (dict or its JSON text); {"type": "object"} is "any JSON object".
    lark: a grammar in llguidance's Lark dialect (may embed `%json {...}` schemas).
    regex: a regular expression the whole output must match.
    """

    json_schema: dict[str, Any] | str | None = None
    lark: str | None = None
    regex: str | None = None

    def __post_init__(self):
        given = [x for x in (self.json_schema, self.lark, self.regex) if x is not None]
        if len(given) != 1:
            raise ValueError("a GrammarSpec takes exactly one of json_schema, lark, regex")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    # OpenAI's definitions over the generated tokens: logit -= frequency * count
    # + presence * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The CTRL / transformers definition over prompt and generated tokens: a seen token's logit
    # is divided by it when positive, multiplied when negative.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit
    seed: int | None = None
    # None = fill the context window (max_model_len - prompt length).
    max_tokens: int | None = None
    # EOS and stop_token_ids are masked out until this many tokens are generated.
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = also return the top-k alternatives
    # None = off; k = score every prompt token (its logprob and rank) and return the top-k
    # alternatives at each prompt position (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None
    # A prefill-only request (max_tokens=0) whose result is a pooled hidden-state vector
    # (engine/pooling.py); RequestOutput.embedding.
    pooling: PoolingParams | None = None
    # The LoRA adapter the request runs on, by the name it was registered under (--lora NAME=);
    # None = the base model (engine/lora.py).
    lora: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
