"""Chat messages (and tools) -> prompt token ids through the model's chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Sequence

import orjson

from batchrun.openai.parsers.harmony import is_harmony_template
from batchrun.openai.parsers.harmony_turns import harmony_turns
from batchrun.openai.wire import RequestError
from batchrun.openai.requests import ChatMessage

ContentFormat = Literal["string", "openai"]

_PROBE = "batchrun-probe-7f3a"
_PROBE_TOOL = {"type": "function", "function": {
    "name": "batchrun_probe_tool", "description": _PROBE,
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs.
_RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template",
                    "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
                    "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs"}
# Keyed by (id, template): tokenizers are not hashable, and a run holds one for its whole life.
_format_cache: dict[tuple[int, str], ContentFormat] = {}
_tools_cache: dict[tuple[int, str], bool] = {}
# A template that reads a turn's chain of thought from `thinking` (GPT-OSS's) rather than
# `reasoning_content` (Qwen3's, DeepSeek-R1's, GLM's).
_READS_THINKING = re.compile(r"""message\s*(\.\s*thinking\b|\[\s*['"]thinking['"]\s*\])|"""
                             r"""['"]thinking['"]\s+in\s+message\b""")


def load_chat_template(spec: str) -> str:
    """--chat-template: a file path, or a template given inline (it contains `{`)."""
    path = Path(spec).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # inline template text too long for a file name
        is_file = False
    if is_file:
        return path.read_text()
    if "{" in spec:
        return spec
    raise FileNotFoundError(f"chat template file not found: {spec}")


def _template_of(tokenizer: Any, override: str | None) -> str:
    return override or getattr(tokenizer, "chat_template", None) or ""


def content_format(tokenizer: Any, chat_template: str | None = None) -> ContentFormat:
    """Whether the template takes OpenAI content-part arrays or only strings.

    Found by rendering a text part once: templates written for strings either fail on a list
    (SmolLM2: `'...' + message['content']`) or print its repr instead of the text.
    """
    key = (id(tokenizer), _template_of(tokenizer, chat_template))
    if key not in _format_cache:
        probe = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
        try:
            text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False,
                                                 chat_template=chat_template)
            ok = _PROBE in text and "'type'" not in text and '"type"' not in text
        except Exception:
            ok = False
        _format_cache[key] = "openai" if ok else "string"
    return _format_cache[key]


def renders_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the template shows tools to the model: a probe tool must change the prompt."""
    key = (id(tokenizer), _template_of(tokenizer, chat_template))
    if key not in _tools_cache:
        probe = [{"role": "user", "content": "Hi"}]
        try:
            plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True,
                                                  tokenize=False, chat_template=chat_template)
            with_tools = tokenizer.apply_chat_template(
                probe, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False,
                chat_template=chat_template)
            _tools_cache[key] = plain != with_tools
        except Exception:
            _tools_cache[key] = False
    return _tools_cache[key]


def _text_of_parts(parts: Sequence[Any], where: str,
                   images: bool = False) -> list[dict[str, str]]:
    """The template's content parts; with `images`, an image_url part becomes {"type": "image"}
    (a processor's template puts its placeholder there)."""
    texts = []
    for j, part in enumerate(parts):
        if images and part.type == "image_url":
            texts.append({"type": "image"})
            continue
        if part.type != "text":
            raise RequestError(
                f"{where}.{j}: content parts of type {part.type!r} are not supported by this "
                "model (it takes text only)", code="unsupported_content", param=f"{where}.{j}")
        texts.append({"type": "text", "text": part.text})
    return texts


def _template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates expect arguments as a mapping (`arguments | tojson`); OpenAI sends JSON text."""
    out = []
    for call in calls:
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn = {**fn, "arguments": orjson.loads(fn["arguments"])}
            except json.JSONDecodeError:
                pass
            call = {**call, "function": fn}
        out.append(call)
    return out


def to_template_messages(messages: Sequence[ChatMessage], tokenizer: Any,
                         chat_template: str | None = None,
                         images: bool = False) -> list[dict[str, Any]]:
    """`images`: image_url parts become {"type": "image"} (for a vision-language model's
    processor, whose template takes content-part lists)."""
    fmt = "openai" if images else content_format(tokenizer, chat_template)
    template = _template_of(tokenizer, chat_template)
    reasoning_key = reasoning_field(template)
    out = []
    for i, m in enumerate(messages):
        role = m.role
        # OpenAI's newer name for the system role; most templates only know "system".
        if role == "developer" and "developer" not in template:
            role = "system"
        content: Any = m.content
        if isinstance(content, list):
            parts = _text_of_parts(content, f"messages.{i}.content", images)
            content = parts if fmt == "openai" else "\n".join(p["text"] for p in parts)
        elif content is None and fmt == "string":
            content = ""  # an assistant turn that only made tool calls
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = _template_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg[reasoning_key] = m.reasoning_content
        out.append(msg)
    return harmony_turns(out) if is_harmony_template(template) else out


def reasoning_field(template: str) -> str:
    """The message field the template reads an earlier turn's reasoning from."""
    if "reasoning_content" not in template and _READS_THINKING.search(template):
        return "thinking"
    return "reasoning_content"


def template_call_kwargs(tokenizer: Any, tools: list[dict[str, Any]] | None,
                         chat_template: str | None, continue_final_message: bool,
                         template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments for a request (RequestError for ones it may not
    set, or tools the template would not show)."""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise RequestError(f"chat_template_kwargs: {reserved[0]!r} cannot be set here",
                           code="invalid_value", param="chat_template_kwargs")
    if tools and not renders_tools(tokenizer, chat_template):
        raise RequestError(
            "tools: the model's chat template does not render tools, so the model would never "
            "see them; run with --chat-template FILE giving a template that renders tools "
            "(batchrun ships one: batchrun/openai/templates/chatml_tools.jinja)",
            code="tools_not_supported", param="tools")
    # Only what is set, so simple tokenizer stand-ins need not know every option.
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


def request_template_kwargs(request: Any) -> dict[str, Any] | None:
    """A chat request's chat_template_kwargs, with its `reasoning_effort` (GPT-OSS's template
    reads it) unless they set it themselves."""
    if request.reasoning_effort is None:
        return request.chat_template_kwargs
    return {"reasoning_effort": request.reasoning_effort, **(request.chat_template_kwargs or {})}


def render_prompt(tokenizer: Any, messages: Sequence[ChatMessage], *,
                  tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the rendered conversation, by default ending with the assistant prompt."""
    kwargs = template_call_kwargs(tokenizer, tools, chat_template, continue_final_message,
                                  template_kwargs)
    template_messages = to_template_messages(messages, tokenizer, chat_template)
    try:
        encoded = tokenizer.apply_chat_template(
            template_messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=True, **kwargs)
    except Exception as exc:  # the template's own checks (role order, ...) raise many kinds
        raise RequestError(f"messages: the model's chat template rejected them: {exc}",
                           code="invalid_messages", param="messages") from None
    ids = encoded["input_ids"]
    return list(ids.tolist() if hasattr(ids, "tolist") else ids)


def render_score_pair(tokenizer: Any, template: str, query: str, document: str) -> list[int]:
    """A /v1/score or /v1/rerank pair through a score template (--score-template): a chat of a
    `query` and a `document` message, as vLLM's score templates take it."""
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    try:
        encoded = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                return_dict=True)
    except Exception as exc:  # the template's own checks raise many kinds
        raise RequestError(f"the score template failed on this pair: {exc}",
                           code="invalid_value", param="documents") from None
    ids = encoded["input_ids"]
    return list(ids.tolist() if hasattr(ids, "tolist") else ids)


def tokenize_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """A /v1/completions text prompt, with the special tokens the tokenizer adds (e.g. BOS)."""
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return list(ids)
