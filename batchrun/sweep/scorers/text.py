"""Scorers that read the output as text: exact_match, contains, regex, choice, numeric.
Each scores a choice 1.0 or 0.0; the summary is the mean with its Wilson interval."""

from __future__ import annotations

import re
import string
from fractions import Fraction
from numbers import Integral, Real
from typing import Any, Literal

from pydantic import Field, field_validator

from .base import Example, ScoreError, ScorerConfig, need_reference
from .stats import mean_summary

_PUNCTUATION = str.maketrans("", "", string.punctuation)


class Normalization(ScorerConfig):
    """How output and reference are normalised before they are compared, in this order: every
    match of each of regexes_to_ignore removed, lower-cased (ignore_case), ASCII punctuation
    removed (ignore_punctuation), surrounding whitespace stripped (strip)."""

    strip: bool = Field(True, description="strip surrounding whitespace")
    ignore_case: bool = Field(True, description="compare case-insensitively")
    ignore_punctuation: bool = Field(False, description="drop ASCII punctuation")
    regexes_to_ignore: list[str] = Field(default_factory=list,
                                         description="regexes whose matches are removed first")

    @field_validator("regexes_to_ignore")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"regexes_to_ignore: {pattern!r} is not a regex: {exc}")
        return value

    def normalize(self, text: str) -> str:
        for pattern in self.regexes_to_ignore:
            text = re.sub(pattern, "", text)
        if self.ignore_case:
            text = text.lower()
        if self.ignore_punctuation:
            text = text.translate(_PUNCTUATION)
        if self.strip:
            text = text.strip()
        return text


def references(example: Example, scorer: str) -> list[str]:
    """The acceptable answers: the reference, or each of a list of them, as strings."""
    ref = need_reference(example, scorer)
    refs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
    refs = [r for r in refs if r is not None]
    if not refs:
        raise ScoreError(f"{scorer}: row {example.id} has an empty list of references")
    return [r if isinstance(r, str) else str(r) for r in refs]


class _TextScorer:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.name = config.scorer_name

    def summarize(self, per_example: list[list[float]]) -> dict[str, float]:
        return mean_summary(per_example)


# --- exact_match ----------------------------------------------------------------------------

class ExactMatchConfig(Normalization):
    type: Literal["exact_match"] = "exact_match"


class ExactMatch(_TextScorer):
    """1.0 where the normalised output equals the normalised reference (or one of a list)."""

    def score(self, example: Example, output: str) -> float:
        norm = self.config.normalize
        out = norm(output)
        return float(any(out == norm(r) for r in references(example, self.name)))


# --- contains -------------------------------------------------------------------------------

class ContainsConfig(Normalization):
    type: Literal["contains"] = "contains"


class Contains(_TextScorer):
    """1.0 where the normalised reference (or any of a list) occurs in the normalised output.
    An empty reference is an error (it would be found in every output)."""

    def score(self, example: Example, output: str) -> float:
        norm = self.config.normalize
        refs = [norm(r) for r in references(example, self.name)]
        if any(not r for r in refs):
            raise ScoreError(f"{self.name}: row {example.id} has an empty reference")
        out = norm(output)
        return float(any(r in out for r in refs))


# --- regex ----------------------------------------------------------------------------------

_FLAGS = {"ignorecase": re.IGNORECASE, "multiline": re.MULTILINE, "dotall": re.DOTALL}


class RegexConfig(Normalization):
    type: Literal["regex"] = "regex"
    pattern: str = Field(description="the regex searched for in the output")
    group: int | str = Field(0, description="the group (number or name) compared to the reference")
    which: Literal["first", "last"] = Field("first", description="which match is used")
    flags: list[Literal["ignorecase", "multiline", "dotall"]] = Field(default_factory=list)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:  # type: ignore[override]
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"pattern {value!r} is not a regex: {exc}")
        return value


