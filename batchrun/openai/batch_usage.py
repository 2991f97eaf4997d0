"""A batch's token usage: the sum of its output records' `usage`, in the Batch object's shape.

Each endpoint reports usage its own way (chat and completions: prompt/completion tokens;
embeddings: prompt tokens only; responses: input/output tokens); a batch sums them into
OpenAI's BatchUsage (input/output tokens, cached and reasoning details, total).
"""

from __future__ import annotations

from typing import Any, Iterable


def empty_usage() -> dict[str, Any]:
    return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0}


def add_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> None:
    """Add one response body's `usage` (of any endpoint) to `total` (an empty_usage())."""
    if not isinstance(usage, dict):
        return
    if "input_tokens" in usage:  # /v1/responses
        inputs, outputs = usage.get("input_tokens"), usage.get("output_tokens")
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens")
    else:  # chat, completions, embeddings
        inputs, outputs = usage.get("prompt_tokens"), usage.get("completion_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    inputs, outputs = _count(inputs), _count(outputs)
    total["input_tokens"] += inputs
    total["output_tokens"] += outputs
    total["total_tokens"] += inputs + outputs
    total["input_tokens_details"]["cached_tokens"] += _count(cached)
    total["output_tokens_details"]["reasoning_tokens"] += _count(reasoning)


def batch_usage(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a batch from its output records ({"response": {"body": {"usage": ...}}})."""
    total = empty_usage()
    for record in records:
        body = ((record.get("response") or {}).get("body")) if isinstance(record, dict) else None
        if isinstance(body, dict):
            add_usage(total, body.get("usage"))
    return total


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
