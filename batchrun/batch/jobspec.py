"""Job specs (`jobs/NAME.toml`) for schedulers: the options of `batchrun run`, in a file.

    input = "s3://bucket/in/{date}/*.parquet"     # a string or a list; files, folders, globs
    output = "s3://bucket/out/{date}/results.jsonl"
    model = "smollm2-135m"
    resume = true                                  # a rerun continues where a failed one stopped
    [engine]     max_num_seqs, max_batched_tokens, max_model_len, dtype, kv_cache_dtype, threads,
                 kv_cache_memory ("2GiB"), prefix_cache (bool)
    [defaults]   temperature, max_tokens
    [storage_options], [columns], [vars]

`{name}` in a path is replaced by a variable: `--var name=value`, else [vars], else the built-in
`date` (today, UTC, YYYY-MM-DD). Relative local paths are relative to the spec's folder, so a
spec works from any working directory (cron, Airflow).
"""

from __future__ import annotations

import datetime as _dt
import os
import string
import tomllib
from typing import Any

from batchrun.batch import io
from batchrun.batch.launch import RunOptions

_TOP = {"input": (str, list), "output": str, "errors": str, "metrics": str, "model": str,
        "staging": str, "resume": bool, "restart": bool, "retry_failed": bool,
        "overwrite": bool, "on_changed_input": str,
        "max_failed_fraction": (int, float), "max_in_flight": int, "ignore_model_field": bool,
        "input_format": str, "output_format": str, "progress": str,
        "log_interval": (int, float), "quiet": bool, "grace_period": (int, float),
        "commit_interval": (int, float), "chat_template": str, "tool_parser": str,
        "reasoning_parser": str}
_ENGINE = {"max_num_seqs": int, "max_batched_tokens": int, "max_model_len": int, "dtype": str,
           "kv_cache_dtype": str,
           "threads": int, "kv_cache_memory": (int, str), "prefix_cache": bool}
_DEFAULTS = {"temperature": (int, float), "max_tokens": int}
_TABLES = {"engine", "defaults", "storage_options", "columns", "vars"}
_PATHS = ("output", "errors", "metrics", "staging", "chat_template")


class JobSpecError(ValueError):
    pass


def _check(table: dict, allowed: dict, where: str) -> None:
    for key, value in table.items():
        if key not in allowed:
            raise JobSpecError(f"{where}: unknown key {key!r} (known: {', '.join(allowed)})")
        types = allowed[key] if isinstance(allowed[key], tuple) else (allowed[key],)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise JobSpecError(f"{where}: {key} has the wrong type ({type(value).__name__})")


def _substitute(text: str, variables: dict[str, str], where: str) -> str:
    names = [name for _, name, _, _ in string.Formatter().parse(text) if name]
    missing = [n for n in names if n not in variables]
    if missing:
        raise JobSpecError(f"{where}: no value for {{{missing[0]}}}; pass --var {missing[0]}=...")
    return text.format_map(variables)


def _resolve(path: str, base: str) -> str:
    if path == io.STDIO or io.protocol(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


def load(path: str, variables: dict[str, str] | None = None) -> RunOptions:
    """Parse a job spec into RunOptions. Raises JobSpecError (a usage error)."""
    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
    except FileNotFoundError:
        raise JobSpecError(f"no job spec at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"{path}: {exc}") from None
    top = {k: v for k, v in spec.items() if k not in _TABLES}
    _check(top, _TOP, path)
    for table in _TABLES:
        if not isinstance(spec.get(table, {}), dict):
            raise JobSpecError(f"{path}: [{table}] must be a table")
    engine, defaults = spec.get("engine", {}), spec.get("defaults", {})
    _check(engine, _ENGINE, f"{path} [engine]")
    _check(defaults, _DEFAULTS, f"{path} [defaults]")
    for key in ("input", "output"):
        if key not in top:
            raise JobSpecError(f"{path}: `{key}` is required")

    values = {"date": _dt.datetime.now(_dt.timezone.utc).date().isoformat()}
    values.update({k: str(v) for k, v in spec.get("vars", {}).items()})
    values.update(variables or {})
    base = os.path.dirname(os.path.abspath(path))
    inputs = top.pop("input")
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if not inputs or not all(isinstance(i, str) for i in inputs):
        raise JobSpecError(f"{path}: input must be a path or a list of paths")
    opts: dict[str, Any] = dict(top)
    opts["inputs"] = [_resolve(_substitute(i, values, f"{path}: input"), base) for i in inputs]
    for key in _PATHS:
        if key in opts:
            opts[key] = _resolve(_substitute(opts[key], values, f"{path}: {key}"), base)
    engine = dict(engine)
    if "prefix_cache" in engine:
        engine["no_prefix_cache"] = not engine.pop("prefix_cache")
    if isinstance(engine.get("kv_cache_memory"), str):
        from batchrun.cli import parse_size

        try:
            engine["kv_cache_memory"] = parse_size(engine["kv_cache_memory"])
        except ValueError as exc:
            raise JobSpecError(f"{path} [engine]: kv_cache_memory: {exc}") from None
    opts.update(engine)
    opts.update(defaults)
    opts["storage_options"] = spec.get("storage_options") or None
    opts["columns"] = spec.get("columns", {})
    if opts.get("max_failed_fraction") is not None:
        opts["max_failed_fraction"] = float(opts["max_failed_fraction"])
    return RunOptions(**opts)