class Regex(_TextScorer):
    """Extract `group` of the first (or last) match of `pattern` and compare it, normalised, to
    the reference (or a list of them). No match, or the group took no part in it: 0.0."""

    def __init__(self, config: RegexConfig) -> None:
        super().__init__(config)
        flags = 0
        for f in config.flags:
            flags |= _FLAGS[f]
        self.regex = re.compile(config.pattern, flags)
        group = config.group
        if isinstance(group, int) and group > self.regex.groups:
            raise ValueError(f"regex {config.pattern!r} has no group {group}")
        if isinstance(group, str) and group not in self.regex.groupindex:
            raise ValueError(f"regex {config.pattern!r} has no group named {group!r}")

    def extract(self, output: str) -> str | None:
        matches = list(self.regex.finditer(output)) if self.config.which == "last" else \
            [m for m in [self.regex.search(output)] if m]
        if not matches:
            return None
        return matches[-1].group(self.config.group)

    def score(self, example: Example, output: str) -> float:
        refs = references(example, self.name)
        found = self.extract(output)
        if found is None:
            return 0.0
        norm = self.config.normalize
        return float(any(norm(found) == norm(r) for r in refs))


# --- choice ---------------------------------------------------------------------------------

class ChoiceConfig(ScorerConfig):
    type: Literal["choice"] = "choice"
    choices: str | list[str] = Field(
        "ABCD", description="the answer labels: a string of one-letter labels, or a list")
    ignore_case: bool = Field(False, description="accept lower-case labels (off: 'a' is a word)")

    @field_validator("choices")
    @classmethod
    def _labels(cls, value: str | list[str]) -> str | list[str]:
        labels = list(value)
        if not labels or any(not label.strip() for label in labels):
            raise ValueError("choices: give at least one non-empty label")
        if len(set(labels)) != len(labels):
            raise ValueError(f"choices: labels repeat in {value!r}")
        return value


class Choice(_TextScorer):
    """Extract the answer label and compare it with the reference: a label ("B", "(B)" too) or
    an index 0..len(choices)-1 (an int, or a string of digits that is not itself a label).

    The patterns are tried in this order; the first that matches gives the answer:
      1. an answer phrase: "Answer: B", "answer is (B)", "Final answer - B" (the last one in the
         output: the model's conclusion; the phrase is case-insensitive);
      2. a parenthesised label: "(B)" (the first);
      3. a label opening a line, followed by ")" "." or ":": "B) ...", "B. ...", "B: ..." (first);
      4. a lone label at the start of the output: "B", "**B**", "B, because ...";
      5. a lone label at the end of the output: "... so the answer must be B." .
    Nothing matches: 0.0.
    """

    def __init__(self, config: ChoiceConfig) -> None:
        super().__init__(config)
        self.labels = list(config.choices)
        alt = "|".join(re.escape(x) for x in sorted(self.labels, key=len, reverse=True))
        lab = f"(?P<label>{alt})"
        flags = re.IGNORECASE if config.ignore_case else 0
        ci = "" if config.ignore_case else "(?i:"
        end_ci = "" if config.ignore_case else ")"
        phrase = (ci + r"\banswer\b(?:\s+is)?(?:\s*:|\s*-|\s+is\b)?" + end_ci +
                  r"\s*[\*\(\[]*" + lab + r"(?![\w])")
        self.patterns: list[tuple[re.Pattern, bool]] = [
            (re.compile(phrase, flags), True),
            (re.compile(r"\(" + lab + r"\)", flags), False),
            (re.compile(r"(?m)^[ \t\*]*" + lab + r"[\*]*[\)\.:]", flags), False),
            (re.compile(r"\A\s*[\*\[]*" + lab + r"[\*\]]*\s*(?:[,\.:;!)]|\Z|\n)", flags), False),
            (re.compile(r"(?<![\w])" + lab + r"[\*\]\)]*\s*[\.!]?\s*\Z", flags), False),
        ]

    def _canonical(self, text: str) -> str:
        if not self.config.ignore_case:
            return text
        for label in self.labels:
            if label.lower() == text.lower():
                return label
        return text

    def extract(self, output: str) -> str | None:
        for pattern, last in self.patterns:
            matches = list(pattern.finditer(output))
            if matches:
                return self._canonical(matches[-1 if last else 0].group("label"))
        return None

    def gold(self, example: Example) -> str:
        ref = need_reference(example, self.name)
        if isinstance(ref, bool):
            raise ScoreError(f"{self.name}: row {example.id}: reference {ref!r} is no label")
        if isinstance(ref, Integral):
            ref = int(ref)
            if not 0 <= ref < len(self.labels):
                raise ScoreError(f"{self.name}: row {example.id}: reference index {ref} is "
                                 f"outside 0..{len(self.labels) - 1}")
            return self.labels[ref]
        text = str(ref).strip().strip("().[]* ")
        text = self._canonical(text)
        if text in self.labels:
            return text
        if text.isdigit():
            return self.gold(Example(example.id, example.row, int(text)))
        raise ScoreError(f"{self.name}: row {example.id}: reference {ref!r} is none of "
                         f"{self.labels}")

    def score(self, example: Example, output: str) -> float:
        gold = self.gold(example)
        return float(self.extract(output) == gold)


