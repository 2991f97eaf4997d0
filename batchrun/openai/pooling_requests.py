"""Request bodies of vLLM's pooling endpoints: /v1/classify, /v1/score and /v1/rerank.

    /v1/classify  {"input": str | [str] | [ids] | [[ids]], "use_activation"?: bool}
                  or {"messages": [...], "add_generation_prompt"?: false, ...} (the chat form)
    /v1/score     {"text_1" | "queries": str | [str], "text_2" | "documents": str | [str]}
    /v1/rerank    {"query": str, "documents": [str], "top_n"?: int, "return_documents"?: bool}

Strict about types and open to unknown fields (logged once), as the other request models are.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from batchrun.openai.requests import (MAX_EMBEDDING_INPUTS, PooledInput, StrictModel,
                                      warn_unknown_fields)

# Pairs one /v1/score or /v1/rerank request may score (each is its own engine request, or two
# for an embedding model): as many as /v1/embeddings' inputs.
MAX_SCORE_PAIRS = MAX_EMBEDDING_INPUTS
Texts = str | Annotated[list[str], Field(min_length=1)]


class _PoolingRequest(StrictModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    user: str | None = None
    # vLLM's: apply the head's activation (softmax, or sigmoid for one label); false: raw logits.
    use_activation: bool | None = None

    @property
    def stream(self) -> bool:  # what the adapter asks of every request
        return False

    def _warn(self) -> None:
        warn_unknown_fields(self, "the request body")


class ClassifyRequest(_PoolingRequest, PooledInput):
    """/v1/classify: each input (or the rendered `messages`) through the model's head."""

    @model_validator(mode="after")
    def _check(self) -> "ClassifyRequest":
        self.check_input()
        self._warn()
        return self


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class ScoreRequest(_PoolingRequest):
    """/v1/score: text_1 against text_2 (or vLLM's newer names, queries against documents).
    One text_1 is scored against every text_2; otherwise both lists pair up one to one."""
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None

    @model_validator(mode="after")
    def _check(self) -> "ScoreRequest":
        if (self.text_1 is None) == (self.queries is None):
            raise ValueError("text_1: give text_1 and text_2, or queries and documents")
        first, second = ("text_1", "text_2") if self.text_1 is not None \
            else ("queries", "documents")
        if getattr(self, second) is None:
            raise ValueError(f"{second}: required with {first}")
        left, right = self.pairs_of(getattr(self, first), getattr(self, second))
        if len(left) != len(right):
            raise ValueError(f"{second}: {len(right)} texts against {len(left)} {first} texts; "
                             f"give one {first} or as many as {second}")
        if len(right) > MAX_SCORE_PAIRS:
            raise ValueError(f"{second}: at most {MAX_SCORE_PAIRS} pairs per request, "
                             f"got {len(right)}")
        self._warn()
        return self

    @staticmethod
    def pairs_of(first: Any, second: Any) -> tuple[list[str], list[str]]:
        left, right = _as_list(first), _as_list(second)
        if len(left) == 1:
            left = left * len(right)
        return left, right

    @property
    def pairs(self) -> tuple[list[str], list[str]]:
        """(first texts, second texts), one pair per index."""
        if self.text_1 is not None:
            return self.pairs_of(self.text_1, self.text_2)
        return self.pairs_of(self.queries, self.documents)

    @property
    def second_field(self) -> str:
        return "text_2" if self.text_1 is not None else "documents"


class RerankRequest(_PoolingRequest):
    """/v1/rerank (Jina / Cohere style): documents ordered by their score against the query."""
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_SCORE_PAIRS)]
    top_n: int | None = Field(None, ge=0)  # 0 or absent: every document
    return_documents: bool = True

    @model_validator(mode="after")
    def _check(self) -> "RerankRequest":
        self._warn()
        return self

    @property
    def pairs(self) -> tuple[list[str], list[str]]:
        return [self.query] * len(self.documents), list(self.documents)

    @property
    def second_field(self) -> str:
        return "documents"
