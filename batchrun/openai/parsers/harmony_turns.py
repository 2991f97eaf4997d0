"""Earlier turns of a chat shaped as GPT-OSS's chat template reads them (the prompt side of
Harmony; harmony.py reads the output).

The template writes an assistant turn that made a call as its thought on the analysis channel
(the `thinking` field, else `content`; left out once a later turn answered on the final channel),
then one call, `tool_calls[0]`, and it refuses a turn that has both `content` and `thinking`. It
addresses a tool result from the name of the latest call, not from the result's own fields. An
OpenAI-shaped history is reshaped to that:
- a call turn with a thought loses its `content` (a preamble, which Harmony writes on the
  commentary channel and the template has no place for; llama.cpp drops it too);
- a turn with several calls becomes one turn per call, the thought on the first;
- each result moves right after the call whose `id` its `tool_call_id` names, so it is addressed
  from that call (results that name no call stay after the turn's last call, in order).
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def harmony_turns(messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        i += 1
        calls = message.get("tool_calls")
        if message["role"] != "assistant" or calls is None:
            out.append(message)
            continue
        if not calls:  # an empty list: the template would read tool_calls[0]
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
            continue
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        out += _one_call_each(message, calls, results)
    return out


def _one_call_each(turn: Message, calls: list[dict], results: list[Message]) -> list[Message]:
    first = dict(turn)
    if first.get("thinking"):
        first["content"] = ""
    ids = [call.get("id") for call in calls]
    matched: dict[str, Message] = {}
    rest = []
    for result in results:
        key = result.get("tool_call_id")
        if key is not None and key in ids and key not in matched:
            matched[key] = result
        else:
            rest.append(result)
    out = []
    for k, call in enumerate(calls):
        base = first if k == 0 else {"role": "assistant", "content": ""}
        out.append({**base, "tool_calls": [call]})
        key = ids[k]
        if key is not None and key in matched:
            out.append(matched.pop(key))
    return out + rest
