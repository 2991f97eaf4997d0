"""reference/job-spec.md and reference/sweep-spec.md: every key a job spec or a sweep spec
takes, read from the models that validate them (batchrun/options/, batch/shell/jobspec.py,
sweep/spec.py, sweep/scorers/)."""

from __future__ import annotations

import inspect
import re
import typing

from md import default_text, table, type_name


def _option_rows(model) -> list[list[str]]:
    from batchrun.options.fields import public_fields

    return [[f"`{f.name}`", type_name(f.info.annotation), default_text(f.info),
             f.info.description or ""]
            for f in public_fields(model) if f.extra.get("cli", True)]


def job_spec() -> str:
    from batchrun.batch.shell import jobspec

    top = [["`input`", "str | list[str]", "required",
            "Files, folders, globs or fsspec URLs, read as one job."]]
    for model in jobspec._TOP_MODELS:
        top += _option_rows(model)
    out = ["# Job spec keys\n",
           "A job spec (`batchrun job SPEC.toml`) holds the options of `batchrun run` under "
           "their long names with underscores. Generated from the models that validate a spec "
           "when this site is built; `{NAME}` in a path takes `--var NAME=VALUE`, then "
           "`[vars]`, then the built-in `date` (UTC, YYYY-MM-DD). Relative paths are relative "
           "to the spec's folder.\n",
           "## Top-level keys\n", table(["key", "type", "default", "meaning"], top)]
    for name, model in jobspec._TABLES.items():
        out += [f"## `[{name}]`\n", table(["key", "type", "default", "meaning"],
                                          _option_rows(model))]
    out += ["## Free tables\n",
            table(["table", "holds"],
                  [[f"`[{t}]`", {"storage_options": "fsspec options for object stores",
                                 "columns": "Parquet input: FIELD = COLUMN",
                                 "vars": "values for `{NAME}` in paths"}[t]]
                   for t in jobspec._DICT_TABLES])]
    return "\n".join(out)


def _comments(model) -> dict[str, str]:
    """A model's fields' trailing `# comments` (the sweep spec documents its keys there)."""
    found = {}
    for line in inspect.getsource(model).splitlines():
        m = re.match(r"\s+(\w+): .*?#\s*(.+)$", line)
        if m and not m.group(2).startswith("type:"):
            found[m.group(1)] = m.group(2)
    return found


def _model_rows(model) -> list[list[str]]:
    notes = _comments(model)
    tables = {"dataset": "table", "scorers": "list of tables", "messages": "list of tables"}
    return [[f"`{info.alias or name}`", tables.get(name) or type_name(info.annotation),
             default_text(info), info.description or notes.get(name, "")]
            for name, info in model.model_fields.items() if not name.startswith("_")]


def sweep_spec() -> str:
    from batchrun.openai.requests import ChatCompletionRequest
    from batchrun.sweep import spec
    from batchrun.sweep.scorers import SCORER_SPECS

    axes = sorted(set(ChatCompletionRequest.model_fields) - spec._NOT_AXES)
    out = ["# Sweep spec keys\n",
           "A sweep spec (`batchrun sweep SPEC.toml`), generated from the models that validate "
           "it when this site is built.\n",
           "## Top-level keys\n",
           table(["key", "type", "default", "meaning"],
                 [r for r in _model_rows(spec.SweepSpec) if r[0] not in ("`ray`",)]
                 + _option_rows(spec.RayOptions)),
           "## `[dataset]`\n", table(["key", "type", "default", "meaning"],
                                     _model_rows(spec.DatasetSpec)),
           "## `[grid]`\n",
           "Each key is an axis, a list of values (one value is a list of one); every "
           "combination is a cell. Axes: "
           + ", ".join(f"`{a}`" for a in [*spec.SPECIAL_AXES, *axes])
           + ". `prompt` is a table of named prompt templates.\n",
           "## `[engine]`\n",
           "The engine options of `batchrun run`, as in a job spec's `[engine]` table.\n",
           "## `[[scorers]]`\n",
           "Each scorer is a table with a `type`; its other keys:\n"]
    for model in typing.get_args(typing.get_args(SCORER_SPECS)[0]):
        kind = typing.get_args(model.model_fields["type"].annotation)[0]
        rows = [r for r in _model_rows(model) if r[0] != "`type`"]
        out += [f"### `type = \"{kind}\"`\n", table(["key", "type", "default", "meaning"], rows)]
    return "\n".join(out)
