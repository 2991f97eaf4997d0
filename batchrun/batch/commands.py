"""`batchrun run`, `batchrun validate`, `batchrun job` (registered on the main group in cli.py)."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from batchrun.batch.formats import FORMAT_NAMES
from batchrun.batch.launch import EXIT_OK, EXIT_TOO_MANY_FAILED, RunOptions, UsageError, execute
from batchrun.engine_options import engine_options, size_option
from batchrun.openai.parsers import REASONING_PARSERS, TOOL_PARSERS

EXIT_CODES_HELP = """\b
Exit codes:
  0   completed; failed lines (in the error file) within --max-failed-fraction
  1   crash; what finished is committed: rerun with --resume
  2   usage or configuration error; nothing was run
  3   completed, but the failed fraction is over --max-failed-fraction
  75  interrupted by SIGTERM/SIGINT; what finished is committed: rerun with --resume
"""


def _json_dict(ctx, param, value):
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object")
    return parsed


def _pairs(ctx, param, values):
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r}: use NAME=VALUE")
        out[key.strip()] = val.strip()
    return out


storage_option = click.option(
    "--storage-options", callback=_json_dict, metavar="JSON",
    help='fsspec options for object stores, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\', '
         'or keyed by protocol: \'{"s3": {...}, "http": {...}}\'.')
input_format_option = click.option(
    "--input-format", type=click.Choice(FORMAT_NAMES), help="Override the input extension.")
column_option = click.option(
    "--column", "columns", multiple=True, callback=_pairs, metavar="FIELD=COLUMN",
    help="Parquet input: take request FIELD (custom_id, body, messages, prompt, max_tokens, ...) "
         "from COLUMN. Repeatable.")


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option("-o", "--output", required=True,
              help="Output file: path, fsspec URL (s3://, gs://) or - for stdout.")
@click.option("--errors", help="Error file [default: <output stem>.errors.<ext>; with -o -, "
                               "error records go to stdout with the results].")
@click.option("--metrics", help="Metrics JSON [default: <output stem>.metrics.json].")
@click.option("--model", help="Registry name, HF folder, .gguf file or hub id "
                              "[default: the bundled smollm2-135m].")
@engine_options
@click.option("--max-in-flight", type=click.IntRange(min=1),
              help="Requests handed to the engine at once [default: 4 x max-num-seqs].")
@click.option("--temperature", type=click.FloatRange(0, 2),
              help="Temperature for requests that leave it out.")
@click.option("--max-tokens", type=click.IntRange(min=1),
              help="max_tokens for requests that leave it out [default: fill the context].")
@click.option("--ignore-model-field", is_flag=True,
              help="Run every request on the loaded model whatever its `model` field says.")
@click.option("--chat-template", metavar="FILE", help="A Jinja chat template overriding the "
              "model's (e.g. one that renders tools: batchrun/openai/templates/chatml_tools.jinja).")
@click.option("--tool-parser", type=click.Choice(sorted(TOOL_PARSERS)), help="How tool calls are "
              "read from the output [default: from the chat template's markers].")
@click.option("--reasoning-parser", type=click.Choice(sorted(REASONING_PARSERS)), help="Move "
              "<think>...</think> into message.reasoning_content [default: leave it in content].")
@storage_option
@input_format_option
@click.option("--output-format", type=click.Choice(FORMAT_NAMES),
              help="Override the output extension.")
@column_option
@click.option("--staging", metavar="URL", help="Where results are committed while the job runs "
              "[default: <output>.batchrun-staging; a temporary folder for -o -].")
@click.option("--resume", is_flag=True, help="Continue an interrupted run: lines with a committed "
              "result are not run again (starts afresh when there is nothing to resume).")
@click.option("--restart", is_flag=True, help="Discard what an interrupted run committed.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output or error file that "
              "is not this job's own result (without it, that is a usage error).")
@click.option("--on-changed-input", type=click.Choice(["rerun", "fail"]), default="rerun",
              show_default=True, help="Resuming, a line whose content changed since its result "
              "was committed: run it again, or stop with exit code 2.")
@click.option("--retry-failed", is_flag=True, help="With --resume, also rerun lines whose error "
              "was retryable (engine errors, not validation errors).")
@click.option("--max-failed-fraction", type=click.FloatRange(0, 1), help="Exit with code 3 when "
              "more than this fraction of lines failed [default: no limit].")
@click.option("--grace-period", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM/SIGINT.")
@click.option("--commit-interval", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds a finished result may wait before it is committed.")
@click.option("--progress", type=click.Choice(["auto", "bar", "log", "none"]), default="auto",
              show_default=True, help="A bar, or plain log lines without carriage returns (for "
              "scheduler logs); auto = bar on a terminal, log lines otherwise.")
@click.option("--log-interval", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds between progress log lines.")
@click.option("-q", "--quiet", is_flag=True, help="No progress and no summary; warnings only.")
def run(inputs, **kwargs):
    """Run the batch files INPUT... (JSONL, JSONL.gz/.zst or Parquet; files, folders, globs,
    fsspec URLs or - for stdin) as one job and write the results in input order."""
    sys.exit(execute(RunOptions(inputs=list(inputs), **kwargs)))


@click.command(epilog="\b\nExit codes: 0 every line is valid, 3 some lines are not, 2 usage error.")
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option("--model", help="The model the run would use (for the `model` field check and, "
                              "with --check-prompts, its tokenizer) [default: smollm2-135m].")
@click.option("--check-prompts", is_flag=True, help="Also render each chat template and check "
              "the prompt length (loads the model's tokenizer, not its weights).")
@click.option("--max-model-len", type=click.IntRange(min=2), help="Context length to check "
              "against [default: the model's].")
@click.option("--ignore-model-field", is_flag=True, help="Do not check the `model` field.")
@click.option("--chat-template", metavar="FILE", help="With --check-prompts: the template the "
              "run will use (tools need one that renders them).")
@click.option("--tool-parser", type=click.Choice(sorted(TOOL_PARSERS)),
              help="With --check-prompts: the run's --tool-parser.")
@storage_option
@input_format_option
@column_option
@click.option("--json", "as_json", is_flag=True,
              help="Print problems as error-file records (JSON lines) instead of text.")
@click.option("-q", "--quiet", is_flag=True, help="Only the summary.")
def validate(inputs, model, check_prompts, max_model_len, ignore_model_field, chat_template,
             tool_parser, storage_options, input_format, columns, as_json, quiet):
    """Check the batch files INPUT... and report every problem (line, field, message) that the
    run would reject, with counts, without running a model."""
    from types import SimpleNamespace

    from batchrun.batch import validate as v
    from batchrun.batch.readers import check_sources, open_sources
    from batchrun.batch.runner import check_line, prepare_line
    from batchrun.openai.response import batch_error_line

    try:
        sources = open_sources(list(inputs), storage_options, input_format)
        check_sources(sources, storage_options, columns)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    openai = RunOptions(inputs=[], output="", chat_template=chat_template,
                        tool_parser=tool_parser).openai_options()
    config = SimpleNamespace(ignore_model_field=ignore_model_field, defaults=_defaults(), **openai)
    if check_prompts:
        served = _tokenizer_model(model, max_model_len)
        prepare = lambda text, line: prepare_line(text, line, served, config)  # noqa: E731
    else:
        served = v.served_names(model)
        if served is None:
            served, config.ignore_model_field = SimpleNamespace(name="", aliases=()), True
        prepare = lambda text, line: check_line(text, line, served, config)[0]  # noqa: E731

    def on_problem(item, exc):
        if quiet:
            return
        if as_json:
            click.echo(json.dumps(batch_error_line(exc), ensure_ascii=False))
        else:
            where = "<stdin>" if sources[item.source].path == "-" else sources[item.source].path
            param = f" [{exc.param}]" if exc.param else ""
            click.echo(f"{where}:{item.line}: {exc.code}{param}: {exc.message}")

    report = v.validate(sources, prepare, on_problem, storage_options, columns)
    click.echo(v.summary(report, len(sources)), err=True)
    sys.exit(EXIT_OK if report.invalid == 0 else EXIT_TOO_MANY_FAILED)


def _defaults():
    from batchrun.openai.params import RequestDefaults

    return RequestDefaults()


def _tokenizer_model(model, max_model_len):
    from batchrun.batch.validate import tokenizer_model
    from batchrun.models.loader import ModelNotFoundError

    try:
        return tokenizer_model(model, max_model_len)
    except (ModelNotFoundError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from exc


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--var", "variables", multiple=True, callback=_pairs, metavar="NAME=VALUE",
              help="Value for {NAME} in the spec's paths (e.g. --var date=2024-06-01). Repeatable.")
@click.option("--restart", is_flag=True, help="Discard what an interrupted run committed.")
@click.option("--dry-run", is_flag=True, help="Print the resolved options and exit.")
def job(spec, variables, restart, dry_run):
    """Run the job spec SPEC (jobs/NAME.toml): the options of `batchrun run` in a TOML file. With
    `resume = true` in the spec, rerunning a failed or interrupted job continues it."""
    from batchrun.batch.jobspec import JobSpecError, load

    try:
        opts = load(spec, variables)
    except JobSpecError as exc:
        raise UsageError(str(exc)) from exc
    if restart:
        opts.restart = True
    if dry_run:
        click.echo(json.dumps(dataclasses.asdict(opts), indent=2))
        sys.exit(EXIT_OK)
    sys.exit(execute(opts))


COMMANDS = (run, validate, job)
