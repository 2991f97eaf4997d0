"""The batch job: stream OpenAI batch lines through the engine, commit results as they complete,
merge them into input order at the end.

Public entry point: `run_batch(loaded_model, RunConfig(...), stop=..., on_progress=...)`. It
works on an already loaded model (the CLI loads one per run; the server shares its own), can be
stopped from another thread with any object that has `is_set()` (a threading.Event, or
job.StopRequest for a graceful-then-immediate stop), and reports request counts through
`on_progress(Counts)` after every commit.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

from batchrun.batch import io
from batchrun.batch.formats import detect
from batchrun.batch.job import Job
from batchrun.batch.metrics import RunMetrics
from batchrun.batch.preflight import check_outputs
from batchrun.batch.progress import Counts, Reporter, resolve_mode
from batchrun.batch.readers import Source, check_sources, count_records, open_sources, read_all
from batchrun.batch.sinks import RecordSink
from batchrun.batch.staging import Committed, Staging, StagingError
from batchrun.engine.sampling_params import SamplingParams
from batchrun.openai.params import RequestDefaults, check_model_field
from batchrun.openai.protocol import LineError, RequestError, parse_batch_line, parse_envelope
from batchrun.openai.response import new_request_id
from batchrun.openai.serving import PreparedRequest, ServingOptions, serving_for

log = logging.getLogger("batchrun.batch")
STAGING_SUFFIX = ".batchrun-staging"


class BatchConfigError(ValueError):
    """Something the user must fix before the job can run (a usage error, exit code 2)."""


@dataclass
class RunConfig:
    input: str | list[str]  # files, folders, globs, fsspec URLs or "-" (stdin), as one job
    output: str  # path, fsspec URL or "-" (stdout)
    errors: str | None = None  # None = <output stem>.errors.<ext>; for "-" output: stdout too
    metrics: str | None = None  # None = <output stem>.metrics.json; none for "-" output
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    ignore_model_field: bool = False
    # Requests handed to the engine and not yet finished; the engine's scheduler picks among them.
    max_in_flight: int = 256
    progress: str | bool = "auto"  # auto | bar | log | none (True = auto, False = none)
    log_interval: float = 30.0  # seconds between progress lines in log mode
    storage_options: dict | None = None
    input_format: str | None = None  # override the extension: jsonl, jsonl.gz, parquet, ...
    output_format: str | None = None
    columns: dict[str, str] = field(default_factory=dict)  # Parquet: request field -> column
    staging: str | None = None  # None = <output>.batchrun-staging (a temp folder for "-")
    resume: bool = False  # continue from what an interrupted run committed
    restart: bool = False  # discard what an interrupted run committed
    overwrite: bool = False  # replace an output or error file that is not this job's result
    on_changed_input: str = "rerun"  # resuming, a committed line that changed: rerun | fail
    retry_failed: bool = False  # with resume: run again lines whose error was retryable
    commit_every: int = 1000  # records per committed part at most
    commit_interval: float = 2.0  # seconds a finished record may wait for its commit
    grace_period: float = 10.0  # seconds in-flight requests get to finish after a stop
    merge_on_stop: bool = False  # after a stop, still write what is done (the server's cancel)
    chat_template: str | None = None  # template text overriding the model's (--chat-template)
    tool_parser: str | None = None  # None = the format the chat template teaches, if any
    reasoning_parser: str | None = None  # None = reasoning stays in content

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @property
    def output_fmt(self):
        return detect(self.output, self.output_format)

    @property
    def errors_path(self) -> str:
        if self.errors:
            return self.errors
        if self.output == io.STDIO:
            return io.STDIO
        return io.sibling_path(self.output, f".errors.{self.output_fmt}")

    @property
    def metrics_path(self) -> str | None:
        if self.metrics or self.output == io.STDIO:
            return self.metrics
        return io.sibling_path(self.output, ".metrics.json")

    @property
    def staging_path(self) -> str | None:
        if self.staging or self.output == io.STDIO:
            return self.staging
        return self.output + STAGING_SUFFIX


@dataclass
class Prepared:
    custom_id: str
    request_id: str
    prompt_token_ids: list[int]  # the first prompt; a completions line may have several
    params: SamplingParams
    request: PreparedRequest | None = None  # the OpenAI adapter: prompts, finalize(outputs)

    @property
    def engine_requests(self) -> list[tuple[str, list[int]]]:
        """(engine request id, prompt) of each engine request this line needs."""
        prompts = self.request.prompts if self.request else [self.prompt_token_ids]
        if len(prompts) == 1:
            return [(self.request_id, prompts[0])]
        return [(f"{self.request_id}-{k}", p) for k, p in enumerate(prompts)]


def check_line(raw: str, line_number: int, model: Any, config: RunConfig):
    """The checks of prepare_line that need no tokenizer (`batchrun validate` without one).
    `model` needs only `name` and `aliases`."""
    line, request = parse_batch_line(raw, line_number)
    try:
        if request.stream:
            raise RequestError("stream: streaming is not available in a batch file",
                               code="unsupported_value", param="stream")
        check_model_field(request.model, model.name, model.aliases, config.ignore_model_field)
    except RequestError as exc:
        raise LineError(line_number, exc, line.custom_id) from None
    return line, request


def serving_options(config: Any) -> ServingOptions:
    return ServingOptions(defaults=config.defaults, ignore_model_field=config.ignore_model_field,
                          chat_template=getattr(config, "chat_template", None),
                          tool_parser=getattr(config, "tool_parser", None),
                          reasoning_parser=getattr(config, "reasoning_parser", None))


def prepare_line(raw: str, line_number: int, model: Any, config: RunConfig) -> Prepared:
    """Validate, render and parameterise one input line; raise LineError for a bad one.
    `model` needs tokenizer, name, aliases, max_model_len and generation_defaults (no engine)."""
    line = parse_envelope(raw, line_number)
    try:
        request = serving_for(model, serving_options(config)).prepare(line.url, line.body,
                                                                      allow_stream=False)
    except RequestError as exc:
        raise LineError(line_number, exc, line.custom_id) from None
    return Prepared(line.custom_id, new_request_id(), request.prompts[0], request.params, request)


def _setup(config: RunConfig) -> tuple[list[Source], list[list]]:
    """The job's sources and their fingerprint; raises BatchConfigError for usage problems."""
    so = config.storage_options
    try:
        config.output_fmt  # noqa: B018 - an unknown --output-format fails before any work
        detect(config.errors_path)
        sources = open_sources(config.inputs, so, config.input_format)
        check_outputs(config, [s.path for s in sources])
        check_sources(sources, so, config.columns)
    except (FileNotFoundError, ValueError) as exc:
        raise BatchConfigError(str(exc)) from exc
    return sources, [[s.path, io.size(s.path, so), io.version(s.path, so)] for s in sources]


