"""loglikelihood_choice: multiple choice by the model's log-likelihood of each choice, lm-eval's
acc (normalize = "none") and acc_norm (normalize = "length").

The request side is the sweep runner's: for each choice it asks the engine for the summed
log-probability of the continuation `target_delimiter + choice` after the prompt (lm-eval's
default delimiter is one space). `pick` then takes the argmax, of the log-likelihoods
themselves (acc), or of each divided by the choice's length in characters (acc_norm: the
length of the choice text without the delimiter, as lm-eval's process_results measures it), or
in UTF-8 bytes (acc_bytes). Ties go to the first choice (numpy's argmax). The scorer's output
is the picked index as a string; the score is 1.0 where it is the gold index (or one of them).
"""

from __future__ import annotations

from numbers import Integral
from typing import Literal, Sequence

from pydantic import Field, model_validator

from .base import Example, ScoreError, ScorerConfig, column, need_reference
from .stats import mean_summary

Normalize = Literal["none", "length", "bytes"]


def pick(logprobs: Sequence[float], choices: Sequence[str], normalize: Normalize = "none") -> int:
    """The index of the chosen choice: argmax of logprobs (none), of logprobs / len(choice)
    (length) or of logprobs / len(choice in UTF-8) (bytes); the first of equal ones."""
    if len(logprobs) != len(choices) or not choices:
        raise ValueError(f"pick: {len(logprobs)} logprobs for {len(choices)} choices")
    if normalize == "none":
        values = [float(x) for x in logprobs]
    elif normalize in ("length", "bytes"):
        lengths = [len(c) if normalize == "length" else len(c.encode("utf-8")) for c in choices]
        if 0 in lengths:
            raise ValueError("pick: an empty choice has no length to normalise by")
        values = [float(x) / n for x, n in zip(logprobs, lengths)]
    else:
        raise ValueError(f"pick: normalize must be none, length or bytes, not {normalize!r}")
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


class LoglikelihoodChoiceConfig(ScorerConfig):
    type: Literal["loglikelihood_choice"] = "loglikelihood_choice"
    choices_column: str | None = Field(None, description="a row column holding the choices")
    choices: list[str] | None = Field(None, min_length=1, description="the same choices for "
                                      "every row")
    normalize: Normalize = Field("none", description="none: lm-eval's acc; length: acc_norm "
                                 "(by characters); bytes: acc_bytes")
    target_delimiter: str = Field(" ", description="put before each choice in the continuation")

    @model_validator(mode="after")
    def _one_source(self) -> "LoglikelihoodChoiceConfig":
        if (self.choices is None) == (self.choices_column is None):
            raise ValueError("loglikelihood_choice: give exactly one of choices or choices_column")
        return self


class LoglikelihoodChoice:
    """Scores the picked index (the output, as a string) against the reference: the gold
    index (an int, or digits) or the gold choice's text, or a list of either (any is right)."""

    def __init__(self, config: LoglikelihoodChoiceConfig) -> None:
        self.config = config
        self.name = config.scorer_name

    def choices_for(self, example: Example) -> list[str]:
        if self.config.choices is not None:
            return list(self.config.choices)
        assert self.config.choices_column is not None  # the config names choices or their column
        value = column(example, self.config.choices_column, self.name)
        if isinstance(value, str) or not hasattr(value, "__iter__"):
            raise ScoreError(f"{self.name}: row {example.id}: {self.config.choices_column!r} "
                             f"is not a list of choices")
        choices = [str(c) for c in value]
        if not choices:
            raise ScoreError(f"{self.name}: row {example.id} has no choices")
        return choices

    def continuations(self, example: Example) -> list[str]:
        """What the runner asks the log-likelihood of, one per choice."""
        return [self.config.target_delimiter + c for c in self.choices_for(example)]

    def pick(self, example: Example, logprobs: Sequence[float]) -> int:
        return pick(logprobs, self.choices_for(example), self.config.normalize)

    def gold(self, example: Example) -> set[int]:
        choices = self.choices_for(example)
        ref = need_reference(example, self.name)
        refs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        gold = set()
        for r in refs:
            if isinstance(r, bool):
                raise ScoreError(f"{self.name}: row {example.id}: reference {r!r} is no choice")
            if isinstance(r, Integral):
                index = int(r)
            elif isinstance(r, str) and r in choices:
                index = choices.index(r)
            elif isinstance(r, str) and r.strip().isdigit():
                index = int(r.strip())
            else:
                raise ScoreError(f"{self.name}: row {example.id}: reference {r!r} is neither "
                                 f"an index nor one of the choices")
            if not 0 <= index < len(choices):
                raise ScoreError(f"{self.name}: row {example.id}: reference index {index} is "
                                 f"outside 0..{len(choices) - 1}")
            gold.add(index)
        return gold

    def score(self, example: Example, output: str) -> float:
        gold = self.gold(example)
        try:
            picked = int(str(output).strip())
        except ValueError as exc:
            raise ScoreError(f"{self.name}: row {example.id}: output {output!r} is not the "
                             f"picked index") from exc
        return float(picked in gold)

    def summarize(self, per_example: list[list[float]]) -> dict[str, float]:
        return mean_summary(per_example)
