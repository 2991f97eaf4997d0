"""A blocking, engine-shaped client of an AsyncEngine, for a thread that drives its own loop
(the batch runner inside the server): `SyncEngineClient(async_engine)`. It implements
batchrun.engine.client.EngineClient.

This module knows the AsyncEngine; the AsyncEngine does not know it (it hands outputs to any
sink with a push() method).
"""

from __future__ import annotations

import queue
from typing import Sequence

from batchrun.engine.async_engine import BATCH_PRIORITY, AddCommand, AsyncEngine
from batchrun.engine.client import EngineStats
from batchrun.engine.multimodal import MultiModalInputs
from batchrun.engine.outputs import RequestOutput
from batchrun.engine.sampling_params import SamplingParams


class _SyncSink:
    def __init__(self, q: "queue.Queue"):
        self.queue = q

    def push(self, item: RequestOutput | BaseException) -> None:  # on the engine thread
        self.queue.put(item)


class SyncEngineClient:
    """The part of Engine's interface the batch runner uses, for a thread of its own while the
    AsyncEngine's thread drives the real engine. step() blocks until one of this client's
    requests has output, or until wake() (then it returns nothing, so the runner's loop gets to
    look at its stop flag)."""

    def __init__(self, owner: AsyncEngine, priority: int = BATCH_PRIORITY):
        self.owner = owner
        self.priority = priority
        self.max_model_len = owner.engine.max_model_len
        self._queue: queue.Queue = queue.Queue()
        self._sink = _SyncSink(self._queue)
        self._open: set[str] = set()
        self.num_ok = 0
        self.num_failed = 0

    @property
    def stats(self) -> EngineStats:
        """The shared engine's counters (every caller's requests, not only this client's)."""
        return self.owner.engine.stats

    def wake(self) -> None:
        self._queue.put(None)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    stream: bool = False, priority: int | None = None,
                    multimodal: MultiModalInputs | None = None) -> None:
        """Queue a request for the engine thread (raises EngineDeadError if it is not running).
        The engine's refusals (PromptTooLongError, ValueError) come back from step() as finished
        outputs with `error` set. arrival_time is ignored: the engine thread stamps it."""
        self.owner.check_alive()
        self._open.add(request_id)
        self.owner.submit(AddCommand(request_id, list(prompt_token_ids), params, stream,
                                     self.priority if priority is None else priority, self._sink,
                                     multimodal))

    def abort_request(self, request_id: str) -> None:
        """Abort one of this client's requests (queued for the engine thread)."""
        if request_id in self._open:
            self._open.discard(request_id)
            self.owner.abort(request_id)

    def close(self) -> None:
        """Abort this client's requests still in the engine: a runner that raised may leave
        some, and they would hold sequence slots and KV blocks of the shared engine."""
        for request_id in list(self._open):
            self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether this client has requests in the engine (other callers' do not count)."""
        return bool(self._open)

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Outputs of this client's requests: blocks for the first, then takes what is queued."""
        items = [self._queue.get(timeout=timeout)]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        outputs = []
        for item in items:
            if item is None:
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._open.discard(item.request_id)
                if item.error or any(c.finish_reason == "abort" for c in item.outputs):
                    self.num_failed += 1
                else:
                    self.num_ok += 1
            outputs.append(item)
        return outputs
