"""The Batches API: batch jobs run by the batch runner inside the server, on the shared engine.

Lifecycle: validating -> in_progress -> finalizing -> completed, or failed (the input cannot run),
or cancelling -> cancelled (partial results are kept), or expired: the completion_window ("24h",
OpenAI's only value; also "1h", "30m", ...) passed first, the lines done are in the output file
and every other line has a batch_expired error line. Batch work goes into the engine at a lower
priority than interactive requests and holds back a few sequence slots for them. Each batch object
is a JSON file under the data directory; a server restarted mid-batch runs it again.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
import uuid
from pathlib import Path
from types import NoneType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from typing_extensions import Annotated

from batchrun.engine.async_engine import BATCH_PRIORITY
from batchrun.engine.errors import EngineDeadError
from batchrun.batch.job.result import RunResult
from batchrun.engine.sync_client import SyncEngineClient
from batchrun.openai.batch_usage import empty_usage
from batchrun.openai.wire import SUPPORTED_URLS, from_validation_error
from batchrun.options.durations import parse_duration
from batchrun.server.errors import APIError, not_found
from batchrun.server.files import ExpiresAfter
from batchrun.server.stored import load_objects, write_json_atomic

log = logging.getLogger(__name__)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
STATUSES = (*ACTIVE, "completed", "failed", "cancelled", "expired")
# What the manager reads of a stored batch object; a file without them is quarantined.
BATCH_FIELDS: dict[str, type | tuple[type, ...]] = {"id": str, "status": str, "endpoint": str, "input_file_id": str,
                "created_at": int, "in_progress_at": (int, NoneType), "request_counts": dict}
MAX_ERRORS_LISTED = 10
# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class CreateBatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


class BatchManager:
    def __init__(self, state, root: Path):
        self.state = state
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._batches: dict[str, dict] = {}
        for obj in load_objects(root, "batch_*.json", BATCH_FIELDS, {"status": STATUSES}):
            self._batches[obj["id"]] = obj
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._running: dict[str, _Running] = {}
        self._workers: list[threading.Thread] = []
        self._stopping = threading.Event()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        for obj in sorted(self._batches.values(), key=lambda b: b["created_at"]):
            if obj["status"] == "cancelling":  # it was being cancelled when the server stopped
                self._set(obj["id"], status="cancelled", cancelled_at=_now())
            elif obj["status"] in ACTIVE:
                log.info("resuming %s (was %s)", obj["id"], obj["status"])
                self._queue.put(obj["id"])
        for i in range(self.state.config.max_concurrent_batches):
            t = threading.Thread(target=self._work, name=f"batchrun-batches-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop workers; running batches stay in_progress on disk (their committed results in
        staging) and resume on restart."""
        self._stopping.set()
        with self._lock:
            running = list(self._running.values())
        for r in running:
            r.interrupt(keep_results=False)
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join(timeout)

    # --- the API --------------------------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> dict:
        try:
            req = CreateBatch.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc, "") from None
        if req.endpoint not in SUPPORTED_URLS:
            raise APIError(f"endpoint: {req.endpoint!r} is not supported (supported: "
                           f"{', '.join(SUPPORTED_URLS)})", code="invalid_value", param="endpoint")
        try:
            window = parse_duration(req.completion_window)
        except ValueError:
            raise APIError("completion_window: must be a duration such as 24h (OpenAI's only "
                           f"value), 1h or 30m, not {req.completion_window!r}",
                           code="invalid_value", param="completion_window") from None
        file = self.state.files.get(req.input_file_id)
        if file["purpose"] != "batch":
            raise APIError(f"input_file_id: file {file['id']} has purpose {file['purpose']!r}, "
                           "not 'batch'", code="invalid_value", param="input_file_id")
        now = _now()
        obj = {
            "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": req.endpoint,
            "model": self.state.served_name, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + max(1, round(window)),
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": empty_usage(), "metadata": req.metadata,
            "output_expires_after": (req.output_expires_after.model_dump()
                                     if req.output_expires_after else None),
        }
        with self._lock:
            self._batches[obj["id"]] = obj
            self._save(obj)
        self._queue.put(obj["id"])
        return dict(obj)

    def get(self, batch_id: str) -> dict:
        with self._lock:
            obj = self._batches.get(batch_id)
            if obj is None:
                raise not_found("batch", batch_id, "batch_id")
            obj = dict(obj)
            running = self._running.get(batch_id)
        if running is not None and running.counts is not None:
            c = running.counts
            obj["request_counts"] = {"total": c.total if c.total is not None else c.done,
                                     "completed": c.completed, "failed": c.failed}
        return obj

    def list(self, limit: int = 20, after: str | None = None) -> tuple[list[dict], bool]:
        with self._lock:
            ids = sorted(self._batches, key=lambda i: (self._batches[i]["created_at"], i),
                         reverse=True)
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        return [self.get(i) for i in ids[:limit]], len(ids) > limit

    def cancel(self, batch_id: str) -> dict:
        with self._lock:
            obj = self._batches.get(batch_id)
            if obj is None:
                raise not_found("batch", batch_id, "batch_id")
            status = obj["status"]
            if status in ("completed", "failed", "cancelled", "expired"):
                raise APIError(f"Cannot cancel a batch with status '{status}'.",
                               code="invalid_state", status_code=409)
            running = None
            if status in ("validating", "in_progress"):
                obj.update(status="cancelling", cancelling_at=_now())
                self._save(obj)
                running = self._running.get(batch_id)
        if running is not None:
            running.interrupt(keep_results=True)
        return self.get(batch_id)

    # --- the worker -----------------------------------------------------------------------------

    def _set(self, batch_id: str, **fields) -> dict:
        with self._lock:
            obj = self._batches[batch_id]
            obj.update(fields)
            self._save(obj)
            return dict(obj)

    def _save(self, obj: dict) -> None:
        write_json_atomic(self.root / f"{obj['id']}.json", obj)

    def _work(self) -> None:
        while True:
            batch_id = self._queue.get()
            if batch_id is None or self._stopping.is_set():
                return
            try:
                self._run(batch_id)
            except Exception as exc:  # a bug here must not kill the worker or leave it running
                log.exception("batch %s failed", batch_id)
                try:
                    # The API's clients see no server paths: the log has the whole error.
                    message = str(exc).replace(str(self.root.parent), "<data-dir>")
                    self._fail(batch_id, "internal_error",
                               f"the batch failed: {type(exc).__name__}: {message}")
                except Exception:
                    log.exception("could not mark batch %s failed", batch_id)

    def _run(self, batch_id: str) -> None:
        from batchrun.server.batch_job import committed_result, run_options, validate_input

        obj = self.get(batch_id)
        work_dir = self.root / batch_id
        if obj["status"] == "cancelling":
            self._set(batch_id, status="cancelled", cancelled_at=_now())
            return
        if obj["status"] == "finalizing":  # stopped between the runner's merge and our bookkeeping
            result = committed_result(work_dir)
            if result is not None:
                self._finalize(batch_id, work_dir, result)
                return
        try:
            input_path = self.state.files.path(obj["input_file_id"])
            total, errors = validate_input(input_path, obj["endpoint"])
        except (APIError, FileNotFoundError):  # deleted before, or while, we got to it
            self._fail_deleted(batch_id, obj["input_file_id"])
            return
        if errors or total == 0:
            errors = errors or [{"code": "empty_file", "message": "the input file has no requests",
                                 "param": None, "line": None}]
            self._set(batch_id, status="failed", failed_at=_now(),
                      errors={"object": "list", "data": errors[:MAX_ERRORS_LISTED]})
            return

        running = _Running(SyncEngineClient(self.state.engine, BATCH_PRIORITY),
                           run_options(self.state, input_path, work_dir, obj["expires_at"]))
        with self._lock:
            obj = self._batches[batch_id]
            cancelled = obj["status"] == "cancelling"
            if not cancelled:
                self._running[batch_id] = running
                obj.update(status="in_progress", in_progress_at=obj["in_progress_at"] or _now(),
                           request_counts={"total": total, "completed": 0, "failed": 0})
                self._save(obj)
        if cancelled:
            self._set(batch_id, status="cancelled", cancelled_at=_now())
            return
        try:
            result = running.run(self.state)
        except EngineDeadError as exc:
            if not self._stopping.is_set():
                self._fail(batch_id, "engine_error", str(exc))
            return
        except Exception:
            if input_path.exists():
                raise
            self._fail_deleted(batch_id, obj["input_file_id"])  # the runner could not read it
            return
        finally:
            running.client.close()
            with self._lock:
                self._running.pop(batch_id, None)
        if not result.finished and self._stopping.is_set():
            return  # server shutdown: stays in_progress, resumes from staging on restart
        self._finalize(batch_id, work_dir, result)

    def _finalize(self, batch_id: str, work_dir: Path, result: RunResult) -> None:
        completed = result.finished
        if completed:
            self._set(batch_id, status="finalizing", finalizing_at=_now())
        from batchrun.server.batch_job import output_usage

        ok, failed = result.requests.ok, result.requests.failed
        files = self.state.files
        out_path, err_path = work_dir / "output.jsonl", work_dir / "errors.jsonl"
        expiry = self.get(batch_id).get("output_expires_after")
        expires_after = ExpiresAfter.model_validate(expiry) if expiry else None
        fields: dict[str, Any] = {}
        if ok and out_path.exists():
            fields["usage"] = output_usage(out_path)
            fields["output_file_id"] = files.adopt(out_path, f"{batch_id}_output.jsonl",
                                                   "batch_output", expires_after)["id"]
        if failed and err_path.exists():
            fields["error_file_id"] = files.adopt(err_path, f"{batch_id}_error.jsonl",
                                                  "batch_output", expires_after)["id"]
        total = max(self.get(batch_id)["request_counts"]["total"], ok + failed)
        fields["request_counts"] = {"total": total, "completed": ok, "failed": failed}
        if result.status == "expired":
            fields.update(status="expired", expired_at=_now())
            self.state.metrics.batch_lines_expired.inc(result.summary.get("expired", 0))
        elif completed:
            fields.update(status="completed", completed_at=_now())
        else:
            fields.update(status="cancelled", cancelled_at=_now())
        self._set(batch_id, **fields)
        self.state.metrics.batches_ended.labels(fields["status"]).inc()
        shutil.rmtree(work_dir, ignore_errors=True)

    def _fail_deleted(self, batch_id: str, file_id: str) -> None:
        self._fail(batch_id, "missing_file", f"input file {file_id} was deleted")

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        self._set(batch_id, status="failed", failed_at=_now(), errors={
            "object": "list", "data": [{"code": code, "message": message, "param": None,
                                        "line": None}]})
        self.state.metrics.batches_ended.labels("failed").inc()


class _Running:
    """A batch in the runner: its engine client, runner config, stop flag and latest counts."""

    def __init__(self, client: SyncEngineClient, options):
        from batchrun.batch.job.loop import StopRequest

        self.client = client
        self.options = options  # batchrun.options.run.RunOptions
        self.stop = StopRequest()
        self.counts = None  # batchrun.batch.job.progress.Counts, once the runner reports

    def run(self, state) -> RunResult:
        from batchrun.server.batch_job import run_job

        def progress(counts) -> None:
            self.counts = counts

        return run_job(state, self.client, self.options, self.stop, progress)

    def interrupt(self, keep_results: bool) -> None:
        """Stop now, dropping in-flight requests. keep_results (a cancel) merges what finished
        into the output files; otherwise it stays in staging for a resumed run."""
        self.stop.merge = keep_results
        self.stop.set()
        self.stop.set()  # a second set: immediate, no grace period
        self.client.wake()


def _now() -> int:
    return int(time.time())
