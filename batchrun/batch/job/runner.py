"""The batch job: stream OpenAI batch lines through the engine, commit results as they complete,
merge them into input order at the end.

Public entry point: `run_batch(loaded_model, make_plan(RunOptions(...)), stop=...,
on_progress=...)` -> RunResult (batch/job/result.py). It works on an already loaded model (the
CLI loads one per run; the server passes a client of its shared engine), can be stopped from
another thread with any object that has `is_set()` (a threading.Event, or
job.StopRequest for a graceful-then-immediate stop), and reports request counts through
`on_progress(Counts)` after every commit.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from batchrun.batch.job.lease import OutputBusyError, OutputLease, lease_for
from batchrun.batch.job.loop import Job
from batchrun.batch.job.media_prefetch import Prefetch
from batchrun.batch.job.metrics import RunMetrics
from batchrun.batch.job.plan import BatchConfigError, JobPlan
from batchrun.batch.job.progress import Counts, Reporter, resolve_mode
from batchrun.batch.job.result import RunResult
from batchrun.batch.storage.readers import count_records, read_all
from batchrun.batch.storage.sinks import RecordSink
from batchrun.batch.job.staging import Committed, Staging, StagingError
from batchrun.engine.client import EngineClient
from batchrun.engine.sampling_params import SamplingParams
from batchrun.openai.params import check_model_field
from batchrun.openai.wire import LineError, RequestError, parse_batch_line, parse_envelope
from batchrun.openai.bodies import new_request_id
from batchrun.openai.images import check_images
from batchrun.openai.media import MediaFetcher
from batchrun.openai.requests import ChatCompletionRequest
from batchrun.openai.responses import content_part_error, responses_error, to_chat_request
from batchrun.openai.responses_request import ResponsesRequest
from batchrun.openai.prepared import PreparedRequest
from batchrun.openai.serving import OpenAIServing
from batchrun.options.openai import OpenAIOptions
from batchrun.served_model import ServedModel

log = logging.getLogger("batchrun.batch")


@dataclass
class Prepared:
    custom_id: str
    request_id: str
    prompt_token_ids: list[int]  # the first prompt; a completions line may have several
    params: SamplingParams
    request: PreparedRequest  # the OpenAI adapter: prompts, finalize(outputs)

    @property
    def engine_requests(self) -> list[tuple[str, list[int]]]:
        """(engine request id, prompt) of each engine request this line needs."""
        prompts = self.request.prompts
        if len(prompts) == 1:
            return [(self.request_id, prompts[0])]
        return [(f"{self.request_id}-{k}", p) for k, p in enumerate(prompts)]


def check_line(raw: str, line_number: int, model: Any, openai: OpenAIOptions,
               media: MediaFetcher | None = None):
    """The checks of prepare_line that need no tokenizer (`batchrun validate` without one),
    image parts' sources included; with `media`, their images are fetched and decoded too.
    `model` needs only `name` and `aliases`."""
    line, request = parse_batch_line(raw, line_number)
    try:
        if request.stream:
            raise RequestError("stream: streaming is not available in a batch file",
                               code="unsupported_value", param="stream")
        check_model_field(request.model, model.name, model.aliases, openai.ignore_model_field,
                          getattr(model, "adapters", ()))
        chat = request
        if isinstance(request, ResponsesRequest):  # its input items, tools, text.format
            chat = to_chat_request(request)
        if isinstance(chat, ChatCompletionRequest):
            try:
                check_images(chat.messages, openai, media)
            except RequestError as exc:
                if chat is request or not isinstance(request, ResponsesRequest):
                    raise
                raise content_part_error(exc, request) or responses_error(exc) from None
    except RequestError as exc:
        raise LineError(line_number, exc, line.custom_id) from None
    return line, request


def prepare_line(raw: str, line_number: int, serving: OpenAIServing) -> Prepared:
    """Validate, render and parameterise one input line; raise LineError for a bad one."""
    line = parse_envelope(raw, line_number)
    try:
        request = serving.prepare(line.url, line.body, allow_stream=False)
    except RequestError as exc:
        raise LineError(line_number, exc, line.custom_id) from None
    return Prepared(line.custom_id, new_request_id(), request.prompts[0], request.params, request)


def _open_staging(plan: JobPlan, lease: OutputLease | None) -> tuple[Staging, Committed]:
    """The job's staging as the plan decided: resumed, or cleared for a fresh start. Every
    commit checks first that this run still holds the output's lease."""
    url = plan.targets.staging or tempfile.mkdtemp(prefix="batchrun-staging-")
    staging = Staging(url, plan.storage)
    if lease is not None:
        staging.guard = lease.check
    try:
        manifest = {"inputs": plan.fingerprint_json, "output": plan.targets.output,
                    "errors": plan.targets.errors}
        if plan.start == "resume":
            staging.clean_scratch()
            staging.repair_manifest(manifest)
            committed = staging.scan()
            expired = committed.expired()
            log.info("resuming: %d lines already have a committed record in %s%s",
                     committed.count - expired, url,
                     f"; {expired} lines expired at a deadline run again" if expired else "")
            return staging, committed
        staging.clear()
        if plan.targets.metrics:  # "completed" is no longer true
            plan.storage.remove(plan.targets.metrics)
        staging.create(manifest)
        return staging, Committed()
    except StagingError as exc:
        raise BatchConfigError(str(exc)) from exc


