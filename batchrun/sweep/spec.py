"""A sweep spec (TOML): a dataset, a grid of settings, scorers. Validated by pydantic models
like job specs: an unknown key or a wrong value names the key and the file.

    name = "arith"
    output = "out/sweeps/{name}"
    [dataset]   path, id, prompt | messages, reference, image, limit, format, storage_options
    [grid]      model = [...], temperature = [...], max_tokens = [...], n = [...], any sampling
                field of a chat request; prompt = {plain = "...", cot = "..."} (named variants)
    [[scorers]] type = "exact_match" | "contains" | "regex" | "choice" | "numeric" |
                "json_schema" | "loglikelihood_choice" | "pass_at_k" | "python", + its options
    [engine]    the engine options of `batchrun run` (max_num_seqs, kv_cache_memory, ...)
    ray = true, replicas = 2, ...   the --ray options of `batchrun run`, as in job specs
"""

from __future__ import annotations

import datetime as _dt
import os
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from batchrun.batch.shell.jobspec import resolve, substitute
from batchrun.openai.requests import ChatCompletionRequest
from batchrun.options.engine import EngineConfig
from batchrun.options.fields import OptionsError, validate
from batchrun.options.ray import RayOptions
from batchrun.sweep.scorers import SCORER_SPECS

_STRICT = ConfigDict(extra="forbid", strict=True)
# Grid axes besides the request's sampling fields.
SPECIAL_AXES = ("model", "prompt")
_NOT_AXES = {"messages", "model", "stream", "stream_options", "tools", "tool_choice",
             "response_format", "functions", "function_call", "user", "metadata", "store",
             "prompt_logprobs", "echo"}


class SpecError(ValueError):
    """A sweep spec the user must fix (a usage error, exit code 2)."""


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant"]
    content: str  # a Jinja template over the row's columns


class DatasetSpec(BaseModel):
    model_config = _STRICT

    path: str  # JSONL, Parquet or CSV: local, an fsspec URL or pkg:PACKAGE/FILE
    format: Literal["jsonl", "parquet", "csv"] | None = None  # default: from the extension
    id: str | None = None  # a unique id column; None = the row number (1-based)
    prompt: str | None = None  # a Jinja template: the user message (or the text scored)
    messages: list[Message] | None = None  # or the whole conversation, templated
    reference: str | None = None  # the column scorers compare against
    # A column of images (bytes or URLs, or lists of them) shown after the last user message's
    # text (chat, on a vision-language model).
    image: str | None = None  # a column of images (bytes or URLs) shown after the prompt
    # chat: the prompt is the user message, rendered with the model's chat template;
    # completions: the prompt text as it is (code continuation, e.g. HumanEval).
    endpoint: Literal["chat", "completions"] = "chat"  # completions: the prompt as it is
    limit: int | None = Field(None, ge=1)  # the first N rows
    storage_options: dict[str, Any] | None = None  # fsspec options for the dataset's store


class SweepSpec(BaseModel):
    model_config = _STRICT

    name: str  # the sweep's name ({name} in output)
    output: str  # the output folder
    dataset: DatasetSpec
    grid: dict[str, Any] = Field(default_factory=dict)  # axis = [values]: cells
    scorers: list[SCORER_SPECS] = Field(min_length=1)
    engine: dict[str, Any] = Field(default_factory=dict)  # validated as EngineConfig
    ray: RayOptions = Field(default_factory=RayOptions)  # top-level keys, as in job specs
    _folder: str = PrivateAttr("")  # the spec file's folder (python scorers' files are there)

    @property
    def folder(self) -> str:
        return self._folder

    @field_validator("grid")
    @classmethod
    def _axes(cls, grid: dict[str, Any]) -> dict[str, Any]:
        known = set(ChatCompletionRequest.model_fields) - _NOT_AXES
        out: dict[str, Any] = {}
        for axis, values in grid.items():
            if axis not in known and axis not in SPECIAL_AXES:
                raise ValueError(f"grid.{axis}: not a grid axis (one of: model, prompt, "
                                 f"{', '.join(sorted(known))})")
            if axis == "prompt":
                if not isinstance(values, dict) or not values or \
                        not all(isinstance(v, str) for v in values.values()):
                    raise ValueError("grid.prompt: a table of named prompt templates, e.g. "
                                     '{plain = "...", cot = "..."}')
                out[axis] = dict(values)
                continue
            values = values if isinstance(values, list) else [values]
            if not values:
                raise ValueError(f"grid.{axis}: an empty list makes no cells")
            out[axis] = values
        return out

    def engine_config(self) -> EngineConfig:
        try:
            return validate(EngineConfig, self.engine)
        except OptionsError as exc:
            raise SpecError(f"[engine]: {exc}") from None


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "spec"
        problems.append(f"{where}: {err['msg']}")
    return "; ".join(problems)


def load(path: str, variables: dict[str, str] | None = None) -> tuple[SweepSpec, str]:
    """The validated spec and its TOML text. Paths are relative to the spec's folder; `{name}`
    and `{date}` (and --var NAME=VALUE) are substituted in `output` and `dataset.path`."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise SpecError(f"no sweep spec at {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from None
    ray_keys = {k: raw.pop(k) for k in list(raw) if k in RayOptions.model_fields}
    try:
        raw["ray"] = validate(RayOptions, ray_keys)
    except OptionsError as exc:
        raise SpecError(f"{path}: {exc}") from None
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(f"{path}: {_describe(exc)}") from None
    base = os.path.dirname(os.path.abspath(path))
    spec._folder = base
    values = {"date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(), "name": spec.name,
              **(variables or {})}
    spec.output = resolve(substitute(spec.output, values, f"{path}: output", SpecError), base)
    spec.dataset.path = resolve(substitute(spec.dataset.path, values, f"{path}: dataset.path",
                                           SpecError), base)
    if (spec.dataset.prompt is None) == (spec.dataset.messages is None) and \
            "prompt" not in spec.grid:
        raise SpecError(f"{path}: [dataset] needs exactly one of prompt or messages (or a "
                        "grid.prompt table of variants)")
    try:
        spec.engine_config()
    except SpecError as exc:
        raise SpecError(f"{path} {exc}") from None
    names = [s.name or s.type for s in spec.scorers]
    if len(set(names)) != len(names):
        raise SpecError(f"{path}: two scorers share a name; give one `name = ...`")
    return spec, text
