"""What every scorer shares: the row it sees (Example), the error it raises where it cannot apply
(ScoreError), the Scorer protocol and the options every scorer config has (name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


@dataclass
class Example:
    """One dataset row as a scorer sees it. `reference` is row[spec.reference] (None where the
    spec names no reference column, or the row holds none there)."""

    id: str
    row: dict[str, Any] = field(default_factory=dict)
    reference: Any = None


class ScoreError(Exception):
    """This scorer cannot score this row (no reference, a missing column, a schema that is not
    one...). The sweep records the message as the row's error and goes on."""


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, example: Example, output: str) -> float:
        """The score of one generated choice (1.0/0.0 for pass/fail scorers)."""
        ...

    def summarize(self, per_example: list[list[float]]) -> dict[str, float]:
        """per_example[i]: the scores of example i's choices. Named aggregates with a 95% CI."""
        ...


class ScorerConfig(BaseModel):
    """The options every scorer has. Subclasses add `type: Literal[...]` and their own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="unique within a sweep; default: the type")

    @property
    def scorer_name(self) -> str:
        return self.name or self.type  # type: ignore[attr-defined]


def need_reference(example: Example, scorer: str) -> Any:
    if example.reference is None:
        raise ScoreError(f"{scorer}: row {example.id} has no reference")
    return example.reference


def column(example: Example, name: str, scorer: str) -> Any:
    if name not in example.row or example.row[name] is None:
        raise ScoreError(f"{scorer}: row {example.id} has no {name!r} column value")
    return example.row[name]
