"""The pydantic model of a /v1/responses request body (OpenAI's Responses API).

Only the body's shape is checked here (types, ranges, the fields batchrun cannot serve); the
mapping onto a chat request and back is in responses.py. Input items, tools and tool_choice stay
plain objects: responses.py checks them one by one so an error names the item
(`input.2.content.0.type`) rather than a pydantic union member.
"""

from __future__ import annotations

from typing import Any, Literal

import logging

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchrun.openai.requests import INT32_MAX, MAX_TOOLS, Metadata, StrictModel

log = logging.getLogger(__name__)
_warned: set[str] = set()

# Fields that need server-side state or work batchrun does not do: set, they are a 400.
# (background=false and store=false/true are fine; see ResponsesRequest.store.)
STATEFUL_FIELDS = ("previous_response_id", "conversation", "prompt")


class _Open(BaseModel):
    """A nested object whose unknown keys are ignored (OpenAI adds them over time)."""
    model_config = ConfigDict(strict=True, extra="ignore")


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema":
            if self.name is None:
                raise ValueError("name: a json_schema format needs a 'name'")
            if self.json_schema is None:
                raise ValueError("schema: a json_schema format needs a 'schema' object")
        return self


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Open):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(StrictModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None
    # OpenAI stores responses by default (store=true) so that previous_response_id and
    # GET /v1/responses/{id} can find them. batchrun keeps nothing: both values are accepted,
    # nothing is stored, and the Response says `store: false`.
    store: bool | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        extra = self.model_extra or {}
        for name in STATEFUL_FIELDS:
            if extra.get(name) is not None:
                raise ValueError(f"{name}: not supported (batchrun stores no responses or "
                                 "conversations; send the whole input)")
        if self.background:
            raise ValueError("background: background responses are not supported (use the "
                             "Batches API for work that should not hold a connection)")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input: must not be empty")
        for name in extra:
            if name not in _warned:
                _warned.add(name)
                log.warning("ignoring unsupported field %r in a /v1/responses body", name)
        return self
