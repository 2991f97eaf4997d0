"""Pydantic models of OpenAI request bodies: /v1/chat/completions, /v1/completions and
/v1/embeddings.

Strict about types (`"max_tokens": "100"` is an error, as it is for OpenAI), value ranges as
OpenAI documents them, and open to unknown fields: each unknown field name is logged once, so
files written for OpenAI or vLLM still run. vLLM's extensions (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos, chat_template_kwargs, ...) are first-class fields.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

log = logging.getLogger(__name__)

_warned_fields: set[str] = set()
# ASCII digits only (str.isdigit() also takes "²"), and few enough for int() to be cheap.
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")

# The most alternatives a position can ask for: OpenAI's limit for /v1/completions `logprobs`,
# vLLM's default max_logprobs for `prompt_logprobs`.
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPT_LOGPROBS = 20


def warn_unknown_fields(model: BaseModel, where: str) -> None:
    for name in model.model_extra or ():
        key = f"{where}.{name}"
        if key not in _warned_fields:
            _warned_fields.add(key)
            log.warning("ignoring unsupported field %r in %s", name, where)


# What the engine can take: sampler seeds are 64-bit, token counts and ids 32-bit.
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
INT32_MAX = 2 ** 31 - 1
MAX_TOOLS = 128  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
# The smallest repetition_penalty: a logit of 100 divided by it stays far inside float32
# (vLLM asks only > 0, and 1e-300 turns every logit it touches into inf).
MIN_REPETITION_PENALTY = 0.01
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# OpenAI's metadata: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class StrictModel(BaseModel):
    """Base of the request models here and in responses_request.py: strict types, no coercion."""
    model_config = ConfigDict(strict=True)


class _Open(BaseModel):
    """A nested object whose unknown keys are ignored (OpenAI adds them over time)."""
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(StrictModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> "ContentPart":
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a 'text' string")
        return self


def _str_or_list(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


# Tagging the union by Python type makes a bad part report its own error instead of "input
# should be a valid string" from the other member.
Content = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[ContentPart], Tag("list")]],
    Discriminator(_str_or_list, custom_error_type="invalid_type",
                  custom_error_message="content must be a string or an array of content parts"),
]
Stop = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list")]],
    Discriminator(_str_or_list, custom_error_type="invalid_type",
                  custom_error_message="stop must be a string or an array of strings"),
]


class ChatMessage(StrictModel):
    # Assistant turns copied from earlier outputs carry fields such as `refusal`; ignore them.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier turn's chain of thought, under either name vLLM has given it (`reasoning` in
    # its newer responses); render.py hands it to the template under the name it reads.
    reasoning_content: str | None = Field(
        None, validation_alias=AliasChoices("reasoning_content", "reasoning"))


class FunctionDefinition(_Open):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: _FunctionName


class JsonSchemaFormat(_Open):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        return self


class StreamOptions(_Open):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _SamplingFields(StrictModel):
    """Fields both endpoints share."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stop: Stop | None = None
    seed: Int64 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    response_format: ResponseFormat | None = None
    # vLLM's extensions, which the engine supports as well.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    # Divides positive logits: below MIN_REPETITION_PENALTY they leave float32's range.
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=2)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    # vLLM's scoring extension: the logprob and rank of every prompt token plus the top k
    # alternatives at each prompt position (not with stream).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stop)}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {value}")
        return bias


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None
    # Given to the chat template as `reasoning_effort` (GPT-OSS's reads it; others ignore it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's chat extensions.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not supported with stream")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message: cannot be combined with "
                             "add_generation_prompt (set add_generation_prompt to false)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be an assistant "
                             "message to continue")
        warn_unknown_fields(self, "the request body")
        return self


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        if value and all(isinstance(v, list) for v in value):
            return "ids_list"
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "ids"
        return "strs"
    return None


Prompt = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("strs")],
          Annotated[list[int], Tag("ids")], Annotated[list[list[int]], Tag("ids_list")]],
    Discriminator(_prompt_kind, custom_error_type="invalid_type", custom_error_message=(
        "prompt must be a string, an array of strings, an array of token ids or an array of "
        "token id arrays")),
]


# Each prompt of a /v1/completions request is its own engine request: as many as one
# /v1/embeddings request may have inputs.
MAX_COMPLETION_PROMPTS = 2048


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    # 0 only to score the prompt (with echo or prompt_logprobs), as OpenAI allowed.
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt: must not be empty")
        many = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        if many and len(self.prompt) > MAX_COMPLETION_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_COMPLETION_PROMPTS} prompts per request, "
                             f"got {len(self.prompt)}")
        scores = self.echo or self.prompt_logprobs is not None
        if self.max_tokens == 0 and not scores:
            raise ValueError("max_tokens: 0 is only allowed with echo or prompt_logprobs "
                             "(scoring the prompt)")
        if self.echo and self.suffix:
            raise ValueError("suffix: cannot be combined with echo")
        if self.stream and scores:
            raise ValueError(f"{'echo' if self.echo else 'prompt_logprobs'}: not supported "
                             "with stream")
        warn_unknown_fields(self, "the request body")
        return self


# OpenAI's limits on one /v1/embeddings request: its inputs, and the tokens summed over them.
MAX_EMBEDDING_INPUTS = 2048
MAX_EMBEDDING_REQUEST_TOKENS = 300_000

EmbeddingInput = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("strs")],
          Annotated[list[int], Tag("ids")], Annotated[list[list[int]], Tag("ids_list")]],
    Discriminator(_prompt_kind, custom_error_type="invalid_type", custom_error_message=(
        "input must be a string, an array of strings, an array of token ids or an array of "
        "token id arrays")),
]


class PooledInput(StrictModel):
    """What /v1/embeddings and /v1/classify pool: `input` (texts or token ids), or vLLM's chat
    form, `messages` rendered with the model's chat template (no assistant prompt unless
    add_generation_prompt), one input."""
    input: EmbeddingInput | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_input(self) -> None:
        if self.messages is not None:
            if self.input is not None:
                raise ValueError("messages: give input or messages, not both")
            if self.add_generation_prompt and self.continue_final_message:
                raise ValueError("continue_final_message: cannot be combined with "
                                 "add_generation_prompt")
            return
        if self.input is None:
            raise PydanticCustomError("missing", "input: required (or messages, the chat form)")
        if isinstance(self.input, list):
            if len(self.input) == 0:
                raise ValueError("input: must not be empty")
            many = not isinstance(self.input[0], int)
            if many and len(self.input) > MAX_EMBEDDING_INPUTS:
                raise ValueError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, "
                                 f"got {len(self.input)}")


class EmbeddingRequest(PooledInput):
    """/v1/embeddings. `dimensions` keeps the first N values of each vector, renormalised."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None

    @property
    def stream(self) -> bool:  # what the adapter asks of every request
        return False

    @model_validator(mode="after")
    def _check(self) -> "EmbeddingRequest":
        self.check_input()
        warn_unknown_fields(self, "the request body")
        return self
