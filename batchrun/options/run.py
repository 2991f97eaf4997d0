"""The options of one run, by concern, from click's keyword arguments or a job spec's tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun.options.engine import EngineConfig
from batchrun.options.fields import OptionsError, flat_values, public_fields, take, validate
from batchrun.options.job import InputOptions, JobOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.options.ray import RayOptions


def cli_name(name: str, models: tuple = ()) -> str:
    """How an option is spelled on the command line, for error messages."""
    for model in models:
        for f in public_fields(model):
            if f.name == name:
                return f.flag
    return "--" + name.replace("_", "-")


def from_cli(model: type, kwargs: dict[str, Any], extra: dict[str, Any] | None = None) -> Any:
    """Validate this model's options out of click's kwargs (removing them). OptionsError names
    the --option."""
    flat = {**take(model, kwargs), **(extra or {})}
    return validate(model, flat, spell=lambda n: cli_name(n, (model,)))


@dataclass
class RunOptions:
    """What `batchrun run` (or a job spec) asks for."""

    inputs: InputOptions
    job: JobOptions
    engine: EngineConfig = field(default_factory=EngineConfig)
    openai: OpenAIOptions = field(default_factory=OpenAIOptions)
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    ray: RayOptions = field(default_factory=RayOptions)

    @classmethod
    def from_cli(cls, inputs: list[str], kwargs: dict[str, Any]) -> "RunOptions":
        kwargs = dict(kwargs)
        opts = cls(inputs=from_cli(InputOptions, kwargs, {"input": list(inputs)}),
                   job=from_cli(JobOptions, kwargs), engine=from_cli(EngineConfig, kwargs),
                   openai=from_cli(OpenAIOptions, kwargs),
                   defaults=from_cli(RequestDefaults, kwargs), ray=from_cli(RayOptions, kwargs))
        if kwargs:
            raise TypeError(f"options without a schema: {', '.join(kwargs)}")
        return opts

    def as_dict(self) -> dict[str, Any]:
        """Public name -> value of every option (`batchrun job --dry-run`)."""
        out: dict[str, Any] = {}
        for section in (self.inputs, self.job, self.engine, self.openai, self.defaults,
                        self.ray):
            out.update(flat_values(section))
        return out


__all__ = ["RunOptions", "OptionsError", "from_cli", "cli_name"]
