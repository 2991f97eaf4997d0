"""The glue between a Batches-API batch and the batch runner of `batchrun run`.

The runner drives an engine-shaped object itself (add_request / step / abort_request); here that
object is a SyncEngineClient of the server's shared engine, so a batch runs exactly like
`batchrun run` on the same file, next to the live traffic.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from batchrun.batch.job.result import RunResult
from batchrun.engine.sync_client import SyncEngineClient


def validate_input(path: Path, endpoint: str) -> tuple[int, list[dict]]:
    """(number of request lines, batch-level errors). As OpenAI's validating stage, a line whose
    url is not the batch's endpoint fails the batch; other bad lines (bad JSON, bad bodies) only
    fail themselves, later, in the error file."""
    total, errors = 0, []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            total += 1
            try:  # orjson: a deeply nested line is a JSON error, not a RecursionError
                url = orjson.loads(raw).get("url")
            except (ValueError, AttributeError):
                continue
            if url is not None and url != endpoint:
                errors.append({"code": "invalid_url", "param": "url", "line": number,
                               "message": f"The URL provided for this request ({url!r}) does not "
                                          f"match the batch endpoint ({endpoint!r})."})
    return total, errors


def batch_in_flight(state) -> int:
    """Requests a batch keeps in the engine. Leaves an eighth of the sequence slots to
    interactive requests: the engine admits by priority but does not preempt a running batch
    request for a waiting interactive one."""
    if state.config.batch_max_in_flight:
        return state.config.batch_max_in_flight
    seqs = state.model.engine_config.scheduler.max_num_seqs
    share = (seqs - max(1, seqs // 8)) // max(1, state.config.max_concurrent_batches)
    return max(1, share)


def run_options(state, input_path: Path, work_dir: Path, expires_at: int | None = None):
    """The batch runner's options for one batch. Results are committed to a staging folder in
    the batch's work dir as they complete, so a restarted server resumes where it stopped.
    `expires_at` (Unix time, the end of the completion_window) is the job's deadline."""
    from datetime import datetime, timezone

    from batchrun.options.job import InputOptions, JobOptions
    from batchrun.options.run import RunOptions

    deadline = None if expires_at is None else \
        datetime.fromtimestamp(expires_at, timezone.utc).isoformat()
    job = JobOptions(output=str(work_dir / "output.jsonl"), errors=str(work_dir / "errors.jsonl"),
                     metrics=str(work_dir / "metrics.json"), staging=str(work_dir / "staging"),
                     resume=True, max_in_flight=batch_in_flight(state), progress="none",
                     commit_interval=0.5,  # request_counts follow commits: keep them fresh
                     deadline=deadline)
    return RunOptions(inputs=InputOptions(input=[str(input_path)]), job=job,
                      openai=state.serving_options.openai,
                      defaults=state.serving_options.defaults)


def run_job(state, client: SyncEngineClient, options, stop, on_progress) -> RunResult:
    """Run one batch on `client` (see batchrun.batch.job.runner.run_batch for stop / on_progress);
    returns the runner's result: status "completed" or "interrupted". The plan is made here,
    in the worker, right before the run: a restarted batch resumes from its staging."""
    from batchrun.batch.job.plan import make_plan
    from batchrun.batch.job.runner import run_batch

    Path(options.job.output).parent.mkdir(parents=True, exist_ok=True)
    return run_batch(state.served_model, make_plan(options), stop=stop, on_progress=on_progress,
                     engine=client)


def output_usage(path: Path) -> dict:
    """The batch's usage, summed over its output file's records (after a resume too)."""
    from batchrun.openai.batch_usage import batch_usage

    with open(path, "rb") as f:
        return batch_usage(orjson.loads(raw) for raw in f if raw.strip())


def committed_result(work_dir: Path) -> RunResult | None:
    """The result of a run that finished merging before the server stopped, if any."""
    path = work_dir / "metrics.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    return RunResult.of(summary) if summary.get("status") in ("completed", "expired") else None
