"""The scorers of batchrun sweep: each turns one generated choice of one dataset row into a
score, and the scores of all rows into named aggregates with their 95% CI.

A sweep spec lists scorer configs, each a table with a `type`; SCORER_SPECS is their pydantic
union (discriminated on type) and build(config) makes the Scorer. A scorer that cannot score a
row raises ScoreError: the sweep records the row's error and goes on. pass_at_k also has
score_many (a small pool of sandboxed processes); score_many() below uses it where there is one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Iterable, Union

from pydantic import Field, TypeAdapter

from .base import Example, ScoreError, Scorer, ScorerConfig
from .code import PassAtK, PassAtKConfig, ProgramResult, run_program
from .loglikelihood import LoglikelihoodChoice, LoglikelihoodChoiceConfig, pick
from .stats import mean_summary, pass_at_k, pass_at_k_summary, wilson
from .structured import JsonSchema, JsonSchemaConfig, Python, PythonConfig
from .text import (Choice, ChoiceConfig, Contains, ContainsConfig, ExactMatch, ExactMatchConfig,
                   Numeric, NumericConfig, Regex, RegexConfig, numbers)

SCORER_SPECS = Annotated[
    Union[ExactMatchConfig, ContainsConfig, RegexConfig, ChoiceConfig, NumericConfig,
          JsonSchemaConfig, PythonConfig, PassAtKConfig, LoglikelihoodChoiceConfig],
    Field(discriminator="type")]

_SCORERS: dict[str, Any] = {
    "exact_match": ExactMatch, "contains": Contains, "regex": Regex, "choice": Choice,
    "numeric": Numeric, "json_schema": JsonSchema, "python": Python, "pass_at_k": PassAtK,
    "loglikelihood_choice": LoglikelihoodChoice,
}
SCORER_TYPES = tuple(_SCORERS)

_ADAPTER: TypeAdapter = TypeAdapter(SCORER_SPECS)


def parse(table: dict[str, Any]) -> Any:
    """A scorer config from a spec's table (pydantic's ValidationError where it is wrong)."""
    return _ADAPTER.validate_python(table)


def build(config: Any, *, base_dir: Path | None = None) -> Scorer:
    """The Scorer of a config (a table is parsed first). base_dir: where a python scorer's
    relative 'file.py:function' is read from (the spec's folder; default: the working dir).
    A config that cannot work (a bad regex group, an unimportable function, an invalid
    schema) is a ValueError."""
    if isinstance(config, dict):
        config = parse(config)
    cls = _SCORERS[config.type]
    if cls is Python:
        return Python(config, base_dir=base_dir)
    return cls(config)


def check_names(scorers: Iterable[Scorer]) -> None:
    """ValueError where two scorers of a sweep share a name (give one `name = ...`)."""
    seen: set[str] = set()
    for s in scorers:
        if s.name in seen:
            raise ValueError(f"two scorers are named {s.name!r}: give one of them name = ...")
        seen.add(s.name)


def score_many(scorer: Scorer, items: Iterable[tuple[Example, str]]) -> list[float | ScoreError]:
    """Score (example, output) pairs: through the scorer's own score_many where it has one
    (pass_at_k: a process pool), else one by one. A row's ScoreError takes its score's place."""
    own = getattr(scorer, "score_many", None)
    if own is not None:
        return own(items)
    out: list[float | ScoreError] = []
    for example, output in items:
        try:
            out.append(scorer.score(example, output))
        except ScoreError as exc:
            out.append(exc)
    return out


__all__ = [
    "Example", "ScoreError", "Scorer", "ScorerConfig", "SCORER_SPECS", "SCORER_TYPES", "build",
    "parse", "check_names", "score_many", "ExactMatchConfig", "ContainsConfig", "RegexConfig",
    "ChoiceConfig", "NumericConfig", "JsonSchemaConfig", "PythonConfig", "PassAtKConfig",
    "LoglikelihoodChoiceConfig", "ExactMatch", "Contains", "Regex", "Choice", "Numeric",
    "JsonSchema", "Python", "PassAtK", "LoglikelihoodChoice", "pick", "numbers", "run_program",
    "ProgramResult", "mean_summary", "pass_at_k", "pass_at_k_summary", "wilson",
]