def _finalize(staging: Staging, plan: JobPlan,
              last_lines: dict[int, int] | None) -> dict[int, int]:
    """Merge the committed parts into the output and error files (each published atomically)."""
    t = plan.targets
    out = RecordSink(t.output, t.output_format, plan.storage)
    err = out if t.errors == t.output else RecordSink(t.errors, t.errors_format, plan.storage)
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


def run_batch(model: ServedModel | None, plan: JobPlan, stop: Any = None,
              on_progress: Callable[[Counts], None] | None = None,
              engine: EngineClient | None = None) -> RunResult:
    """Run the plan's inputs; the result holds the metrics summary also written to the metrics
    file. Its status is "completed", or "interrupted" after a stop (the committed results stay
    in staging for --resume unless the job's merge_on_stop).

    `engine` is the client to run on, by default model.engine (the server passes a client of
    its shared engine). A plan that starts "done" needs no model.
    """
    if plan.start == "done":
        log.info("this job already completed over the same inputs (%s); nothing to do "
                 "(--restart runs it again)", plan.targets.metrics)
        # A fresh run deletes the metrics file first, so a completed one belongs to the run
        # that made any staging left here: it was killed while removing it.
        if plan.targets.staging:
            Staging(plan.targets.staging, plan.storage).remove()
        previous = plan.previous
        assert previous is not None  # a "done" plan holds the earlier run's metrics
        if on_progress is not None:
            r = previous["requests"]
            on_progress(Counts(r["total"], r["ok"], r["failed"], r["total"]))
        return RunResult.of(previous)
    if model is None:
        raise ValueError("run_batch: this plan has work to do and needs a model")
    engine = engine or model.engine
    if engine is None:
        raise ValueError(f"run_batch: {model.name} has no engine to run on")
    lease = plan.lease
    if lease is None:  # a plan made without it (the server, tests): hold it for the run
        try:
            lease = lease_for(plan.targets.output, plan.storage, plan.job.lease_ttl)
            if lease is not None:
                lease.acquire()
        except (OutputBusyError, OSError) as exc:  # OSError: io.LinkRefused, permissions
            raise BatchConfigError(str(exc)) from exc
        owned = lease
    else:
        owned = None
    try:
        staging, committed = _open_staging(plan, lease)
        return _run(model, engine, plan, staging, committed, stop, on_progress, lease)
    finally:
        if owned is not None:
            owned.release()


