"""A run resolved once, before any model loads: RunOptions -> a frozen JobPlan.

Everything that touches storage to set a job up happens here, once: globs are expanded, input
files stat'ed (size and version: the fingerprint), Parquet schemas checked, output locations
checked (preflight), the chat template read, and the resume decision made (a fresh start, a
resume from staging, or nothing to do because this job already completed over these inputs).
`run_batch` takes the plan as it is; `batchrun plan` prints it with its estimates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from batchrun.batch.storage import io
from batchrun.batch.storage.formats import Format, detect
from batchrun.batch.job.lease import OutputBusyError, OutputLease, current_holder, lease_for
from batchrun.batch.job.preflight import check_outputs
from batchrun.batch.storage.lines import Source
from batchrun.batch.storage.readers import check_sources, open_sources
from batchrun.batch.job.staging import Staging, StagingError
from batchrun.batch.storage.store import Storage
from batchrun.options.durations import parse_deadline
from batchrun.options.engine import EngineConfig
from batchrun.options.job import InputOptions, JobOptions
from batchrun.openai.serving import ServingOptions
from batchrun.options.run import RunOptions

log = logging.getLogger("batchrun.batch")
STAGING_SUFFIX = ".batchrun-staging"


class BatchConfigError(ValueError):
    """Something the user must fix before the job can run (a usage error, exit code 2)."""


# How a run starts: JobPlan.start.
JobStart = Literal["fresh", "resume", "done", "undecided", "busy"]

@dataclass(frozen=True)
class Targets:
    """Where a job writes. None: not written (metrics with -o -) or a temporary staging."""

    output: str
    output_format: Format
    errors: str
    errors_format: Format
    metrics: str | None
    staging: str | None

    @classmethod
    def of(cls, job: JobOptions) -> "Targets":
        out_fmt = detect(job.output, job.output_format)
        if job.errors:
            errors = job.errors
        elif job.output == io.STDIO:
            errors = io.STDIO
        else:
            errors = io.sibling_path(job.output, f".errors.{out_fmt}")
        metrics = job.metrics if job.metrics or job.output == io.STDIO else \
            io.sibling_path(job.output, ".metrics.json")
        staging = job.staging if job.staging or job.output == io.STDIO else \
            job.output + STAGING_SUFFIX
        return cls(job.output, out_fmt, errors, detect(errors), metrics, staging)


@dataclass(frozen=True)
class JobPlan:
    inputs: InputOptions
    job: JobOptions
    serving: ServingOptions  # the adapter's options, the chat template read
    engine: EngineConfig
    storage: Storage
    sources: tuple[Source, ...]
    fingerprint: tuple[tuple[str, int | None, str | None], ...]  # (path, size, version) each
    targets: Targets
    # fresh: start afresh (clearing any staging); resume: continue from staging; done: an
    # earlier run completed this job over the same inputs (its metrics are `previous`).
    # Only in a report (`batchrun plan`), where a run would refuse: undecided (staging of an
    # interrupted run, neither --resume nor --restart), busy (another run holds the lease).
    start: JobStart
    previous: dict[str, Any] | None
    max_in_flight: int
    # The output's lease when make_plan took it (hold_lease): the caller releases it.
    lease: OutputLease | None = None
    committed: int = 0  # lines with a committed record in the staging (resume, undecided)
    busy: str | None = None  # who holds the output's lease (start "busy")
    deadline: float | None = None  # Unix time: lines not done by then expire (--deadline)

    @property
    def input_paths(self) -> list[str]:
        return [s.path for s in self.sources]

    @property
    def fingerprint_json(self) -> list[list]:
        return [list(f) for f in self.fingerprint]

    @property
    def input_label(self) -> str | list[str]:
        args = self.inputs.input
        return args if len(args) > 1 else args[0]


def make_plan(opts: RunOptions, hold_lease: bool = False, report: bool = False) -> JobPlan:
    """Raises BatchConfigError for everything the user must fix (a usage error), another live
    run writing the output included. With `hold_lease` the plan holds the output's lease (taken
    before the resume decision, so that decision cannot race another run): release it. With
    `report` (`batchrun plan`), what would stop a run on its staging or lease is the plan's
    `start` (undecided, busy) instead of an error."""
    job, storage = opts.job, Storage(opts.inputs.storage_options)
    try:
        targets = Targets.of(job)
        sources = tuple(open_sources(opts.inputs.input, storage, opts.inputs.input_format))
        check_outputs(targets, job, storage, [s.path for s in sources])
        check_sources(list(sources), storage, opts.inputs.columns)
        serving = ServingOptions.of(opts.openai, opts.defaults, storage.open_read)
    except (OSError, ValueError) as exc:
        raise BatchConfigError(str(exc)) from exc
    busy = None
    try:
        lease = _lease(job, targets, storage, hold_lease)
    except BatchConfigError as exc:
        if not report:
            raise
        lease, busy = None, str(exc)
    try:
        fingerprint = tuple((s.path, storage.size(s.path), storage.version(s.path))
                            for s in sources)
        previous = _already_completed(job, targets, storage, fingerprint)
        start: JobStart = "done" if previous is not None else _start(job, targets, storage, fingerprint,
                                                           report)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    committed = 0
    if start in ("resume", "undecided") and targets.staging:
        committed = Staging(targets.staging, storage).committed_lines()
    return JobPlan(opts.inputs, job, serving, opts.engine, storage, sources,
                   fingerprint, targets, "busy" if busy else start, previous,
                   job.max_in_flight or default_max_in_flight(opts.engine), lease,
                   committed, busy,
                   parse_deadline(job.deadline, time.time()) if job.deadline else None)


def default_max_in_flight(engine: EngineConfig) -> int:
    """Lines in flight without --max-in-flight: enough queued work to keep every sequence
    slot of the engine busy."""
    return 4 * engine.scheduler.max_num_seqs


def _lease(job: JobOptions, targets: Targets, storage: Storage,
           hold: bool) -> OutputLease | None:
    """Acquire the output's lease (hold), or only check that no live run holds it."""
    try:
        if hold:
            lease = lease_for(targets.output, storage, job.lease_ttl)
            return lease.acquire() if lease is not None else None
        if targets.output != io.STDIO:
            holder = current_holder(targets.output, storage.options)
            if holder is not None:
                raise OutputBusyError(f"another batchrun run is writing {targets.output} "
                                      f"({holder.describe()})")
    except (OutputBusyError, OSError) as exc:
        raise BatchConfigError(str(exc)) from exc
    return None


