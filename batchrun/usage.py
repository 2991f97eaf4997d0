"""What the commands share: the usage error (exit code 2) and loading a model with the errors
a user can fix (unknown model, bad option) reported as usage errors."""

from __future__ import annotations

from typing import Any

import click

EXIT_USAGE = 2


class UsageError(click.ClickException):
    exit_code = EXIT_USAGE


def load_model(model: str | None, engine_config: Any) -> Any:
    """batchrun.llm.load; UsageError for an unknown model or a bad engine option."""
    from batchrun import llm
    from batchrun.models.loader import ModelNotFoundError
    from batchrun.models.lora.adapter import LoraError

    try:
        return llm.load(model, engine_config)
    except (ModelNotFoundError, LoraError) as exc:  # a LoraError names the adapter and its path
        raise UsageError(str(exc)) from exc
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(f"cannot load model {model or '(default)'}: {exc}") from exc


def model_loader(ctx: click.Context | None) -> Any:
    """The loader commands use: load_model, unless the caller of the CLI injected another as
    `obj={"load_model": ...}` (the test suite's fake engine)."""
    obj = ctx.find_root().obj if ctx is not None else None
    if isinstance(obj, dict) and obj.get("load_model") is not None:
        return obj["load_model"]
    return load_model
