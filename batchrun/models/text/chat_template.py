"""Rendering a chat template with Jinja directly, as transformers' apply_chat_template renders it
(tokenize=False): the same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, a
`{% generation %}` block, `tojson` without HTML escaping, `raise_exception`, `strftime_now`), the
tokenizer's special tokens as variables, reasoning fields aliased, and continue_final_message
cut at the end of the final message. Without importing transformers (about a second and a half
of start-up). tests/unit/test_tokenizer_parity.py checks it against transformers. Renders are
bounded in time and size (batchrun.templating): a template that does not finish raises
RenderError, which the request's rendering turns into that line's error.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# A rendered conversation may be as long as the longest contexts (4M tokens or so); the time
# and every other limit are batchrun.templating's, as for a sweep's prompts.
RENDER_CHARS = 16 << 20
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    from batchrun.templating import ImmutableBoundedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask tags): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableBoundedEnvironment(chars=RENDER_CHARS, wrap_errors=False, trim_blocks=True,
                                      lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """What the template may see: JSON-like data only (a pydantic model becomes its dump)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if isinstance(value, tuple) else [
            _plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: dict) -> dict:
    """A message as apply_chat_template hands it on: None values dropped, reasoning aliased."""
    message = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render(template: str, messages: list[dict], special_tokens: dict[str, Any], *,
           tools: list[dict] | None = None, add_generation_prompt: bool = False,
           continue_final_message: bool = False, **kwargs: Any) -> str:
    """The conversation rendered to text."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    chat = [_message(m) for m in messages]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if final is None:
            raise ValueError('continue_final_message is set but the final message has no '
                             '"content" to continue!')
        if "content" not in template:
            raise ValueError('continue_final_message is set to "content" but this is not an '
                             'accepted field in the chat_template')
        if isinstance(final, list):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text "
                                 "to continue in the final message!")
        else:
            chat[-1]["content"] = final + _CONTINUE_TAG
    variables = {**special_tokens, **_plain(kwargs)}
    text = compile_template(template).render(messages=chat, tools=_plain(tools), documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **variables)
    if continue_final_message:
        assert final is not None  # checked above
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the final message does not "
                             "appear in the chat after applying the chat template!")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
