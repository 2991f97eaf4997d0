"""Chat messages -> prompt token ids through the model's own chat template."""

from __future__ import annotations

from typing import Any, Literal, Sequence

from batchrun.openai.protocol import ChatMessage, RequestError

ContentFormat = Literal["string", "openai"]

_PROBE = "batchrun-probe-7f3a"
# Keyed by (id, template): tokenizers are not hashable, and a run holds one for its whole life.
_format_cache: dict[tuple[int, str], ContentFormat] = {}


def content_format(tokenizer: Any) -> ContentFormat:
    """Whether the template takes OpenAI content-part arrays or only strings.

    Found by rendering a text part once: templates written for strings either fail on a list
    (SmolLM2: `'...' + message['content']`) or print its repr instead of the text.
    """
    key = (id(tokenizer), getattr(tokenizer, "chat_template", None) or "")
    if key not in _format_cache:
        probe = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
        try:
            text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            ok = _PROBE in text and "'type'" not in text and '"type"' not in text
        except Exception:
            ok = False
        _format_cache[key] = "openai" if ok else "string"
    return _format_cache[key]


def _text_of_parts(parts: Sequence[Any], where: str) -> list[dict[str, str]]:
    texts = []
    for j, part in enumerate(parts):
        if part.type != "text":
            raise RequestError(
                f"{where}.{j}: content parts of type {part.type!r} are not supported: "
                "the loaded model takes text only", code="unsupported_content", param=f"{where}.{j}")
        texts.append({"type": "text", "text": part.text})
    return texts


def to_template_messages(messages: Sequence[ChatMessage], tokenizer: Any) -> list[dict[str, Any]]:
    fmt = content_format(tokenizer)
    template = getattr(tokenizer, "chat_template", None) or ""
    out = []
    for i, m in enumerate(messages):
        role = m.role
        # OpenAI's newer name for the system role; most templates only know "system".
        if role == "developer" and "developer" not in template:
            role = "system"
        content: Any = m.content
        if isinstance(content, list):
            parts = _text_of_parts(content, f"messages.{i}.content")
            content = parts if fmt == "openai" else "\n".join(p["text"] for p in parts)
        elif content is None and fmt == "string":
            content = ""  # an assistant turn that only made tool calls
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def render_prompt(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of the rendered conversation, ending with the assistant generation prompt."""
    template_messages = to_template_messages(messages, tokenizer)
    try:
        encoded = tokenizer.apply_chat_template(template_messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
    except Exception as exc:  # the template's own checks (role order, ...) raise many kinds
        raise RequestError(f"messages: the model's chat template rejected them: {exc}",
                           code="invalid_messages", param="messages") from None
    ids = encoded["input_ids"]
    return list(ids.tolist() if hasattr(ids, "tolist") else ids)
