"""response_format and forced tool calls -> the engine's GrammarSpec (checked before running)."""

from __future__ import annotations

import json
from typing import Any

from batchrun.engine import structured as engine_structured
from batchrun.engine.sampling_params import GrammarSpec
from batchrun.openai.parsers import ReasoningParser, ToolParser
from batchrun.openai.wire import RequestError
from batchrun.openai.requests import ResponseFormat


def _checked(spec: GrammarSpec, param: str, what: str) -> GrammarSpec:
    error = engine_structured.validate(spec)
    if error:
        raise RequestError(f"{param}: {what} cannot be used for constrained decoding: {error}",
                           code="invalid_value", param=param)
    return spec


def response_format_grammar(fmt: ResponseFormat | None) -> GrammarSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(json_schema={"type": "object"})
    assert fmt.json_schema is not None  # ResponseFormat requires it for json_schema
    schema = fmt.json_schema.json_schema
    if schema is None:
        # OpenAI requires a schema; an empty one would allow any JSON value.
        raise RequestError("response_format.json_schema.schema: a JSON schema is required",
                           code="missing_required_parameter",
                           param="response_format.json_schema.schema")
    # strict or not, the output is held to the schema: decoding cannot do "mostly".
    return _checked(GrammarSpec(json_schema=schema), "response_format.json_schema.schema",
                    "the schema")


def special_literal(tokenizer: Any):
    """Spells a marker as a grammar terminal: the tokenizer's special token if it has one (so
    the model may use the token it was trained on), else the quoted text."""
    import json

    added = {}
    try:
        added = tokenizer.get_added_vocab()
    except AttributeError:
        pass

    def literal(text: str) -> str:
        if text in added:
            return f"<[{added[text]}]>"
        return json.dumps(text)

    return literal


def tool_choice_grammar(parser: ToolParser, tools: list[dict[str, Any]], choice: Any,
                        parallel: bool, tokenizer: Any) -> GrammarSpec | None:
    """The grammar that forces a call under tool_choice `required` or a named function."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    else:
        name = choice.function.name
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise RequestError(f"tool_choice: no tool named {name!r} in tools",
                               code="invalid_value", param="tool_choice")
        parallel = False
    lark = parser.grammar(chosen, parallel, special_literal(tokenizer))
    return _checked(GrammarSpec(lark=lark), "tools", "the tools' parameter schemas")


def _answer_rule(spec: GrammarSpec) -> tuple[str, str]:
    """(rules, body): the constraint as a Lark expression `body` another grammar can embed,
    with the `rules` it needs."""
    rules = ""
    if spec.json_schema is not None:
        schema = spec.json_schema if isinstance(spec.json_schema, dict) else \
            json.loads(spec.json_schema)
        body = f"%json {json.dumps({**schema, 'x-guidance': engine_structured.JSON_OPTIONS})}"
    elif spec.regex is not None:
        body = "/" + spec.regex.replace("/", "\\/") + "/"
    else:  # our own grammars all open with their start rule
        assert spec.lark is not None and spec.lark.startswith("start:"), spec.lark
        rules, body = "answer" + spec.lark[len("start"):], "answer"
    return rules, body


def in_output_format(spec: GrammarSpec, parser: ToolParser, tokenizer: Any) -> GrammarSpec:
    """response_format's constraint where the parser's format puts the answer (Harmony: in the
    final channel, after an optional thought); unchanged where the answer is the raw output."""
    rules, body = _answer_rule(spec)
    lark = parser.answer_grammar(rules, body, special_literal(tokenizer))
    return spec if lark is None else GrammarSpec(lark=lark)


def after_reasoning(spec: GrammarSpec, reasoning: ReasoningParser) -> GrammarSpec:
    """The same constraint, applied only after the thought: `<think>…</think>` stays free text
    (optional for models that may skip it, required when the template opened it in the prompt),
    then the answer must match."""
    rules, body = _answer_rule(spec)
    end = json.dumps(reasoning.end)
    if reasoning.starts_in_prompt:
        thought, optional = f"/(.|\\n)*/ {end}", ""
    else:
        thought, optional = f"{json.dumps(reasoning.start)} /(.|\\n)*/ {end}", "?"
    return GrammarSpec(lark=f"start: (thought /[ \\t\\n]{{0,8}}/){optional} {body}\n"
                            f"thought[lazy]: {thought}\n{rules}")


def check_satisfiable(spec: GrammarSpec, ll_tokenizer: Any, param: str, what: str) -> None:
    """RequestError where no output can even start under the grammar with this tokenizer:
    llguidance compiles `{"$ref": "#"}` (a schema whose only value is itself) without complaint,
    then allows no first token, and the output would be whatever ends the sequence."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, engine_structured.grammar_text(spec),
                                   log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        reason = matcher.get_error().strip().splitlines()[0][:200]
        raise RequestError(f"{param}: {what} admits no output that constrained decoding can "
                           f"produce (a schema that only refers to itself, or one no value "
                           f"satisfies): {reason}", code="invalid_value", param=param)


def completes(spec: GrammarSpec, ll_tokenizer: Any, token_ids: list[int],
              eos_token_ids: set[int]) -> bool:
    """Whether the output (its trailing end-of-sequence tokens aside) is a complete sentence of
    the grammar: the engine ends a sequence whose grammar allows no next token, and that end
    must not read as a finished answer."""
    import llguidance

    ids = list(token_ids)
    while ids and ids[-1] in eos_token_ids:
        ids.pop()
    matcher = llguidance.LLMatcher(ll_tokenizer, engine_structured.grammar_text(spec),
                                   log_level=0)
    return bool(matcher.consume_tokens(ids)) and not matcher.is_error() and \
        matcher.is_accepting()