def _staging_conflict(staging: Staging, config: RunConfig, inputs: list[list]) -> bool:
    """Whether to resume from `staging`; raises StagingError where the user must decide."""
    if staging.has_files() and not (config.resume or config.restart):
        raise StagingError(
            f"{staging.url} holds the committed results of an interrupted run of this job. Pass "
            "--resume to continue it (only lines without a result run), or --restart to discard "
            "them.")
    resume = staging.exists() and config.resume and not config.restart
    if resume:
        staging.check_inputs(inputs)
    return resume


def check_config(config: RunConfig) -> dict[str, Any] | None:
    """Every usage check run_batch makes, for the CLI to fail fast before loading a model.
    Raises BatchConfigError. Returns the metrics of an earlier run that already completed this
    job (with resume), when there is nothing to do."""
    _, inputs = _setup(config)
    done = _already_completed(config, inputs)
    if done is not None:
        return done
    if config.staging_path:
        staging = Staging(config.staging_path, config.storage_options)
        try:
            if staging.local and os.path.isdir(staging.root):
                staging.lock()
                staging.unlock()
            _staging_conflict(staging, config, inputs)
        except StagingError as exc:
            raise BatchConfigError(str(exc)) from exc
    return None


def _open_staging(config: RunConfig, inputs: list[list]) -> tuple[Staging, Committed]:
    """The job's staging, locked for this run (unlock() when done)."""
    url = config.staging_path or tempfile.mkdtemp(prefix="batchrun-staging-")
    staging = Staging(url, config.storage_options)
    try:
        staging.lock()
        resume = _staging_conflict(staging, config, inputs)
        if resume:
            staging.clean_scratch()
            committed = staging.scan()
            log.info("resuming: %d lines already have a committed record in %s",
                     committed.count, url)
            return staging, committed
        staging.clear()
        if config.metrics_path:
            io.remove(config.metrics_path, config.storage_options)  # "completed" is no longer true
        staging.create({"inputs": inputs, "output": config.output, "errors": config.errors_path})
        return staging, Committed()
    except BaseException as exc:
        staging.unlock()
        if isinstance(exc, StagingError):
            raise BatchConfigError(str(exc)) from exc
        raise


