"""The checks a request's grammar sources get before it runs: a tool's parameter schema must
compile (each distinct schema compiled once), and a refusal names the field it came from."""

from __future__ import annotations

import functools
import json
from typing import Any

from batchrun.engine import structured as engine_structured
from batchrun.engine.sampling_params import GrammarSpec
from batchrun.openai.wire import RequestError


def grammar_param(request: Any, tool_grammar: GrammarSpec | None) -> tuple[str, str]:
    """(the field a grammar comes from, what it is) for a 400 that names it."""
    if tool_grammar is not None:
        return "tools", "the tools' parameter schemas"
    if request.response_format is not None and request.response_format.type == "json_schema":
        return "response_format.json_schema.schema", "the schema"
    return "response_format", "the format"


def check_tool_schema(parameters: dict[str, Any] | None, index: int) -> None:
    if parameters is None:
        return
    error = schema_error(json.dumps(parameters, sort_keys=True))
    if error:
        param = f"tools.{index}.function.parameters"
        raise RequestError(f"{param}: not a usable JSON schema: {error}", code="invalid_value",
                           param=param)


@functools.lru_cache(maxsize=1024)
def schema_error(schema: str) -> str | None:
    """Lines of a batch file mostly repeat the same tools: compile each schema once."""
    return engine_structured.validate(GrammarSpec(json_schema=schema))
