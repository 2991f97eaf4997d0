"""Options of the OpenAI adapter (how requests become prompts and outputs become responses) and
the request defaults the user gives for fields a request leaves out."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from batchrun.openai.parsers import REASONING_PARSERS, TOOL_PARSERS
from batchrun.options.fields import option

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
ToolParserName = Literal[tuple(sorted(TOOL_PARSERS))]  # type: ignore[valid-type]
ReasoningParserName = Literal[tuple(sorted(REASONING_PARSERS))]  # type: ignore[valid-type]


class RequestDefaults(BaseModel):
    """Job spec table [defaults]."""

    model_config = _STRICT

    temperature: float | None = option(None, "Temperature for requests that leave it out.",
                                       ge=0, le=2)
    max_tokens: int | None = option(None, "max_tokens for requests that leave it out [default: "
                                    "fill the context].", ge=1)


class OpenAIOptions(BaseModel):
    model_config = _STRICT

    ignore_model_field: bool = option(False, "Run every request on the loaded model whatever its "
                                      "`model` field says (files written for another provider).")
    chat_template: str | None = option(
        None, "A Jinja chat template file overriding the model's (e.g. one that renders tools: "
        "batchrun/openai/templates/chatml_tools.jinja).", metavar="FILE")
    tool_parser: ToolParserName | None = option(
        None, "How tool calls are read from the output [default: from the chat template's "
        "markers].")
    reasoning_parser: ReasoningParserName | None = option(
        None, "Move <think>...</think> into message.reasoning_content [default: leave it in "
        "content].")

    def template_text(self) -> str | None:
        """The --chat-template file's text (read when called); OSError if it cannot be read."""
        from batchrun.openai.render import load_chat_template

        return load_chat_template(self.chat_template) if self.chat_template else None