def _already_completed(config: RunConfig, inputs: list[list]) -> dict[str, Any] | None:
    """With resume: the metrics of an earlier run that completed this job over the very same
    inputs (path, size, version), so that rerunning a finished scheduled job does nothing."""
    so = config.storage_options
    if not config.resume or config.restart or not config.metrics_path or not config.staging_path:
        return None
    try:
        old = io.read_json(config.metrics_path, so)
    except (OSError, ValueError):
        return None
    if (not isinstance(old, dict) or old.get("status") != "completed"
            or old.get("input_fingerprint") != inputs or not io.exists(config.output, so)):
        return None
    log.info("this job already completed over the same inputs (%s); nothing to do "
             "(--restart runs it again)", config.metrics_path)
    # A fresh run deletes the metrics file first, so a completed one belongs to the run that
    # made any staging left here: it was killed while removing it.
    Staging(config.staging_path, so).remove()
    return {**old, "already_completed": True}


def _finalize(staging: Staging, config: RunConfig,
              last_lines: dict[int, int] | None) -> dict[int, int]:
    """Merge the committed parts into the output and error files (each published atomically)."""
    so = config.storage_options
    out = RecordSink(config.output, config.output_fmt, so)
    err_path = config.errors_path
    err = out if err_path == config.output else RecordSink(err_path, detect(err_path), so)
    try:
        counts = staging.merge(out.write, err.write, last_lines)
        if err is not out:
            err.commit()
        out.commit()
    except BaseException:
        out.abort()
        if err is not out:
            err.abort()
        raise
    return counts


def run_batch(model: Any, config: RunConfig, stop: Any = None,
              on_progress: Callable[[Counts], None] | None = None) -> dict[str, Any]:
    """Run the whole input through model.engine; return the metrics summary (also written to
    the metrics file). `summary["status"]` is "completed", or "interrupted" after a stop (the
    committed results stay in staging for --resume unless config.merge_on_stop).

    `model` is a batchrun.llm.LoadedModel (engine, tokenizer, name, aliases,
    generation_defaults, max_model_len). Raises BatchConfigError for what the user must fix
    (missing input, unknown format, staging of another job, ...) before any work is done.
    """
    sources, inputs = _setup(config)
    done = _already_completed(config, inputs)
    if done is not None:
        if on_progress is not None:
            r = done["requests"]
            on_progress(Counts(r["total"], r["ok"], r["failed"], r["total"]))
        return done
    staging, committed = _open_staging(config, inputs)
    try:
        return _run(model, config, sources, inputs, staging, committed, stop, on_progress)
    finally:
        staging.unlock()


def _run(model: Any, config: RunConfig, sources: list[Source], inputs: list[list],
         staging: Staging, committed: Committed, stop: Any,
         on_progress: Callable[[Counts], None] | None) -> dict[str, Any]:
    so = config.storage_options
    metrics = RunMetrics()
    mode = resolve_mode(config.progress)
    total = count_records(sources, so) if mode != "none" or on_progress else None
    counts = Counts(total=total)
    reporter = Reporter(mode, counts, metrics, config.log_interval)
    names = [s.path for s in sources] if len(sources) > 1 else None
    lines = read_all(sources, so, config.columns)
    job = Job(model, config, lines, staging, committed, counts, reporter, metrics, prepare_line,
              names, stop, on_progress)
    try:
        status = job.run()
    finally:
        reporter.close()

    merged = None
    if status == "completed" or config.merge_on_stop:
        merged = _finalize(staging, config, job.last_lines if status == "completed" else None)
    elif config.staging_path is None:
        log.warning("the committed results are in %s; rerun with --staging %s --resume to "
                    "continue", staging.url, staging.url)

    result = metrics.summary(model.engine, model=model.name, status=status,
                             input=config.inputs if len(config.inputs) > 1 else config.inputs[0],
                             output=config.output, errors=config.errors_path)
    result["requests"] = {"total": counts.done, "ok": counts.completed, "failed": counts.failed}
    result["resumed"] = counts.resumed
    result["this_run"] = {"ok": metrics.ok, "failed": metrics.failed}
    result["input_fingerprint"] = inputs
    if merged is not None and sum(merged.values()) != counts.done:
        log.warning("the merged output has %d records for %d input lines",
                    sum(merged.values()), counts.done)
    if config.metrics_path:
        io.write_json(config.metrics_path, result, so)
    if merged is not None:
        # Last: while staging exists a rerun re-merges; once it is gone, the metrics file
        # (written above) says the job is complete.
        staging.remove()
    if on_progress is not None:
        on_progress(counts)
    return result
