"""One `batchrun run` (or `batchrun job`): options -> checks -> model -> run_batch -> exit code.

Exit codes:
  0   the run completed and the failed fraction is within --max-failed-fraction (by default
      there is no limit: failed lines are in the error file, the run still succeeded)
  1   crash (a bug, an engine failure, storage unreachable mid-run): rerun with --resume
  2   usage or configuration error (bad option, missing input, unknown model, a staging folder
      of an interrupted run and neither --resume nor --restart); nothing was run
  3   the run completed but more lines failed than --max-failed-fraction allows
  75  interrupted (SIGTERM/SIGINT): what finished is committed; rerun with --resume
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import click

EXIT_OK, EXIT_CRASH, EXIT_USAGE, EXIT_TOO_MANY_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 75
log = logging.getLogger("batchrun.batch")


@dataclass
class RunOptions:
    """Everything `batchrun run` takes; a job spec fills the same fields."""

    inputs: list[str]
    output: str
    errors: str | None = None
    metrics: str | None = None
    model: str | None = None
    # engine
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    threads: int | None = None
    kv_cache_memory: int | None = None
    no_prefix_cache: bool = False
    max_in_flight: int | None = None
    # request defaults
    temperature: float | None = None
    max_tokens: int | None = None
    ignore_model_field: bool = False
    # OpenAI surface
    chat_template: str | None = None  # a template file overriding the model's
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # storage and formats
    storage_options: dict | None = None
    input_format: str | None = None
    output_format: str | None = None
    columns: dict[str, str] = field(default_factory=dict)
    # robustness
    staging: str | None = None
    resume: bool = False
    restart: bool = False
    overwrite: bool = False
    on_changed_input: str = "rerun"
    retry_failed: bool = False
    max_failed_fraction: float | None = None
    grace_period: float = 10.0
    commit_interval: float = 2.0
    # reporting
    progress: str = "auto"
    log_interval: float = 30.0
    quiet: bool = False

    def engine_config(self):
        from batchrun.config import EngineConfig

        overrides = {"dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
                     "enable_prefix_caching": not self.no_prefix_cache,
                     "max_num_seqs": self.max_num_seqs,
                     "max_num_batched_tokens": self.max_batched_tokens,
                     "max_model_len": self.max_model_len, "threads": self.threads,
                     "kv_cache_memory": self.kv_cache_memory}
        return EngineConfig.default(**{k: v for k, v in overrides.items() if v is not None})

    def openai_options(self) -> dict[str, Any]:
        """--chat-template (read now), --tool-parser, --reasoning-parser; UsageError if bad."""
        from batchrun.openai.parsers import reasoning_parser, tool_parser
        from batchrun.openai.render import load_chat_template

        try:
            template = load_chat_template(self.chat_template) if self.chat_template else None
            if self.tool_parser:
                tool_parser(self.tool_parser)
            if self.reasoning_parser:
                reasoning_parser(self.reasoning_parser)
        except (OSError, ValueError) as exc:
            raise UsageError(str(exc)) from exc
        return {"chat_template": template, "tool_parser": self.tool_parser,
                "reasoning_parser": self.reasoning_parser}

    def run_config(self, max_num_seqs: int):
        from batchrun.batch.runner import RunConfig
        from batchrun.openai.params import RequestDefaults

        return RunConfig(**self.openai_options(),
            input=list(self.inputs), output=self.output, errors=self.errors,
            metrics=self.metrics,
            defaults=RequestDefaults(temperature=self.temperature, max_tokens=self.max_tokens),
            ignore_model_field=self.ignore_model_field,
            max_in_flight=self.max_in_flight or 4 * max_num_seqs,
            progress="none" if self.quiet else self.progress, log_interval=self.log_interval,
            storage_options=self.storage_options, input_format=self.input_format,
            output_format=self.output_format, columns=dict(self.columns), staging=self.staging,
            resume=self.resume, restart=self.restart, retry_failed=self.retry_failed,
            overwrite=self.overwrite, on_changed_input=self.on_changed_input,
            grace_period=self.grace_period, commit_interval=self.commit_interval)


class UsageError(click.ClickException):
    exit_code = EXIT_USAGE


def load_model(model: str | None, engine_config: Any) -> Any:
    """llm.load through the CLI's error mapping. BATCHRUN_TEST_ENGINE=module:function swaps in
    another loader (the test suite's fake engine, for fast subprocess tests)."""
    hook = os.environ.get("BATCHRUN_TEST_ENGINE")
    if hook:
        import importlib

        module, _, name = hook.partition(":")
        return getattr(importlib.import_module(module), name)(model, engine_config)
    from batchrun.cli import _load_model

    return _load_model(model, engine_config)


class _Signals:
    """SIGINT/SIGTERM: the first stops admitting and lets in-flight requests finish within the
    grace period, the second drops them, the third raises KeyboardInterrupt."""

    def __init__(self, stop: Any):
        self.stop = stop
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stop.immediate:
            raise KeyboardInterrupt
        self.stop.set()
        if self.stop.immediate:
            log.warning("%s again: dropping the requests in flight", name)
        else:
            log.warning("%s: stopping (send it again to stop at once)", name)

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def execute(opts: RunOptions) -> int:
    from batchrun.batch.job import ChangedInputError, StopRequest
    from batchrun.batch.readers import InputReadError
    from batchrun.batch.metrics import summary_text
    from batchrun.batch.runner import BatchConfigError, check_config, run_batch

    if opts.quiet:
        logging.getLogger().setLevel(logging.WARNING)
    engine_config = opts.engine_config()
    config = opts.run_config(engine_config.scheduler.max_num_seqs)
    try:
        result = check_config(config)
    except BatchConfigError as exc:
        raise UsageError(str(exc)) from exc
    if result is not None:
        if not opts.quiet:
            click.echo(f"already completed: {config.output} holds this job's results over the "
                       "same inputs (--restart runs it again)", err=True)
        return _exit_code(result, opts)

    stop = StopRequest()
    with _Signals(stop):
        try:
            loaded = load_model(opts.model, engine_config)
            if stop.is_set():
                log.warning("interrupted before the run started")
                return EXIT_INTERRUPTED
            result = run_batch(loaded, config, stop=stop)
        except (BatchConfigError, ChangedInputError) as exc:
            raise UsageError(str(exc)) from exc
        except InputReadError as exc:
            click.echo(f"error: {exc}", err=True)
            return EXIT_CRASH
        except KeyboardInterrupt:
            log.warning("interrupted; what finished is committed: rerun with --resume")
            return EXIT_INTERRUPTED

    requests = result["requests"]
    if result["status"] != "completed":
        if not opts.quiet:
            click.echo(f"interrupted: {requests['total']} lines done ({requests['ok']} ok, "
                       f"{requests['failed']} failed) and committed; rerun with --resume to "
                       "finish", err=True)
        return EXIT_INTERRUPTED
    if not opts.quiet:
        click.echo(summary_text(result), err=True)
        if result.get("resumed"):
            click.echo(f"{result['resumed']} of these lines were committed by an earlier "
                       "attempt.", err=True)
        click.echo(f"output: {config.output}; errors: {config.errors_path}; "
                   f"metrics: {config.metrics_path}", err=True)
    return _exit_code(result, opts)


def _exit_code(result: dict, opts: RunOptions) -> int:
    requests = result["requests"]
    limit = opts.max_failed_fraction
    if limit is not None and requests["total"] and requests["failed"] / requests["total"] > limit:
        click.echo(f"error: {requests['failed']} of {requests['total']} lines failed, more than "
                   f"--max-failed-fraction {limit}", err=True)
        return EXIT_TOO_MANY_FAILED
    return EXIT_OK