def _engine_work(engine: EngineClient) -> Callable[[], tuple[int, int]]:
    """(engine steps, decode tokens computed) since now, for the progress ETA: the running
    lines' tokens are in the decode count as they are generated (generation_tokens counts a
    request's when it finishes)."""
    start = engine.stats  # the engine's own object, counting on: its values now are the base
    steps, decoded = start.steps, start.computed_tokens - start.prefill_tokens

    def work() -> tuple[int, int]:
        s = engine.stats
        return s.steps - steps, s.computed_tokens - s.prefill_tokens - decoded
    return work


def _run(model: ServedModel, engine: EngineClient, plan: JobPlan, staging: Staging,
         committed: Committed, stop: Any, on_progress: Callable[[Counts], None] | None,
         lease: OutputLease | None) -> RunResult:
    t, job = plan.targets, plan.job
    metrics = RunMetrics()
    mode = resolve_mode("none" if job.quiet else job.progress)
    sources = list(plan.sources)
    total = count_records(sources, plan.storage) if mode != "none" or on_progress else None
    counts = Counts(total=total)
    reporter = Reporter(mode, counts, metrics, job.log_interval,
                        engine_work=_engine_work(engine))
    lines = read_all(sources, plan.storage, plan.inputs.columns)
    try:
        serving = OpenAIServing(model, plan.serving)
    except ValueError as exc:  # an option the loaded model cannot take (--score-tokens)
        raise BatchConfigError(str(exc)) from exc
    if serving.media is not None:  # a vision-language model: images fetched ahead of the loop
        serving.media.deadline = plan.deadline  # no fetch or retry runs past the job's deadline
        lines = Prefetch(lines, serving.media, max(64, 4 * plan.serving.openai.media_fetch_workers))
    job_loop = Job(engine, plan, lines, staging, committed, counts, reporter, metrics,
                   lambda text, line: prepare_line(text, line, serving), stop, on_progress)
    try:
        status = job_loop.run()
    finally:
        reporter.close()
        if serving.media is not None:
            serving.media.close()

    merged = None
    whole = status in ("completed", "expired")  # every line has a record
    if whole or job.merge_on_stop or getattr(stop, "merge", False):
        if lease is not None:
            lease.confirm()  # this run still owns the output, right before it publishes it
        merged = _finalize(staging, plan, job_loop.last_lines if whole else None)
    elif t.staging is None:
        log.warning("the committed results are in %s; rerun with --staging %s --resume to "
                    "continue", staging.url, staging.url)

    result = metrics.summary(engine, model=model.name, status=status, input=plan.input_label,
                             output=t.output, errors=t.errors)
    result["requests"] = {"total": counts.done, "ok": counts.completed, "failed": counts.failed}
    result["resumed"] = counts.resumed
    result["lines_in_job"] = counts.total if counts.total is not None else (
        job_loop.read if job_loop.exhausted else None)
    result["this_run"] = {"ok": metrics.ok, "failed": metrics.failed}
    result["input_fingerprint"] = plan.fingerprint_json
    # Whether each line's output is independent of what ran beside it (--batch-invariant).
    result["batch_invariant"] = bool(model.engine_config and model.engine_config.batch_invariant)
    replicas = getattr(engine, "replica_stats", None)  # an engine on Ray: per replica
    if replicas is not None:
        result["replicas"] = replicas()
    if status == "expired":
        result["expired"] = job_loop.expired
        result["expired_at"] = time.time()
        result["deadline"] = plan.deadline
    if whole and merged is not None and sum(merged.values()) != counts.done:
        # Never a completed run with records missing: the staging stays for --resume.
        result["status"] = "incomplete"
        result["merged_records"] = sum(merged.values())
        log.error("the merged output has %d records for %d input lines; the committed parts "
                  "stay in %s", sum(merged.values()), counts.done, staging.url)
    if t.metrics:
        plan.storage.write_json(t.metrics, result)
    # An expired job keeps its staging too: --resume runs only its expired lines.
    if merged is not None and result["status"] not in ("incomplete", "expired"):
        # Last: while staging exists a rerun re-merges; once it is gone, the metrics file
        # (written above) says the job is complete.
        staging.remove()
    if on_progress is not None:
        on_progress(counts)
    return RunResult.of(result)