# --- numeric --------------------------------------------------------------------------------

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(
    r"\\d?frac\{\s*(?P<fn>[-−]?\d+)\s*\}\{\s*(?P<fd>[-−]?\d+)\s*\}"  # \frac{3}{4}
    r"|(?<![\w.])(?P<sign>[-−+]?)(?P<num>" + _NUM + r")"
    r"(?:(?P<exp>[eE][-+]?\d+)|\s*/\s*(?P<den>\d+)(?![\d.,]))?")


def _value(m: re.Match) -> float | None:
    if m.group("fn") is not None:
        num, den = int(m.group("fn").replace("−", "-")), int(m.group("fd").replace("−", "-"))
        return None if den == 0 else float(Fraction(num, den))
    sign = -1.0 if m.group("sign") in ("-", "−") else 1.0
    num = m.group("num").replace(",", "")
    if m.group("exp"):
        return sign * float(num + m.group("exp"))
    den = m.group("den")
    if den is not None and int(den) != 0 and "." not in num:
        return sign * float(Fraction(int(num), int(den)))
    return sign * float(num)


def numbers(text: str) -> list[float]:
    """Every number in text, in order: -1,234.5 / 1e-3 / 3/4 / \\frac{3}{4} / .5 / −2 ."""
    return [v for v in (_value(m) for m in _NUMBER.finditer(text)) if v is not None]


class NumericConfig(ScorerConfig):
    type: Literal["numeric"] = "numeric"
    which: Literal["first", "last"] = Field("first", description="which number of the output")
    tolerance: float = Field(1e-6, ge=0, description="absolute tolerance")
    relative_tolerance: float | None = Field(None, ge=0, description="also accept |x-ref| <= "
                                             "relative_tolerance * |ref|")


class Numeric(_TextScorer):
    """1.0 where the first (or last) number in the output is within `tolerance` of the
    reference (or within relative_tolerance * |reference|). The reference is a number or a
    string holding one ("1,234", "3/4"). No number in the output: 0.0."""

    def reference(self, example: Example) -> float:
        ref = need_reference(example, self.name)
        if isinstance(ref, bool):
            raise ScoreError(f"{self.name}: row {example.id}: reference {ref!r} is not a number")
        if isinstance(ref, Real):
            return float(ref)
        found = numbers(str(ref))
        if len(found) != 1:
            raise ScoreError(f"{self.name}: row {example.id}: reference {ref!r} does not hold "
                             f"one number")
        return found[0]

    def extract(self, output: str) -> float | None:
        found = numbers(output)
        if not found:
            return None
        return found[0] if self.config.which == "first" else found[-1]

    def score(self, example: Example, output: str) -> float:
        ref = self.reference(example)
        value = self.extract(output)
        if value is None:
            return 0.0
        diff = abs(value - ref)
        rel = self.config.relative_tolerance
        return float(diff <= self.config.tolerance or (rel is not None and diff <= rel * abs(ref)))
