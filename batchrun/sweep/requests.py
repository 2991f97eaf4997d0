"""A model's share of a sweep as one OpenAI batch file: a chat request per cell x example for
the generating scorers, and, for loglikelihood_choice, one scoring request per example x choice
x prompt variant (shared by every cell of that variant: sampling settings do not change a
log-probability, so it is computed once).

custom_ids: `<cell>/<example id>` for a generation, `ll/<variant>/<example id>/<choice>` for a
choice's log-probability.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchrun.batch.storage.parquet import image_parts
from batchrun.openai.wire import RequestError
from batchrun.sweep.cells import Cell
from batchrun.sweep.dataset import Template
from batchrun.sweep.scorers import Example, ScoreError
from batchrun.sweep.spec import SpecError
from batchrun.templating import RenderError


@dataclass
class ModelRequests:
    lines: list[str] = field(default_factory=list)
    # custom_id -> the context's token count of a loglikelihood request
    context_tokens: dict[str, int] = field(default_factory=dict)
    # (custom_id or cell/example, message): rows whose prompt could not be rendered
    errors: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # every body's `model` (a LoRA adapter's name); None = left out

    def add(self, custom_id: str, url: str, body: dict[str, Any]) -> None:
        if self.model is not None:
            body = {"model": self.model, **body}
        self.lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                                      "body": body}, ensure_ascii=False))


def with_images(messages: list[dict[str, Any]], cell: Any) -> list[dict[str, Any]]:
    """`messages` with the images of a dataset cell after the last user message's text (a new
    user message when there is none); RequestError for a cell that holds no image."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    out = [dict(m) for m in messages]
    if not users:
        return out + [{"role": "user", "content": image_parts(cell)}]
    last = users[-1]
    out[last]["content"] = [{"type": "text", "text": out[last]["content"]}] + image_parts(cell)
    return out


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """(the tokens of context + continuation, how many of them are the context's), split as
    lm-eval does: trailing spaces of the context move to the continuation, the whole is encoded
    at once and the context is its first len(encode(context)) tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return whole, len(tokenizer.encode(context, add_special_tokens=False))


def build(cells: list[Cell], examples: list[Example], templates: dict[str, Template],
          generate: bool, choice_scorers: list[Any], tokenizer: Any,
          endpoint: str = "chat", adapter: str | None = None,
          image: str | None = None) -> ModelRequests:
    """The requests of `cells` (all of one model). `choice_scorers`: the loglikelihood_choice
    scorers (the first one's choices are asked; scorers of a sweep share its dataset).
    `adapter`: the LoRA adapter the cells' model is, named in every body. `image`: the column
    whose images follow the last user message's text."""
    out = ModelRequests(model=adapter)
    if generate:
        for cell in cells:
            template = templates[cell.prompt]
            for ex in examples:
                key = f"{cell.id}/{ex.id}"
                try:
                    rendered = template.render(ex.row)
                except RenderError as exc:
                    out.errors[key] = f"the prompt cannot be rendered for this row: {exc}"
                    continue
                if endpoint == "completions":
                    if image is not None:
                        raise SpecError("[dataset] image needs endpoint = \"chat\"")
                    if not isinstance(rendered, str):
                        raise SpecError("endpoint = \"completions\" sends a text prompt: give "
                                        "[dataset] prompt (not messages)")
                    out.add(key, "/v1/completions", {"prompt": rendered, **cell.sampling})
                    continue
                messages = rendered if isinstance(rendered, list) else \
                    [{"role": "user", "content": rendered}]
                if image is not None and ex.row.get(image) is not None:
                    try:
                        messages = with_images(messages, ex.row[image])
                    except RequestError as exc:
                        out.errors[key] = exc.message
                        continue
                out.add(key, "/v1/chat/completions", {"messages": messages, **cell.sampling})
    if choice_scorers:
        for variant in sorted({c.prompt for c in cells}):
            template = templates[variant]
            for ex in examples:
                try:
                    context = template.render(ex.row)
                except RenderError as exc:
                    out.errors[f"ll/{variant}/{ex.id}"] = f"the prompt cannot be rendered: {exc}"
                    continue
                if not isinstance(context, str):
                    raise SpecError("loglikelihood_choice scores a text prompt: give "
                                    "[dataset] prompt (not messages)")
                try:
                    continuations = choice_scorers[0].continuations(ex)
                except ScoreError as exc:
                    out.errors[f"ll/{variant}/{ex.id}"] = str(exc)
                    continue
                for j, continuation in enumerate(continuations):
                    key = f"ll/{variant}/{ex.id}/{j}"
                    ids, n_context = encode_pair(tokenizer, context, continuation)
                    out.context_tokens[key] = n_context
                    out.add(key, "/v1/completions", {"prompt": ids, "max_tokens": 0,
                                                     "echo": True, "logprobs": 0,
                                                     "temperature": 0})
    return out
