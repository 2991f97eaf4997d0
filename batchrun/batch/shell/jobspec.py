"""Job specs (`jobs/NAME.toml`) for schedulers: the options of `batchrun run`, in a file.

    input = "s3://bucket/in/{date}/*.parquet"     # a string or a list; files, folders, globs
    output = "s3://bucket/out/{date}/results.jsonl"
    model = "smollm2-135m"
    resume = true                                  # a rerun continues where a failed one stopped
    [engine]     max_num_seqs, max_batched_tokens, max_model_len, dtype, ... ("2GiB" sizes),
                 lora = {NAME = "adapter folder"}, max_loras, max_lora_rank
    [defaults]   temperature, max_tokens
    [storage_options], [columns], [vars]

Every key is an option of `batchrun run` under its long name with underscores, validated by the
same models (batchrun.options) as the command line: an unknown key or a wrong type names the
key and the file.

`{name}` in a path is replaced by a variable: `--var name=value`, else [vars], else the built-in
`date` (today, UTC, YYYY-MM-DD). Relative local paths are relative to the spec's folder, so a
spec works from any working directory (cron, Airflow).
"""

from __future__ import annotations

import datetime as _dt
import os
import string
import tomllib

from batchrun.batch.storage import io
from batchrun.options.engine import EngineConfig
from batchrun.options.fields import OptionsError, public_fields, validate
from batchrun.options.job import InputOptions, JobOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.options.ray import RayOptions
from batchrun.options.run import RunOptions

# Top-level keys are the options of these models; [engine] and [defaults] are tables.
_TOP_MODELS = (InputOptions, JobOptions, OpenAIOptions, RayOptions)
_TABLES = {"engine": EngineConfig, "defaults": RequestDefaults}
_DICT_TABLES = ("storage_options", "columns", "vars")
_PATHS = ("output", "errors", "metrics", "staging", "chat_template")


class JobSpecError(ValueError):
    pass


def _cli_keys(model) -> set[str]:
    return {f.name for f in public_fields(model) if f.extra.get("cli", True)} | \
        ({"input"} if model is InputOptions else set())


def _section(model, values: dict, where: str):
    unknown = [k for k in values if k not in _cli_keys(model)]
    if unknown:
        raise JobSpecError(f"{where}: unknown key {unknown[0]!r} (known: "
                           f"{', '.join(sorted(_cli_keys(model)))})")
    try:
        return validate(model, values)
    except OptionsError as exc:
        raise JobSpecError(f"{where}: {exc}") from None


def substitute(text: str, variables: dict[str, str], where: str,
               error: type[ValueError] = JobSpecError) -> str:
    """`{name}` in a spec's path from `variables`; `error` names the one that has no value."""
    names = [name for _, name, _, _ in string.Formatter().parse(text) if name]
    missing = [n for n in names if n not in variables]
    if missing:
        raise error(f"{where}: no value for {{{missing[0]}}}; pass --var {missing[0]}=...")
    return text.format_map(variables)


def resolve(path: str, base: str) -> str:
    """A spec's relative local path, relative to the spec's folder `base` (so a spec works
    from any working directory); URLs, absolute paths, `-` and `pkg:` paths as they are."""
    if path == io.STDIO or io.protocol(path) or os.path.isabs(path) or path.startswith("pkg:"):
        return path
    return os.path.normpath(os.path.join(base, path))


def load(path: str, variables: dict[str, str] | None = None) -> RunOptions:
    """Parse and validate a job spec. Raises JobSpecError (a usage error) naming the file and
    the key."""
    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
    except FileNotFoundError:
        raise JobSpecError(f"no job spec at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"{path}: {exc}") from None
    for table in (*_TABLES, *_DICT_TABLES):
        if not isinstance(spec.get(table, {}), dict):
            raise JobSpecError(f"{path}: [{table}] must be a table")
    top = {k: v for k, v in spec.items() if k not in _TABLES and k not in ("vars",)}
    known = set().union(*(_cli_keys(m) for m in _TOP_MODELS))
    unknown = [k for k in top if k not in known]
    if unknown:
        raise JobSpecError(f"{path}: unknown key {unknown[0]!r} (known: "
                           f"{', '.join(sorted(known | set(_TABLES) | {'vars'}))})")
    for key in ("input", "output"):
        if key not in top:
            raise JobSpecError(f"{path}: `{key}` is required")

    values = {"date": _dt.datetime.now(_dt.timezone.utc).date().isoformat()}
    values.update({k: str(v) for k, v in spec.get("vars", {}).items()})
    values.update(variables or {})
    base = os.path.dirname(os.path.abspath(path))
    inputs = top["input"]
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if not inputs or not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise JobSpecError(f"{path}: input must be a path or a list of paths")
    top["input"] = [resolve(substitute(i, values, f"{path}: input"), base) for i in inputs]
    for key in _PATHS:
        if isinstance(top.get(key), str):
            top[key] = resolve(substitute(top[key], values, f"{path}: {key}"), base)
    sections = [_section(m, {k: v for k, v in top.items() if k in _cli_keys(m)}, path)
                for m in _TOP_MODELS]
    engine = dict(spec.get("engine", {}))
    if isinstance(engine.get("lora"), dict):  # adapter folders, relative to the spec's folder
        engine["lora"] = {name: resolve(substitute(p, values, f"{path}: lora.{name}"), base)
                          if isinstance(p, str) else p for name, p in engine["lora"].items()}
    return RunOptions(inputs=sections[0], job=sections[1], openai=sections[2], ray=sections[3],
                      engine=_section(EngineConfig, engine, f"{path} [engine]"),
                      defaults=_section(RequestDefaults, spec.get("defaults", {}),
                                        f"{path} [defaults]"))
