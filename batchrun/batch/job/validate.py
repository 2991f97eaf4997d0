"""`batchrun validate`: every problem the run would reject, without running anything.

By default it makes every check that needs no tokenizer (JSON, encoding, fields, types, values,
url, stream, model field, duplicate custom_ids) at the speed of reading. With a tokenizer
(`--check-prompts`) it also renders each chat template and checks the prompt against the
context length: exactly the run's prepare_line, minus the engine. Model weights are never loaded.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from batchrun.batch.job.idset import IdSet
from batchrun.batch.storage.store import NO_OPTIONS, Storage
from batchrun.batch.job.line_checks import check_item, internal_error
from batchrun.batch.storage.lines import InputLine, InputReadError, Source
from batchrun.batch.storage.readers import read_all
from batchrun.openai.wire import LineError


@dataclass
class Report:
    lines: int = 0
    valid: int = 0
    by_code: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    read_error: str | None = None  # an input that breaks off (the lines before it are checked)

    @property
    def invalid(self) -> int:
        return self.lines - self.valid + (self.read_error is not None)


def served_names(spec: str | None) -> SimpleNamespace | None:
    """The model's served name and aliases from the registry, without loading anything; None for
    a model that only loading would name."""
    from batchrun.models.weights.registry import DEFAULT_MODEL, lookup

    entry = lookup(spec or DEFAULT_MODEL)
    if entry is None:
        return None
    return SimpleNamespace(name=entry.name, aliases=(*entry.aliases, entry.gguf_name))


def validate(sources: list[Source], prepare: Callable[[str, int], Any],
             on_problem: Callable[[InputLine, LineError], None],
             storage: Storage = NO_OPTIONS,
             columns: dict[str, str] | None = None) -> Report:
    """Check every line with `prepare(text, line)` (which raises LineError) and the duplicate
    check the run makes; call on_problem for each bad line."""
    report = Report()
    ids = IdSet()
    start = time.perf_counter()
    try:
        for item in read_all(sources, storage, columns):
            report.lines += 1
            try:
                check_item(item, ids, prepare)
            except LineError as exc:
                report.by_code[exc.code] += 1
                on_problem(item, exc)
                continue
            except Exception as exc:  # what the run would record as this line's internal error
                error = internal_error(item, "preparing the request", exc)
                report.by_code[error.code] += 1
                on_problem(item, error)
                continue
            report.valid += 1
    except InputReadError as exc:
        report.read_error = str(exc)
    report.seconds = time.perf_counter() - start
    return report


def summary(report: Report, n_files: int) -> str:
    rate = report.lines / report.seconds if report.seconds > 0 else 0.0
    files = f" in {n_files} files" if n_files > 1 else ""
    text = (f"{report.lines} lines{files}: {report.valid} valid, {report.invalid} invalid "
            f"({report.seconds:.1f} s, {rate:,.0f} lines/s)")
    if report.by_code:
        text += "; " + ", ".join(f"{code}: {n}" for code, n in report.by_code.most_common())
    if report.read_error:
        text += f"\nerror: {report.read_error}"
    return text
