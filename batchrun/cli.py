"""Command line: `batchrun run|validate|job` (batch/commands.py), `batchrun models ...`.

Exit codes of a run are in batch/launch.py (0 ok, 1 crash, 2 usage, 3 too many failed lines,
75 interrupted). torch and transformers are imported inside commands so `batchrun --help`
stays fast.
"""

from __future__ import annotations

import logging
import re
import sys

import click

from batchrun import __version__

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `2GiB`, `512MiB`, `1.5GB`, `4g`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or e.g. 2GiB, 512MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class ByteSize(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, message="%(prog)s %(version)s")
def main() -> None:
    """Run OpenAI Batch files through a local continuous-batching LLM engine."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


class ConfigError(click.ClickException):
    exit_code = 2


def _load_model(model, engine_config):
    """llm.load, with the errors a user can fix (unknown model, bad option) as exit code 2."""
    from batchrun import llm
    from batchrun.models.loader import ModelNotFoundError

    try:
        return llm.load(model, engine_config)
    except ModelNotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"cannot load model {model or '(default)'}: {exc}") from exc


def _add_models_group() -> None:
    try:
        from batchrun.models.cli import models
    except ModuleNotFoundError as exc:  # the registry's commands land separately
        if exc.name not in ("batchrun.models", "batchrun.models.cli"):
            raise
        return
    main.add_command(models)


_add_models_group()


def _add_batch_commands() -> None:
    from batchrun.batch.commands import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_add_batch_commands()


def _add_serve_command() -> None:
    from batchrun.server.cli import serve

    main.add_command(serve)


_add_serve_command()
