"""An async client in front of the synchronous Engine, for a server that shares one engine.

One background thread owns the Engine: it applies queued add/abort commands, calls step() while
there is work, and hands each output to the request's sink. The event loop never touches the
engine, so HTTP handlers never block on model work. Async callers get an async iterator per
request (`generate`); threads that drive their own loop (the batch runner inside the server) get
a blocking engine-shaped client (`batchrun.engine.sync_client.SyncEngineClient(async_engine)`). If step() raises, the requests in the engine
fail (a finished output with an error: a 500 for the API, a failed line for a batch) and the
engine serves on; after MAX_FAILED_STEPS failing steps in a row it is dead: every open request
gets EngineDeadError and new ones are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from batchrun.engine.engine import Engine
from batchrun.engine.errors import EngineDeadError, QueueFullError
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

INTERACTIVE_PRIORITY = 0
BATCH_PRIORITY = 10
# Consecutive failing steps after which the engine counts as broken rather than unlucky.
MAX_FAILED_STEPS = 3

# Engines (by id) that an AsyncEngine thread is driving: two drivers would corrupt one engine.
_DRIVEN: set[int] = set()
_DRIVEN_LOCK = threading.Lock()


class OutputSink(Protocol):
    """Where the engine thread hands a request's outputs (or the exception that ended it)."""

    def push(self, item: RequestOutput | BaseException) -> None: ...


@dataclass(frozen=True)
class AddCommand:
    """Queue a request in the engine; its outputs go to `sink`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    priority: int
    sink: OutputSink
    multimodal: MultiModalInputs | None = None  # the prompt's images; None for text only


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


@dataclass
class EngineSnapshot:
    """Gauges read by /metrics, refreshed by the engine thread after every step."""

    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_blocks: int = 0
    steps: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_blocks if self.kv_blocks else 0.0


class _AsyncSink:
    """Outputs of one request waiting for a coroutine on `loop`.

    Streamed outputs are cumulative per choice, so when the reader falls behind only the newest
    one of each choice is kept.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: dict[tuple[int, ...], RequestOutput] = {}
        self.final: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()

    def push(self, item: RequestOutput | BaseException) -> None:  # on the loop
        if isinstance(item, BaseException):
            self.error = item
        elif item.finished:
            self.final = item
        else:
            self.pending[tuple(c.index for c in item.outputs)] = item
        self.event.set()

    async def get(self) -> list[RequestOutput]:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        outs = list(self.pending.values())
        self.pending.clear()
        if self.final is not None:
            outs.append(self.final)
        return outs


