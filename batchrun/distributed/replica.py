"""One engine replica: a Ray actor that loads the model once and keeps its engine stepping on a
thread of its own, taking requests and handing back finished outputs in batches, so one remote
call carries many rows."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Sequence


class EngineReplica:
    """Made a Ray actor by distributed.client (ray.remote(...)(EngineReplica)); plain Python
    here so it can be read and tested without Ray. Works on any EngineClient (engine/client.py),
    the test suite's fake engine included."""

    def __init__(self, load: Callable[[str | None, Any], Any], model: str | None,
                 engine_config: Any, threads: int | None = None):
        if threads:
            os.environ["BATCHRUN_THREADS"] = str(threads)
            import torch

            torch.set_num_threads(threads)
        self.model = load(model, engine_config)
        self.engine = self.model.engine
        self._inbox: list[tuple[str, list[int], Any, Any]] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._done: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        threading.Thread(target=self._loop, name="batchrun-replica", daemon=True).start()

    def info(self) -> dict[str, Any]:
        # The engine's config as loading settled it (a VLM turns CUDA graphs off): the
        # responses' system_fingerprint is then the local run's.
        return {"name": self.model.name, "max_model_len": self.model.max_model_len,
                "pid": os.getpid(), "config": getattr(self.engine, "config", None)}

    def add(self, requests: Sequence[tuple[str, list[int], Any, Any]]) -> int:
        """(request id, prompt token ids, sampling params, the prompt's images or None)."""
        with self._lock:
            self._inbox.extend(requests)
        self._work.set()
        return len(requests)

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._aborts.extend(request_ids)
        self._work.set()

    def collect(self, timeout: float = 0.05) -> list[Any]:
        """Finished outputs (waits up to `timeout` for the first). Raises what broke the engine:
        the driver replaces this replica."""
        if self._failure is not None:
            raise RuntimeError(f"the engine failed: {self._failure!r}") from self._failure
        out = []
        try:
            out.append(self._done.get(timeout=timeout))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    def stats(self) -> Any:
        return self.engine.stats

    def _loop(self) -> None:
        from batchrun.engine.outputs import RequestOutput

        try:
            while True:
                with self._lock:
                    new, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for request_id in aborts:
                    self.engine.abort_request(request_id)
                for request_id, prompt, params, images in new:
                    extra = {} if images is None else {"multimodal": images}
                    try:
                        self.engine.add_request(request_id, prompt, params, **extra)
                    except ValueError as exc:  # the engine refuses this one request
                        self._done.put(RequestOutput(request_id, prompt, [], finished=True,
                                                     error=str(exc)))
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            self._done.put(out)
                else:
                    self._work.wait(0.05)
                    self._work.clear()
        except BaseException as exc:  # the driver sees it on the next collect
            self._failure = exc
