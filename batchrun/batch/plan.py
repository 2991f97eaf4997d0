"""A run resolved once, before any model loads: RunOptions -> a frozen JobPlan.

Everything that touches storage to set a job up happens here, once: globs are expanded, input
files stat'ed (size and version: the fingerprint), Parquet schemas checked, output locations
checked (preflight), the chat template read, and the resume decision made (a fresh start, a
resume from staging, or nothing to do because this job already completed over these inputs).
`run_batch` takes the plan as it is; `batchrun plan` prints it with its estimates.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from batchrun.batch import io
from batchrun.batch.formats import Format, detect
from batchrun.batch.preflight import check_outputs
from batchrun.batch.lines import Source
from batchrun.batch.readers import check_sources, open_sources
from batchrun.batch.staging import Staging, StagingError
from batchrun.batch.storage import Storage
from batchrun.options.engine import EngineConfig
from batchrun.options.job import InputOptions, JobOptions
from batchrun.openai.serving import ServingOptions
from batchrun.options.run import RunOptions

log = logging.getLogger("batchrun.batch")
STAGING_SUFFIX = ".batchrun-staging"


class BatchConfigError(ValueError):
    """Something the user must fix before the job can run (a usage error, exit code 2)."""


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
    start: Literal["fresh", "resume", "done"]
    previous: dict[str, Any] | None
    max_in_flight: int

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


def make_plan(opts: RunOptions) -> JobPlan:
    """Raises BatchConfigError for everything the user must fix (a usage error)."""
    job, storage = opts.job, Storage(opts.inputs.storage_options)
    try:
        targets = Targets.of(job)
        sources = tuple(open_sources(opts.inputs.input, storage, opts.inputs.input_format))
        check_outputs(targets, job, storage, [s.path for s in sources])
        check_sources(list(sources), storage, opts.inputs.columns)
        serving = ServingOptions.of(opts.openai, opts.defaults, storage.open_read)
    except (OSError, ValueError) as exc:
        raise BatchConfigError(str(exc)) from exc
    fingerprint = tuple((s.path, storage.size(s.path), storage.version(s.path)) for s in sources)
    previous = _already_completed(job, targets, storage, fingerprint)
    start = "done" if previous is not None else _start(job, targets, storage, fingerprint)
    return JobPlan(opts.inputs, job, serving, opts.engine, storage, sources,
                   fingerprint, targets, start, previous,
                   job.max_in_flight or 4 * opts.engine.scheduler.max_num_seqs)


def _start(job: JobOptions, targets: Targets, storage: Storage, fingerprint) -> str:
    """fresh or resume; raises BatchConfigError where the user must decide."""
    if not targets.staging:
        return "fresh"
    staging = Staging(targets.staging, storage)
    try:
        if staging.local and os.path.isdir(staging.root):  # another run holds it: say so now
            staging.lock()
            staging.unlock()
        if staging.has_files() and not (job.resume or job.restart):
            raise StagingError(
                f"{staging.url} holds the committed results of an interrupted run of this job. "
                "Pass --resume to continue it (only lines without a result run), or --restart to "
                "discard them.")
        if staging.exists() and job.resume and not job.restart:
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
