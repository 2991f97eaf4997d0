"""The engine's prompt entries -> OpenAI's and vLLM's scoring shapes.

- /v1/completions `echo` with `logprobs: N`: the legacy logprobs object covers the prompt tokens
  first (`token_logprobs` and `top_logprobs` are null for the first one), then the completion.
- vLLM's `prompt_logprobs: K`: one entry per prompt token (null first), each mapping token ids
  (as JSON keys) to {logprob, rank, decoded_token} for the actual token and the top K.
"""

from __future__ import annotations

from typing import Any

from batchrun.engine.outputs import PromptLogprobs
from batchrun.openai.logprobs import TokenText, floor


def echo_logprobs(pl: PromptLogprobs, texts: TokenText, top_n: int) -> dict[str, Any]:
    """The prompt's part of a legacy logprobs object; text offsets start at 0."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for j, tid in enumerate(pl.token_ids):
        token = texts.get(tid)[0]
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if j == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        logprob, alternatives = pl.logprob[j], pl.top[j]
        assert logprob is not None and alternatives is not None  # every entry after the first
        token_logprobs.append(floor(logprob))
        top: dict[str, float] = {}
        for t, lp in alternatives[:top_n]:
            top.setdefault(texts.get(t)[0], floor(lp))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def text_length(pl: PromptLogprobs, texts: TokenText) -> int:
    """Where the completion's text offsets continue after the echoed prompt's tokens."""
    return sum(len(texts.get(t)[0]) for t in pl.token_ids)


def vllm_prompt_logprobs(pl: PromptLogprobs, texts: TokenText, k: int) -> list[Any]:
    entries: list[Any] = [None]
    for j in range(1, len(pl.token_ids)):
        tid, logprob, alternatives = pl.token_ids[j], pl.logprob[j], pl.top[j]
        assert logprob is not None and alternatives is not None  # every entry after the first
        entry = {str(tid): {"logprob": floor(logprob), "rank": pl.rank[j],
                            "decoded_token": texts.get(tid)[0]}}
        for rank, (t, lp) in enumerate(alternatives[:k], 1):
            entry.setdefault(str(t), {"logprob": floor(lp), "rank": rank,
                                      "decoded_token": texts.get(t)[0]})
        entries.append(entry)
    return entries
