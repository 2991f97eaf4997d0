"""`batchrun run`, `validate`, `job` and `plan` (registered on the main group in cli.py)."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from batchrun.batch.shell.launch import execute
from batchrun.commandkit import EXIT_OK, EXIT_TOO_MANY_FAILED, UsageError, model_loader
from batchrun.options.click_options import click_options, pairs
from batchrun.options.engine import EngineConfig
from batchrun.options.fields import OptionsError
from batchrun.options.help_sections import FieldOption, SectionedCommand
from batchrun.options.job import InputOptions, JobOptions, PlanOptions
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.options.ray import RayOptions
from batchrun.options.run import RunOptions, from_cli

EXIT_CODES_HELP = """\b
Exit codes:
  0   completed; failed lines (in the error file) within --max-failed-fraction
  1   crash; what finished is committed: rerun with --resume
  2   usage or configuration error; nothing was run
  3   completed, but the failed fraction is over --max-failed-fraction
  4   the --deadline passed: unfinished lines have batch_expired error lines; rerun with
      --resume to run only those
  75  interrupted by SIGTERM/SIGINT; what finished is committed: rerun with --resume
"""


def _options(build):
    try:
        return build()
    except OptionsError as exc:
        raise UsageError(str(exc)) from None


@click.command(cls=SectionedCommand, epilog=EXIT_CODES_HELP,
               short_help="Run batch files through the model: results in input order.")
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click_options(JobOptions, InputOptions, EngineConfig, OpenAIOptions, RequestDefaults,
               RayOptions)
@click.pass_context
def run(ctx, inputs, **kwargs):
    """Run the batch files INPUT... (JSONL, JSONL.gz/.zst or Parquet; files, folders, globs,
    fsspec URLs or - for stdin) as one job and write the results in input order."""
    opts = _options(lambda: RunOptions.from_cli(inputs, kwargs))
    sys.exit(execute(opts, model_loader(ctx)))


@click.command(cls=SectionedCommand, first=("validate",),
               epilog="\b\nExit codes: 0 every line is valid, 3 some lines are not, 2 usage error.",
               short_help="Report every problem a run would reject, without running a model.")
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click_options(InputOptions, OpenAIOptions)
@click.option("--check-prompts", is_flag=True, cls=FieldOption, section="validate",
              help="Also render every prompt and check its length, as the run would. This loads "
              "the model's tokenizer and chat template, not its weights.")
@click.option("--fetch-media", is_flag=True, cls=FieldOption, section="validate",
              help="Also fetch and decode every image the lines name. Without it, image parts "
              "are checked without fetching: their shape, count, data: URLs and local paths.")
@click_options(EngineConfig, only=("max_model_len", "trust_remote_code"))
@click.option("--json", "as_json", is_flag=True, cls=FieldOption, section="validate",
              help="Print problems as error-file records (JSON lines) instead of text.")
@click.option("-q", "--quiet", is_flag=True, cls=FieldOption, section="validate",
              help="Only the summary.")
def validate(inputs, check_prompts, fetch_media, max_model_len, trust_remote_code, as_json, quiet,
             **kwargs):
    """Check the batch files INPUT... and report every problem (line, field, message) that the
    run would reject, with counts, without running a model."""
    from types import SimpleNamespace

    from batchrun.batch.job import validate as v
    from batchrun.batch.storage.readers import check_sources, open_sources
    from batchrun.batch.storage.store import Storage
    from batchrun.batch.job.runner import check_line, prepare_line
    from batchrun.openai.bodies import batch_error_line
    from batchrun.openai.media import MediaFetcher
    from batchrun.openai.serving import OpenAIServing, ServingOptions

    read = _options(lambda: from_cli(InputOptions, kwargs, {"input": list(inputs)}))
    openai = _options(lambda: from_cli(OpenAIOptions, kwargs))
    storage = Storage(read.storage_options)
    try:
        sources = open_sources(read.input, storage, read.input_format)
        check_sources(sources, storage, read.columns)
        serving_options = ServingOptions.of(openai) if check_prompts else None
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    media = None
    if check_prompts:
        serving_options = dataclasses.replace(serving_options, open_url=storage.open_read)
        try:
            serving = OpenAIServing(_tokenizer_model(read.model, max_model_len,
                                                     bool(trust_remote_code)), serving_options)
        except ValueError as exc:  # an option the model cannot take (--score-tokens)
            raise UsageError(str(exc)) from exc
        prepare = lambda text, line: prepare_line(text, line, serving)  # noqa: E731
    else:
        served = v.served_names(read.model)
        if served is None:
            served = SimpleNamespace(name="", aliases=())
            openai = openai.model_copy(update={"ignore_model_field": True})
        media = MediaFetcher(openai, storage.open_read) if fetch_media else None
        prepare = lambda text, line: check_line(text, line, served, openai, media)[0]  # noqa: E731

    def on_problem(item, exc):
        if quiet:
            return
        if as_json:
            click.echo(json.dumps(batch_error_line(exc), ensure_ascii=False))
        else:
            where = "<stdin>" if sources[item.source].path == "-" else sources[item.source].path
            param = f" [{exc.param}]" if exc.param else ""
            click.echo(f"{where}:{item.line}: {exc.code}{param}: {exc.message}")

    try:
        report = v.validate(sources, prepare, on_problem, storage, read.columns)
    finally:
        if media is not None:
            media.close()
    click.echo(v.summary(report, len(sources)), err=True)
    sys.exit(EXIT_OK if report.invalid == 0 else EXIT_TOO_MANY_FAILED)


def _tokenizer_model(model, max_model_len, trust_remote_code):
    from batchrun.footprint import tokenizer_model
    from batchrun.models.errors import ModelFolderError
    from batchrun.models.weights.loader import ModelNotFoundError

    try:
        return tokenizer_model(model, max_model_len, trust_remote_code)
    except (ModelNotFoundError, ModelFolderError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from exc


@click.command(epilog=EXIT_CODES_HELP,
               short_help="Run a job spec: run's options in a TOML file (cron, Airflow).")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--var", "variables", multiple=True, callback=pairs, metavar="NAME=VALUE",
              help="Value for {NAME} in the spec's paths (e.g. --var date=2024-06-01). Repeatable.")
@click.option("--restart", is_flag=True, help="Discard what an interrupted run committed.")
@click.option("--dry-run", is_flag=True, help="Print the resolved options and exit.")
@click.pass_context
def job(ctx, spec, variables, restart, dry_run):
    """Run the job spec SPEC (jobs/NAME.toml): the options of `batchrun run` in a TOML file. With
    `resume = true` in the spec, rerunning a failed or interrupted job continues it."""
    from batchrun.batch.shell.jobspec import JobSpecError, load

    try:
        opts = load(spec, variables)
    except JobSpecError as exc:
        raise UsageError(str(exc)) from exc
    if restart:
        opts.job = opts.job.model_copy(update={"restart": True})
    if dry_run:
        click.echo(json.dumps(opts.as_dict(), indent=2, default=str))
        sys.exit(EXIT_OK)
    sys.exit(execute(opts, model_loader(ctx)))


@click.command(cls=SectionedCommand, first=("plan",),
               short_help="Tokens, cache hits, memory and time a run would take; no weights.")
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click_options(PlanOptions, JobOptions, InputOptions, EngineConfig, OpenAIOptions,
               RequestDefaults, RayOptions, optional=("output",))
def plan(inputs, **kwargs):
    """Show what `batchrun run INPUT... [options]` would do, without loading the model's
    weights: lines (valid and invalid), prompt and completion tokens, the prefix cache's
    expected hit rate, the memory it reserves and an estimated wall time. With -o, also whether
    the run starts afresh, resumes, or has nothing to do."""
    from batchrun.batch.estimate.job_estimate import estimate_plan, report_text
    from batchrun.batch.job.plan import BatchConfigError, make_plan
    from batchrun.models.errors import ModelFolderError
    from batchrun.models.transformers.support import UnsupportedModelError

    shown = _options(lambda: from_cli(PlanOptions, kwargs))
    given_output = kwargs.get("output") is not None
    if not given_output:
        kwargs["output"] = "-"
    opts = _options(lambda: RunOptions.from_cli(inputs, kwargs))
    try:
        job_plan = make_plan(opts, report=True)
    except BatchConfigError as exc:
        raise UsageError(str(exc)) from exc
    try:
        estimate = estimate_plan(job_plan, shown.calibration, on_stage=lambda text:
                                 shown.as_json or click.echo(text + " ...", err=True))
    except (UnsupportedModelError, ModelFolderError, BatchConfigError) as exc:
        raise UsageError(str(exc)) from exc
    if not given_output:
        estimate.start = "unknown"
    if shown.as_json:
        click.echo(json.dumps(estimate.as_dict(), indent=2))
    else:
        click.echo(report_text(estimate))
    sys.exit(EXIT_OK)


COMMANDS = (run, validate, job, plan)