def _start(job: JobOptions, targets: Targets, storage: Storage, fingerprint,
           report: bool = False) -> Literal["fresh", "resume", "undecided"]:
    """fresh or resume; raises BatchConfigError where the user must decide (undecided when
    only reporting)."""
    if not targets.staging:
        return "fresh"
    staging = Staging(targets.staging, storage)
    try:
        if staging.has_files() and not (job.resume or job.restart):
            if report:
                return "undecided"
            raise StagingError(
                f"{staging.url} holds the committed results of an interrupted run of this job. "
                "Pass --resume to continue it (only lines without a result run), or --restart to "
                "discard them.")
        if staging.has_files() and job.resume and not job.restart:
            staging.check_inputs([list(f) for f in fingerprint])
            return "resume"
    except StagingError as exc:
        raise BatchConfigError(str(exc)) from exc
    return "fresh"


def _already_completed(job: JobOptions, targets: Targets, storage: Storage,
                       fingerprint) -> dict[str, Any] | None:
    """With resume: the metrics of an earlier run that completed this job over the very same
    inputs (path, size, version), so that rerunning a finished scheduled job does nothing."""
    if not job.resume or job.restart or not targets.metrics or not targets.staging:
        return None
    try:
        old = storage.read_json(targets.metrics)
    except (OSError, ValueError):
        return None
    if (not isinstance(old, dict) or old.get("status") != "completed"
            or old.get("input_fingerprint") != [list(f) for f in fingerprint]
            or not storage.exists(targets.output)):
        return None
    return {**old, "already_completed": True}