class RequestStream:
    """The outputs of one async request; see AsyncEngine.generate."""

    def __init__(self, owner: "AsyncEngine", request_id: str, sink: _AsyncSink):
        self.owner = owner
        self.request_id = request_id
        self._sink = sink
        self._ready: deque[RequestOutput] = deque()
        self.finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._ready:
            if self.finished or self._closed:
                raise StopAsyncIteration
            try:
                self._ready.extend(await self._sink.get())
            except BaseException:
                self.close()
                raise
        out = self._ready.popleft()
        if out.finished:
            self.finished = True
            self.close()
        return out

    async def result(self) -> RequestOutput:
        """The finished output."""
        try:
            async for out in self:
                if out.finished:
                    return out
        finally:
            self.close()
        raise EngineDeadError("the request ended without an output")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.owner._num_async -= 1
        if not self.finished:
            self.owner.abort(self.request_id)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued: int | None = None,
                 on_finished: Callable[[RequestOutput, str], None] | None = None):
        """max_queued bounds the async requests in the engine at once (QueueFullError past it);
        on_finished(output, source) is called on the engine thread with every finished output,
        source "api" for async requests and "batch" for those of sync clients."""
        self.engine = engine
        self.max_queued = max_queued
        self.on_finished = on_finished
        self.snapshot = EngineSnapshot(kv_blocks=engine.kv.num_blocks)
        self.dead: BaseException | None = None
        self._inbox: deque[AddCommand | AbortCommand] = deque()
        self._cv = threading.Condition()
        self._sinks: dict[str, Any] = {}  # request id -> its sink; engine thread only
        self._num_async = 0  # async requests not yet finished; event loop side
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine already has requests of another caller")
        with _DRIVEN_LOCK:
            if id(self.engine) in _DRIVEN:
                raise RuntimeError("another AsyncEngine already drives this engine")
            _DRIVEN.add(id(self.engine))
        self._thread = threading.Thread(target=self._run, name="batchrun-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything still running and stop the thread; the engine is left empty."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                with _DRIVEN_LOCK:
                    _DRIVEN.discard(id(self.engine))

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine died: {self.dead!r}")
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")

    # --- the async side -------------------------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 *, stream: bool = False, priority: int = INTERACTIVE_PRIORITY,
                 multimodal: MultiModalInputs | None = None) -> "RequestStream":
        """Queue a request; iterate the result for its outputs (cumulative per choice, the last
        one finished). Refusals that need no engine work (dead engine, full queue) raise here, so
        a handler can still answer with an HTTP error. close() the stream when done with it:
        closing an unfinished stream aborts the request."""
        self.check_alive()
        if self.max_queued is not None and self._num_async >= self.max_queued:
            raise QueueFullError(f"the server is at its limit of {self.max_queued} requests in "
                                 "flight; retry later")
        sink = _AsyncSink(asyncio.get_running_loop())
        self._num_async += 1
        self.submit(AddCommand(request_id, list(prompt_token_ids), params, stream, priority, sink,
                               multimodal))
        return RequestStream(self, request_id, sink)

    def abort(self, request_id: str) -> None:
        self.submit(AbortCommand(request_id))

    def submit(self, command: AddCommand | AbortCommand) -> None:
        """Queue a command for the engine thread (a client with its own sink, such as
        sync_client's, adds its requests this way)."""
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        failed_steps = 0
        try:
            while True:
                with self._cv:
                    while not self._inbox and not engine.has_unfinished_requests() \
                            and not self._stopping:
                        self._cv.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                for command in commands:
                    self._apply(command)
                if stopping:
                    break
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as exc:
                        failed_steps += 1
                        if failed_steps >= MAX_FAILED_STEPS:
                            raise
                        log.exception("a step failed; failing the %d requests in the engine",
                                      len(self._sinks))
                        self._fail_in_engine(exc)
                    else:
                        failed_steps = 0
                        self._deliver(outputs)
                self._refresh_snapshot()
        except BaseException as exc:  # noqa: BLE001 - anything else kills the engine
            log.exception("the engine died")
            self.dead = exc
            self._fail_all(EngineDeadError(f"the engine died: {exc!r}"))
            return
        for request_id in list(self._sinks):  # every request in the engine came through here
            engine.abort_request(request_id)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._refresh_snapshot()

    def _apply(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AbortCommand):
            sink = self._sinks.pop(command.request_id, None)
            out = self.engine.abort_request(command.request_id)
            if out is not None and sink is not None:
                self._report(out, sink)
            return
        request_id, prompt, sink = command.request_id, command.prompt_token_ids, command.sink
        # The prompt's images (engine/multimodal.py), only when there are: engines without
        # images keep their signature.
        extra = {} if command.multimodal is None else {"multimodal": command.multimodal}
        try:
            self.engine.add_request(request_id, prompt, command.params, arrival_time=time.time(),
                                    stream=command.stream, priority=command.priority, **extra)
        except ValueError as exc:
            # An async caller gets the exception; a sync client (the batch runner) expects
            # refusals as failed outputs from step(), so it gets one.
            refusal = exc if isinstance(sink, _AsyncSink) else _refused(request_id, prompt,
                                                                         str(exc))
            self._push(sink, refusal)
            return
        self._sinks[request_id] = sink

    def _fail_in_engine(self, exc: Exception) -> None:
        """After a failed step, which no single request can be blamed for: every request in the
        engine ends with an error, leaving it empty for the next ones. If it cannot be emptied,
        the engine is dead (the exception propagates)."""
        message = f"the engine failed while running this request: {exc!r}"
        outputs = []
        for request_id in list(self._sinks):
            out = self.engine.abort_request(request_id) or _refused(request_id, [], message)
            out.error = message
            outputs.append(out)
        self._deliver(outputs)
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine kept requests after a failed step") from exc

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                if sink is not None:
                    self._report(out, sink)
            if sink is None:
                continue
            if isinstance(sink, _AsyncSink):
                by_loop.setdefault(sink.loop, []).append((sink, out))
            else:
                sink.push(out)
        for loop, items in by_loop.items():
            _call_soon(loop, _push_all, items)

    def _report(self, out: RequestOutput, sink) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(out, "api" if isinstance(sink, _AsyncSink) else "batch")
            except Exception:  # metrics must never take the engine down
                log.exception("on_finished failed")

    def _push(self, sink, item) -> None:
        if isinstance(sink, _AsyncSink):
            _call_soon(sink.loop, sink.push, item)
        else:
            sink.push(item)

    def _fail_all(self, error: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            self._push(sink, error)
        with self._cv:  # commands that raced in after the thread stopped
            commands = list(self._inbox)
            self._inbox.clear()
        for command in commands:
            if isinstance(command, AddCommand):
                self._push(command.sink, error)

    def _refresh_snapshot(self) -> None:
        sched = self.engine.scheduler
        kv = self.engine.kv
        self.snapshot = EngineSnapshot(running=len(sched.running), waiting=len(sched.waiting),
                                       kv_used_blocks=kv.num_used_blocks, kv_blocks=kv.num_blocks,
                                       steps=self.engine.stats.steps)


def _refused(request_id: str, prompt: list[int], error: str) -> RequestOutput:
    return RequestOutput(request_id, prompt, [CompletionOutput(0, "", [], finish_reason="abort")],
                         finished=True, error=error)


def _push_all(items) -> None:
    for sink, out in items:
        sink.push(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: its readers are gone
        pass
