"""Scorers of structure and of the user's own code: json_schema and python."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, model_validator

from .base import Example, ScoreError, ScorerConfig, column
from .stats import mean_summary

# --- json_schema ----------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.DOTALL)


class JsonSchemaConfig(ScorerConfig):
    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] | None = Field(None, alias="schema",
                                           description="the JSON schema (an inline table)")
    schema_column: str | None = Field(None, description="a row column holding the schema "
                                      "(a table, or a JSON string)")
    extract: Literal["whole", "fence", "first"] = Field(
        "whole", description="whole: the output is the JSON; fence: the first ```json fence's "
        "content, else the whole output; first: a fence, else the first JSON object or array "
        "in the output")
    check_formats: bool = Field(False, description="also check `format` (date-time, email...)")

    model_config = {**ScorerConfig.model_config, "populate_by_name": True}

    @model_validator(mode="after")
    def _one_schema(self) -> "JsonSchemaConfig":
        if (self.schema_ is None) == (self.schema_column is None):
            raise ValueError("json_schema: give exactly one of schema or schema_column")
        return self


def _first_json(text: str) -> Any:
    decoder = json.JSONDecoder()
    for m in re.finditer(r"[\{\[]", text):
        try:
            return decoder.raw_decode(text, m.start())[0]
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON object or array in the output")


def parse_json_output(output: str, extract: str) -> Any:
    """The JSON value of an output as `extract` says (raises ValueError where there is none)."""
    if extract in ("fence", "first"):
        fence = _FENCE.search(output)
        if fence:
            return json.loads(fence.group(1))
        if extract == "first":
            return _first_json(output)
    return json.loads(output)


class JsonSchema:
    """1.0 where the output (see extract) parses as JSON and validates against the schema."""

    def __init__(self, config: JsonSchemaConfig) -> None:
        try:
            import jsonschema
        except ImportError as exc:  # pragma: no cover - jsonschema ships with the test extra
            raise ValueError("the json_schema scorer needs the jsonschema package") from exc
        self._jsonschema = jsonschema
        self.config = config
        self.name = config.scorer_name
        self._validators: dict[str, Any] = {}
        if config.schema_ is not None:
            try:
                self._fixed = self._validator(config.schema_)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"json_schema: schema is not a valid JSON schema: "
                                 f"{exc.message}") from exc

    def _validator(self, schema: Any) -> Any:
        key = json.dumps(schema, sort_keys=True)
        validator = self._validators.get(key)
        if validator is None:
            cls = self._jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)
            fmt = cls.FORMAT_CHECKER if self.config.check_formats else None
            validator = self._validators[key] = cls(schema, format_checker=fmt)
        return validator

    def validator_for(self, example: Example) -> Any:
        if self.config.schema_ is not None:
            return self._fixed
        assert self.config.schema_column is not None  # the config names a schema or its column
        schema = column(example, self.config.schema_column, self.name)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ScoreError(f"{self.name}: row {example.id}: the schema column is not "
                                 f"JSON: {exc}") from exc
        try:
            return self._validator(schema)
        except self._jsonschema.SchemaError as exc:
            raise ScoreError(f"{self.name}: row {example.id}: not a valid JSON schema: "
                             f"{exc.message}") from exc

    def score(self, example: Example, output: str) -> float:
        validator = self.validator_for(example)
        try:
            value = parse_json_output(output, self.config.extract)
        except ValueError:  # JSONDecodeError is one
            return 0.0
        return float(validator.is_valid(value))

    def summarize(self, per_example: list[list[float]]) -> dict[str, float]:
        return mean_summary(per_example)


# --- python ---------------------------------------------------------------------------------

class PythonConfig(ScorerConfig):
    type: Literal["python"] = "python"
    function: str = Field(description="'module:function' or 'path/to/file.py:function', "
                          "called as function(row: dict, output: str) -> float | bool")


def load_function(spec: str, base_dir: Path | None = None) -> Callable[..., Any]:
    """The callable `spec` names ('pkg.module:func' or 'file.py:func', a relative file path read
    from base_dir or the working directory). Anything wrong is a ValueError naming spec."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"python scorer: function = {spec!r}: expected 'module:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise FileNotFoundError(f"no file {str(path)!r}")
            name = f"batchrun_sweep_scorer_{abs(hash(str(path.resolve())))}"
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"python scorer: function = {spec!r}: cannot import "
                         f"{module_name!r}: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, attr, None)
    if func is None:
        raise ValueError(f"python scorer: function = {spec!r}: {module_name!r} has no {attr!r}")
    if not callable(func):
        raise ValueError(f"python scorer: function = {spec!r}: {attr!r} is not callable")
    return func


class Python:
    """The user's function(row, output): True/False give 1.0/0.0, numbers themselves. Its
    ScoreError, any other exception it raises, and a return value that is not a finite number
    are the row's error. Summary: Wilson where every score is 0/1, Student t otherwise."""

    def __init__(self, config: PythonConfig, base_dir: Path | None = None) -> None:
        self.config = config
        self.name = config.scorer_name
        self.function = load_function(config.function, base_dir)

    def score(self, example: Example, output: str) -> float:
        try:
            value = self.function(example.row, output)
        except ScoreError:
            raise
        except Exception as exc:
            raise ScoreError(f"{self.name}: {self.config.function} raised on row {example.id}: "
                             f"{type(exc).__name__}: {exc}") from exc
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        try:
            import numpy as np  # numpy scalars (np.float64, np.bool_)
            if isinstance(value, (np.bool_, np.integer, np.floating)) and np.isfinite(value):
                return float(value)
        except ImportError:  # pragma: no cover
            pass
        raise ScoreError(f"{self.name}: {self.config.function} returned {value!r} on row "
                         f"{example.id}, not a finite number or bool")

    def summarize(self, per_example: list[list[float]]) -> dict[str, float]:
        return mean_summary(per_example)
