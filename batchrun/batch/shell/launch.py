"""One `batchrun run` (or `batchrun job`): options -> plan -> model -> run_batch -> exit code.

Exit codes:
  0   the run completed and the failed fraction is within --max-failed-fraction (by default
      there is no limit: failed lines are in the error file, the run still succeeded)
  1   crash (a bug, an engine failure, storage unreachable mid-run, the output's lease lost
      to another run, a merged output without one record per input line): rerun with --resume
  2   usage or configuration error (bad option, missing input, unknown model, a staging folder
      of an interrupted run and neither --resume nor --restart, another live run writing the
      same output); nothing was run
  3   the run completed but more lines failed than --max-failed-fraction allows
  4   the --deadline passed: the lines done are in the output, every other line has a
      batch_expired error line; rerun with --resume (and a new --deadline) to run only those
  75  interrupted (SIGTERM/SIGINT): what finished is committed; rerun with --resume
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import click

from batchrun import phases
from batchrun.batch.job.result import RunResult
from batchrun.commandkit import (EXIT_CRASH, EXIT_EXPIRED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TOO_MANY_FAILED,
                                 Loader, Signals, UsageError, interrupted, load_model, on_ray)
from batchrun.options.run import RunOptions

log = logging.getLogger("batchrun.batch")


def execute(opts: RunOptions, load: Loader = load_model) -> int:
    """One run: plan it (usage errors before any model loads), load the model with `load`,
    run the plan, report; the exit code."""
    quiet = opts.job.quiet
    set_log_level(opts.job.log_level or ("warning" if quiet else "info"))
    phases.mark("start-up and command-line imports")
    from batchrun.batch.job import runner  # noqa: F401 (torch: timed as its own phase)
    from batchrun.batch.job.plan import BatchConfigError, make_plan

    phases.mark("imports of the batch job (torch)")
    load = on_ray(opts.ray, load)
    try:
        plan = make_plan(opts, hold_lease=True)  # another run on this output: refused here
    except BatchConfigError as exc:
        raise UsageError(str(exc)) from exc
    phases.mark("plan (inputs, outputs, preflight)")
    try:
        return _execute(opts, plan, load)
    finally:
        if plan.lease is not None:
            plan.lease.release()


def _execute(opts: RunOptions, plan: Any, load: Loader) -> int:
    from batchrun.batch.job.lease import LeaseLostError
    from batchrun.batch.job.staging import DamagedStagingError
    from batchrun.batch.job.loop import ChangedInputError, StopRequest
    from batchrun.batch.job.metrics import summary_text
    from batchrun.batch.job.plan import BatchConfigError
    from batchrun.batch.storage.lines import InputReadError
    from batchrun.batch.job.runner import run_batch

    quiet = opts.job.quiet
    if plan.deadline is not None and plan.deadline <= time.time():
        raise UsageError(f"--deadline {opts.job.deadline} has already passed")
    if plan.start == "done":
        if not quiet:
            click.echo(f"already completed: {plan.targets.output} holds this job's results over "
                       "the same inputs (--restart runs it again)", err=True)
        return _exit_code(run_batch(None, plan), opts)

    stop = StopRequest()
    with Signals(stop, log, grace=opts.job.grace_period):
        try:
            if not quiet:
                click.echo(f"loading model {opts.inputs.model or '(default: smollm2-135m)'} ...",
                           err=True)
            loaded = load(opts.inputs.model, opts.engine)
            phases.mark("model loaded")
            if stop.is_set():
                log.warning("interrupted before the run started")
                return EXIT_INTERRUPTED
            if not quiet:
                click.echo(f"running {len(plan.sources)} input file(s) on {loaded.name} "
                           f"({'resuming' if plan.start == 'resume' else 'fresh start'})",
                           err=True)
            try:
                result = run_batch(loaded, plan, stop=stop)
            finally:
                shutdown = getattr(loaded.engine, "shutdown", None)
                if opts.ray.ray and shutdown is not None:
                    shutdown()
        except (BatchConfigError, ChangedInputError) as exc:
            raise UsageError(str(exc)) from exc
        except (InputReadError, LeaseLostError, DamagedStagingError) as exc:
            click.echo(f"error: {exc}", err=True)
            return EXIT_CRASH
        except BrokenPipeError:
            _silence_stdout()
            click.echo(f"error: {_shown(plan.targets.output)} was closed before every record "
                       "was written (broken pipe: the reading process exited); the output is "
                       "incomplete", err=True)
            return EXIT_CRASH
        except KeyboardInterrupt:
            return interrupted(log)

    phases.mark("run (engine steps, commits, merge)")
    if result.completed:
        _remember_run(result.summary, loaded.name, opts)
    requests = result.requests
    if result.status == "incomplete":
        click.echo(f"error: the merged output {_shown(plan.targets.output)} has "
                   f"{result.summary['merged_records']} records for {requests.total} input "
                   "lines; the committed parts are kept: rerun with --resume", err=True)
        return EXIT_CRASH
    if result.status == "expired":
        expired = result.summary["expired"]
        if not quiet:
            click.echo(f"deadline passed: {requests.ok} lines ok and "
                       f"{requests.failed - expired} failed are in the output; "
                       f"{expired} lines not done got a batch_expired error line in "
                       f"{_shown(plan.targets.errors)}; rerun with --resume (and a later "
                       "--deadline) to run only those", err=True)
        return EXIT_EXPIRED
    if not result.completed:
        if not quiet:
            lines = result.summary.get("lines_in_job")
            left = f"; {lines - requests.total} of {lines} lines not done" if lines else ""
            click.echo(f"interrupted: {requests.total} lines done ({requests.ok} ok, "
                       f"{requests.failed} failed) and committed{left}; rerun with --resume "
                       "to finish", err=True)
        return EXIT_INTERRUPTED
    if stop.is_set():
        # The signal came after the last line was read and every line finished within the
        # grace period: the output is complete, but the run was still interrupted (75, as
        # documented); a rerun with --resume finds it completed.
        if not quiet:
            click.echo(f"interrupted after the last line was read: all {requests.total} "
                       "lines finished within the grace period and the output is complete",
                       err=True)
        return EXIT_INTERRUPTED
    if not quiet:
        click.echo(summary_text(result.summary), err=True)  # it says what earlier attempts did
        t = plan.targets
        written = [f"output: {_shown(t.output)}", f"errors: {_shown(t.errors)}"]
        if t.metrics:
            written.append(f"metrics: {t.metrics}")
        click.echo("; ".join(written), err=True)
    return _exit_code(result, opts)


def set_log_level(name: str) -> None:
    """batchrun's loggers at `name`; other libraries' stay at info or above (no debug noise)."""
    level = getattr(logging, name.upper())
    logging.getLogger().setLevel(max(level, logging.INFO))
    logging.getLogger("batchrun").setLevel(level)


def _remember_run(summary: Mapping[str, Any], model_name: str, opts: RunOptions) -> None:
    """Keep the run's metrics: `batchrun plan` calibrates its time estimate by them."""
    from batchrun.batch.estimate.job_estimate import run_key
    from batchrun.batch.estimate.run_store import save_run

    if summary.get("this_run", {}).get("ok"):
        try:
            save_run(summary, run_key(model_name, opts.engine))
        except OSError as exc:  # a read-only home must not fail a finished run
            log.warning("could not keep this run's metrics for `batchrun plan`: %s", exc)


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's last flush is quiet."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _shown(path: str) -> str:
    return "stdout" if path == "-" else path


def _exit_code(result: RunResult, opts: RunOptions) -> int:
    requests = result.requests
    limit = opts.job.max_failed_fraction
    if limit is not None and requests.total and requests.failed / requests.total > limit:
        click.echo(f"error: {requests.failed} of {requests.total} lines failed, more than "
                   f"--max-failed-fraction {limit}", err=True)
        return EXIT_TOO_MANY_FAILED
    return EXIT_OK
