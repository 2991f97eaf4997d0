"""The read -> engine -> commit loop of one attempt at a job.

Memory stays flat whatever the input size: lines are read only while fewer than max_in_flight
requests are in the engine, finished records are committed to staging every commit_every records
or commit_interval seconds, and what the job remembers per line is a 16-byte digest of its
custom_id (duplicates) plus, when resuming, one state byte.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from batchrun import phases
from batchrun.batch.job.idset import IdSet
from batchrun.batch.job.line_checks import check_item, internal_error
from batchrun.batch.job.metrics import RunMetrics
from batchrun.batch.job.plan import JobPlan
from batchrun.batch.job.progress import Counts, Reporter
from batchrun.batch.storage.lines import InputLine, InputReadError
from batchrun.batch.job.staging import (EXPIRED, FAILED, OK, RETRYABLE, Committed, Record,
                                        Staging)
from batchrun.engine.client import EngineClient
from batchrun.engine.errors import PromptTooLongError
from batchrun.openai.batch_expired import expired_line
from batchrun.openai.wire import LineError, RequestError, peek_custom_id
from batchrun.openai.bodies import batch_error_line, batch_output_line, engine_error

log = logging.getLogger("batchrun.batch")
_WAIT_SLICE = 0.2  # seconds the loop waits on image fetches between looks at deadline and stop


class ChangedInputError(ValueError):
    """A resumed run found a committed line whose input changed, and was told to refuse."""


class StopRequest:
    """Event-like stop flag: set() once = admit nothing more and let in-flight requests finish
    within the grace period; set() again = drop them now. A threading.Event works too (graceful)."""

    def __init__(self) -> None:
        self._times = 0
        self.merge = False  # after the stop, still merge what is done (the server's cancel)

    def set(self) -> None:
        self._times += 1

    def is_set(self) -> bool:
        return self._times > 0

    @property
    def immediate(self) -> bool:
        return self._times > 1


@dataclass(slots=True)
class _InFlight:
    prepared: Any  # runner.Prepared
    position: int
    source: int
    line: int
    digest: int
    outputs: dict  # engine request id -> finished RequestOutput
    admitted: float = 0.0  # time.monotonic() when its requests went to the engine


class Job:
    def __init__(self, engine: EngineClient, plan: JobPlan, lines: Iterator[InputLine],
                 staging: Staging, committed: Committed, counts: Counts, reporter: Reporter,
                 metrics: RunMetrics, prepare: Callable[[str, int], Any], stop: Any = None,
                 on_progress: Callable[[Counts], None] | None = None):
        """`prepare(text, line)` makes a line's request."""
        self.engine, self.config, self.max_in_flight = engine, plan.job, plan.max_in_flight
        self.lines, self.staging, self.committed = lines, staging, committed
        self.counts, self.reporter, self.metrics = counts, reporter, metrics
        self.prepare = prepare
        # Several inputs: error messages name the file.
        self.source_names = plan.input_paths if len(plan.sources) > 1 else None
        self.stop, self.on_progress = stop, on_progress
        self.ids = IdSet()
        self.in_flight: dict[str, _InFlight] = {}
        self.exhausted = False
        self.read_error: InputReadError | None = None
        self.read = 0
        self.changed = 0  # committed lines whose input changed, run again
        self.last_lines: dict[int, int] = {}  # source -> its last line read
        self.buffer: list[Record] = []
        self.buffer_since = 0.0
        self.deadline = getattr(plan, "deadline", None)  # Unix time, or None
        self.expired = 0  # lines given a batch_expired error line

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> str:
        """'completed' when every line has a committed record, 'interrupted' after a stop,
        'expired' when the deadline passed (every line has a record then too)."""
        try:
            while True:
                if self.deadline is not None and time.time() >= self.deadline:
                    return self._expire()
                if self._stopping():
                    return self._wind_down()
                self.admit()
                self.maybe_commit()
                self.reporter.tick()
                if not self.in_flight:
                    if self.exhausted:
                        break
                    continue
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped {len(self.in_flight)} requests "
                                       "without returning their outputs")
                phases.mark("first lines read and rendered", once=True)
                self.collect(self.engine.step())
                phases.mark("first engine step", once=True)
            self.commit()
            if self.read_error is not None:
                raise self.read_error
            return "completed"
        except BaseException:
            self._abort_in_flight()
            try:
                self.commit()  # what finished stays done whatever happens next
            except Exception:
                log.exception("could not commit the finished results")
            raise

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _wind_down(self) -> str:
        grace = 0.0 if getattr(self.stop, "immediate", False) else self.config.grace_period
        if self.in_flight:
            log.warning("stopping: admitting no more lines; %s; those in flight get %.0f s to "
                        "finish", self._where_lines_are(), grace)
        deadline = time.monotonic() + grace
        while (self.in_flight and time.monotonic() < deadline
               and not getattr(self.stop, "immediate", False)):
            self.collect(self.engine.step())
            self.maybe_commit()
        if self.in_flight:
            log.warning("stopping: dropped the unfinished lines (%s); a resumed run redoes them",
                        self._where_lines_are())
        elif self.exhausted:
            self.commit()
            return "completed"  # the stop came after the last line was read: nothing is missing
        self._abort_in_flight()
        self.commit()
        return "interrupted"

    def _expire(self) -> str:
        """The deadline passed: what is done stays; each line in flight or not yet started
        gets a batch_expired error line (state EXPIRED: a resume runs it)."""
        when = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.deadline))
        message = f"This request was not run before the batch's deadline ({when})."
        unfinished = {id(e): e for e in self.in_flight.values()}
        self._abort_in_flight()
        for entry in unfinished.values():
            self._record_expired(entry, entry.prepared.custom_id, message)
        while not self.exhausted:
            try:
                item = next(self.lines)
            except (StopIteration, InputReadError) as exc:
                self.read_error = exc if isinstance(exc, InputReadError) else None
                self.exhausted = True
                break
            self.read += 1
            self.last_lines[item.source] = max(item.line, self.last_lines.get(item.source, 0))
            state = self.committed.get(item.source, item.line)
            if state and state != EXPIRED and not self.committed.changed(
                    item.source, item.line, item.digest):
                self._skip(item, state)
                continue
            self._record_expired(item, item.custom_id if item.problem is not None
                                 else peek_custom_id(item.text), message)
        if self.counts.total != self.read:
            self.reporter.set_total(self.read)
        log.warning("the deadline %s passed: %d lines got a batch_expired error line", when,
                    self.expired)
        self.commit()
        if self.read_error is not None:
            raise self.read_error
        return "expired"

    def _record_expired(self, at: InputLine | _InFlight, custom_id: str | None,
                        message: str) -> None:
        self._record(at, EXPIRED, expired_line(custom_id, message))
        self.expired += 1
        self.metrics.record_failed()
        self.counts.failed += 1
        self.counts.expired += 1
        self.reporter.advance()

    def lines_in_flight(self) -> int:
        """Input lines in the engine (a completions line may have several requests)."""
        return len({id(entry) for entry in self.in_flight.values()})

    def _where_lines_are(self) -> str:
        """Every line of the job accounted for: done, in flight, not started (when known)."""
        done, flying = self.counts.done, self.lines_in_flight()
        total = self.counts.total if self.counts.total is not None else (
            self.read if self.exhausted else None)
        text = f"{done} lines done, {flying} in flight"
        if total is not None:
            text += f", {max(0, total - done - flying)} not started, of {total}"
        return text

    def _abort_in_flight(self) -> None:
        # Leave the engine clean for a caller that keeps using it (tests, a server).
        for request_id in list(self.in_flight):
            self.engine.abort_request(request_id)
        self.in_flight.clear()

    # --- reading and admitting --------------------------------------------------------------

    def admit(self) -> None:
        # Lines whose images are still being fetched (job/media_prefetch.py) wait while the
        # engine has work: it never waits on the network while it could compute.
        ready = getattr(self.lines, "ready", None)
        wait = getattr(self.lines, "wait", None)
        while not self.exhausted and len(self.in_flight) < self.max_in_flight:
            if self._stopping():
                return
            if ready is not None and not ready():
                if not self.in_flight and wait is not None:  # wait a slice, then look again
                    wait(self._wait_slice())
                return
            try:
                item = next(self.lines)
            except (StopIteration, InputReadError) as exc:
                # A broken input still gets the lines before the break run and committed; the
                # error is raised once they are.
                self.read_error = exc if isinstance(exc, InputReadError) else None
                self.exhausted = True
                if self.counts.total != self.read:
                    self.reporter.set_total(self.read)
                return
            self.read += 1
            self.last_lines[item.source] = max(item.line, self.last_lines.get(item.source, 0))
            self.handle(item)

    def _wait_slice(self) -> float:
        """How long the loop may wait for images before it looks at its deadline and stop."""
        if self.deadline is None:
            return _WAIT_SLICE
        return max(0.0, min(_WAIT_SLICE, self.deadline - time.time()))

    def handle(self, item: InputLine) -> None:
        state = self.committed.get(item.source, item.line)
        if state and self.committed.changed(item.source, item.line, item.digest):
            self._changed(item)
            state = 0
        if state and state != EXPIRED and not (state == RETRYABLE and self.config.retry_failed):
            self._skip(item, state)
            return
        try:
            p = check_item(item, self.ids, self.prepare)
        except LineError as exc:
            self.fail(item, exc)
            return
        except Exception as exc:  # a bug preparing this line: it fails, the job goes on
            log.exception("line %d: preparing the request failed", item.line)
            self.fail(item, internal_error(item, "preparing the request", exc), retryable=True)
            return
        entry = _InFlight(p, item.position, item.source, item.line, item.digest, {},
                          time.monotonic())
        try:
            images = p.request.multimodal  # a chat line's images (one prompt)
            for request_id, prompt in p.engine_requests:
                if images is None:
                    self.engine.add_request(request_id, prompt, p.params)
                else:
                    self.engine.add_request(request_id, prompt, p.params, multimodal=images)
                self.in_flight[request_id] = entry
            self.reporter.admitted(p.params.max_tokens * p.params.n * len(p.engine_requests))
        except ValueError as exc:  # the engine refuses what it cannot run
            if isinstance(exc, PromptTooLongError):
                error = RequestError(str(exc), code="context_length_exceeded", param="messages")
            else:
                error = RequestError(str(exc), code="unsupported_value")
            self._drop(entry)
            self.fail(item, LineError(item.line, error, p.custom_id), p.request_id)
        except Exception as exc:  # a bug queueing this line: it fails, the job goes on
            log.exception("line %d: adding the request to the engine failed", item.line)
            self._drop(entry)
            self.fail(item, internal_error(item, "adding the request to the engine", exc,
                                           p.custom_id), p.request_id, retryable=True)

    def _changed(self, item: InputLine) -> None:
        """A line whose content differs from the one whose result was committed."""
        where = f"{self.source_names[item.source]}:" if self.source_names else "line "
        if self.config.on_changed_input == "fail":
            raise ChangedInputError(
                f"{where}{item.line} changed since its result was committed; rerun with "
                "--on-changed-input rerun to run the changed lines again, or --restart")
        self.changed += 1
        log.warning("%s%d changed since its result was committed: running it again", where,
                    item.line)

    def _skip(self, item: InputLine, state: int) -> None:
        """A line an earlier attempt committed: count it, remember its custom_id."""
        cid = item.custom_id if item.problem is not None else peek_custom_id(item.text)
        if cid is not None:
            self.ids.add(cid)
        self.counts.resumed += 1
        if state == OK:
            self.counts.completed += 1
        else:
            self.counts.failed += 1
        self.reporter.advance()

    # --- results ----------------------------------------------------------------------------

    def collect(self, outputs: list[Any]) -> None:
        for out in outputs:
            if not out.finished or out.request_id not in self.in_flight:
                continue
            req = self.in_flight.pop(out.request_id)
            custom_id = req.prepared.custom_id
            err = engine_error(out)
            if err is not None:
                self._drop(req)
                self.fail(req, LineError(req.line, err, custom_id),
                          out.request_id, retryable=True)
                continue
            req.outputs[out.request_id] = out
            got = [req.outputs.get(rid) for rid, _ in req.prepared.engine_requests]
            parts = [p for p in got if p is not None]
            if len(parts) < len(got):
                continue  # a completions line with several prompts: wait for all of them
            try:
                body = req.prepared.request.finalize(parts)
            except Exception as exc:  # a parser bug on this output: this line fails, not the job
                log.exception("line %d: building the response failed", req.line)
                self.fail(req, internal_error(
                    req, "building the response", exc, custom_id), out.request_id,
                    retryable=True)
                continue
            request_id = req.prepared.request_id
            record = batch_output_line(custom_id, request_id, body)
            if self.config.record_latency:
                record["latency_s"] = round(time.monotonic() - req.admitted, 6)
            self._record(req, OK, record)
            params = req.prepared.params
            self.metrics.record_ok(parts[0] if len(parts) == 1 else dataclasses.replace(
                parts[0], prompt_token_ids=[t for p in parts for t in p.prompt_token_ids],
                outputs=[c for p in parts for c in p.outputs],
                num_cached_tokens=sum(p.num_cached_tokens for p in parts)),
                requested=params.max_tokens * params.n * len(parts))
            self.counts.completed += 1
            self.reporter.advance()

    def _drop(self, entry: _InFlight) -> None:
        """Abort what is left of a line's engine requests (one of them failed)."""
        for request_id, _ in entry.prepared.engine_requests:
            if self.in_flight.get(request_id) is entry:
                del self.in_flight[request_id]
                self.engine.abort_request(request_id)

    def fail(self, at: InputLine | _InFlight, error: LineError, request_id: str | None = None,
             retryable: bool = False) -> None:
        record = batch_error_line(error, request_id=request_id,
                                  source=self.source_names[at.source] if self.source_names else None)
        self._record(at, RETRYABLE if retryable else FAILED, record)
        self.metrics.record_failed()
        self.counts.failed += 1
        self.reporter.advance()

    def _record(self, at: InputLine | _InFlight, state: int, record: dict) -> None:
        if not self.buffer:
            self.buffer_since = time.monotonic()
        self.buffer.append(Record(at.position, state, json.dumps(record, ensure_ascii=False),
                                  at.digest))
        if len(self.buffer) >= self.config.commit_every:
            self.commit()

    def maybe_commit(self) -> None:
        if self.buffer and time.monotonic() - self.buffer_since >= self.config.commit_interval:
            self.commit()

    def commit(self) -> None:
        if self.buffer:
            self.staging.commit(self.buffer)
            self.buffer = []
        if self.on_progress is not None:
            self.on_progress(dataclasses.replace(self.counts))
