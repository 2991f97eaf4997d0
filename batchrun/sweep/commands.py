"""`batchrun sweep SPEC` (run a sweep) and `batchrun sweep report DIR` (re-render its report)."""

from __future__ import annotations

import logging
import sys

import click

from batchrun.commandkit import (EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK, Signals, UsageError,
                                 interrupted, model_loader, on_ray)
from batchrun.options.click_options import click_options, pairs
from batchrun.options.job import JobOptions

log = logging.getLogger("batchrun.sweep")


class _SweepGroup(click.Group):
    """`batchrun sweep SPEC ...` runs SPEC; `batchrun sweep report DIR` is the subcommand."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


@click.group("sweep", cls=_SweepGroup, invoke_without_command=False,
             short_help="Score a grid of models, prompts and settings over a dataset.")
def sweep() -> None:
    """Evaluate a grid of settings over a dataset: `batchrun sweep SPEC.toml [--resume]`
    (see sweeps/*.toml), or `batchrun sweep report DIR` to re-render a sweep's report."""


@sweep.command("run", epilog="\b\nExit codes: 0 done, 1 crash, 2 usage error, 75 interrupted "
               "(rerun with --resume).")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--var", "variables", multiple=True, callback=pairs, metavar="NAME=VALUE",
              help="Value for {NAME} in the spec's paths. Repeatable.")
@click.option("--resume", is_flag=True, help="Continue an interrupted sweep: committed results "
              "are not run again, scored models are not scored again.")
@click.option("--restart", is_flag=True, help="Discard what an interrupted sweep committed.")
@click_options(JobOptions, only=("overwrite",))
@click.pass_context
def run(ctx, spec, variables, resume, restart, overwrite):
    """Run the sweep SPEC (TOML): every cell of its grid over its dataset, scored."""
    from batchrun.batch.job.loop import ChangedInputError, StopRequest
    from batchrun.batch.job.plan import BatchConfigError
    from batchrun.models.errors import ModelFolderError
    from batchrun.sweep.run import run_sweep
    from batchrun.sweep.spec import SpecError, load

    try:
        parsed, text = load(spec, variables)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    stop = StopRequest()
    with Signals(stop, log):
        try:
            load = on_ray(parsed.ray, model_loader(ctx))
            result = run_sweep(parsed, text, load, resume=resume, restart=restart,
                               stop=stop, on_stage=lambda m: click.echo(m, err=True),
                               overwrite=bool(overwrite))
        except (SpecError, BatchConfigError, ChangedInputError, ModelFolderError) as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:
            sys.exit(interrupted(log))
        except OSError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_CRASH)
    if result.status != "completed":
        click.echo("interrupted: what finished is committed; rerun with --resume", err=True)
        sys.exit(EXIT_INTERRUPTED)
    click.echo(_summary_text(result), err=True)
    click.echo(f"results: {result.output}/results.parquet, summary.csv, report.html", err=True)
    sys.exit(EXIT_OK)


def _summary_text(result) -> str:
    lines = [f"{result.cells} cells done:"]
    for row in result.summary:
        metrics = [f"{k} {v:.3f}" for k, v in row.items()
                   if ":" in k and not k.endswith(("_ci_low", "_ci_high")) and v is not None]
        errors = f" ({row['errors']} of its rows have errors: see results.parquet)" \
            if row.get("errors") else ""
        lines.append(f"  {row['cell']}: " + (", ".join(metrics) or "no scores") + errors)
    if result.first_error:
        lines.append(f"first error: {result.first_error}")
    return "\n".join(lines)


@sweep.command("report")
@click.argument("folder")
def report(folder):
    """Re-render FOLDER/report.html from the sweep's results.parquet and summary.parquet."""
    from batchrun.sweep.report import write_report

    try:
        path = write_report(folder)
    except FileNotFoundError as exc:
        raise UsageError(f"{folder} holds no sweep results: {exc}") from None
    click.echo(str(path))
