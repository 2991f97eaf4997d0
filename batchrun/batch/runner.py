"""The batch job: stream an OpenAI batch file through the engine, write results in input order."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from batchrun.batch import io
from batchrun.batch.metrics import RunMetrics
from batchrun.engine.sampling_params import SamplingParams
from batchrun.openai.params import RequestDefaults, check_model_field, to_sampling_params
from batchrun.openai.protocol import LineError, RequestError, parse_batch_line
from batchrun.openai.render import render_prompt
from batchrun.openai.response import (batch_error_line, batch_output_line, chat_completion,
                                      engine_error, new_request_id)

@dataclass
class RunConfig:
    input: str
    output: str
    errors: str | None = None  # None = <output stem>.errors.jsonl
    metrics: str | None = None  # None = <output stem>.metrics.json
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    ignore_model_field: bool = False
    # Requests handed to the engine and not yet finished; the engine's scheduler picks among them.
    max_in_flight: int = 256
    # Most records between the oldest unwritten one and the newest read (None = 4 * max_in_flight):
    # bounds memory when an early request runs long while later ones finish.
    reorder_window: int | None = None
    progress: bool = True

    @property
    def errors_path(self) -> str:
        return self.errors or io.sibling_path(self.output, ".errors.jsonl")

    @property
    def metrics_path(self) -> str:
        return self.metrics or io.sibling_path(self.output, ".metrics.json")


@dataclass
class Prepared:
    custom_id: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def prepare_line(raw: str, line_number: int, model: Any, config: RunConfig) -> Prepared:
    """Validate, render and parameterise one input line; raise LineError for a bad one."""
    line, request = parse_batch_line(raw, line_number)
    try:
        if request.stream:
            raise RequestError("stream: streaming is not available in a batch file",
                               code="unsupported_value", param="stream")
        check_model_field(request.model, model.name, model.aliases, config.ignore_model_field)
        prompt = render_prompt(model.tokenizer, request.messages)
        params = to_sampling_params(request, len(prompt), model.max_model_len,
                                    model.generation_defaults, config.defaults)
    except RequestError as exc:
        raise LineError(line_number, exc, line.custom_id) from None
    return Prepared(line.custom_id, new_request_id(), prompt, params)


class OrderedWriter:
    """Holds finished records until every earlier one is done, then writes each to its file."""

    def __init__(self, output: io.JsonlWriter, errors: io.JsonlWriter):
        self._files = {"ok": output, "error": errors}
        self._done: dict[int, tuple[str, dict]] = {}
        self.next_to_write = 0

    @property
    def held(self) -> int:
        return len(self._done)

    def put(self, seq: int, kind: str, record: dict) -> None:
        self._done[seq] = (kind, record)

    def drain(self) -> None:
        wrote = False
        while self.next_to_write in self._done:
            kind, record = self._done.pop(self.next_to_write)
            self._files[kind].write(record)
            self.next_to_write += 1
            wrote = True
        if wrote:
            for f in self._files.values():
                f.flush()


@dataclass
class _InFlight:
    seq: int
    line_number: int
    custom_id: str


class _Progress:
    def __init__(self, config: RunConfig, metrics: RunMetrics):
        total = io.count_lines(config.input) if config.progress else None
        self.bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not config.progress,
                        dynamic_ncols=True, smoothing=0.05)
        self.metrics = metrics
        self._last_postfix = 0.0

    def advance(self) -> None:
        self.bar.update(1)
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:
            self._last_postfix = now
            elapsed = self.metrics.elapsed()
            rate = self.metrics.completion_tokens / elapsed if elapsed > 0 else 0.0
            self.bar.set_postfix_str(f"{rate:.1f} out tok/s, {self.metrics.failed} failed",
                                     refresh=False)

    def close(self) -> None:
        self.bar.close()


class _Job:
    """The read -> engine -> ordered write loop of one run."""

    def __init__(self, model: Any, config: RunConfig, sink: OrderedWriter, metrics: RunMetrics,
                 progress: _Progress):
        self.model, self.engine, self.config = model, model.engine, config
        self.sink, self.metrics, self.progress = sink, metrics, progress
        self.window = config.reorder_window or 4 * config.max_in_flight
        if self.window < config.max_in_flight:
            raise ValueError("reorder_window must be at least max_in_flight")
        self.lines: Iterator[tuple[int, str]] = io.iter_lines(config.input)
        self.exhausted = False
        self.next_seq = 0
        self.in_flight: dict[str, _InFlight] = {}

    def run(self) -> None:
        try:
            while True:
                self.admit()
                self.sink.drain()
                if not self.in_flight:
                    if self.exhausted:
                        return
                    continue
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped {len(self.in_flight)} requests "
                                       "without returning their outputs")
                self.collect(self.engine.step())
                self.sink.drain()
        except BaseException:
            # Leave the engine clean for a caller that keeps using it (tests, a server).
            for request_id in self.in_flight:
                self.engine.abort_request(request_id)
            raise

    def _has_room(self) -> bool:
        return (not self.exhausted and len(self.in_flight) < self.config.max_in_flight
                and self.next_seq - self.sink.next_to_write < self.window)

    def admit(self) -> None:
        """Read lines until the in-flight limit or the reorder window is reached."""
        while self._has_room():
            try:
                line_number, raw = next(self.lines)
            except StopIteration:
                self.exhausted = True
                return
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            try:
                p = prepare_line(raw, line_number, self.model, self.config)
            except LineError as exc:
                self.fail(seq, exc)
                continue
            try:
                self.engine.add_request(p.request_id, p.prompt_token_ids, p.params)
            except ValueError as exc:  # PromptTooLongError and other refusals
                error = RequestError(str(exc), code="context_length_exceeded", param="messages")
                self.fail(seq, LineError(line_number, error, p.custom_id), p.request_id)
                continue
            self.in_flight[p.request_id] = _InFlight(seq, line_number, p.custom_id)

    def collect(self, outputs: list[Any]) -> None:
        for out in outputs:
            if not out.finished or out.request_id not in self.in_flight:
                continue
            req = self.in_flight.pop(out.request_id)
            err = engine_error(out)
            if err is not None:
                self.fail(req.seq, LineError(req.line_number, err, req.custom_id), out.request_id)
                continue
            body = chat_completion(out, self.model.name)
            self.sink.put(req.seq, "ok", batch_output_line(req.custom_id, out.request_id, body))
            self.metrics.record_ok(out)
            self.progress.advance()

    def fail(self, seq: int, error: LineError, request_id: str | None = None) -> None:
        self.sink.put(seq, "error", batch_error_line(error, request_id=request_id))
        self.metrics.record_failed()
        self.progress.advance()


def run_batch(model: Any, config: RunConfig) -> dict[str, Any]:
    """Run the whole input through model.engine; return the metrics (also written to a file).

    `model` is a batchrun.llm.LoadedModel (engine, tokenizer, name, aliases,
    generation_defaults, max_model_len).
    """
    metrics = RunMetrics()
    progress = _Progress(config, metrics)
    with contextlib.ExitStack() as stack:
        stack.callback(progress.close)
        output = stack.enter_context(io.JsonlWriter(config.output))
        errors = stack.enter_context(io.JsonlWriter(config.errors_path))
        if config.progress:
            stack.enter_context(logging_redirect_tqdm())
        _Job(model, config, OrderedWriter(output, errors), metrics, progress).run()

    result = metrics.summary(model.engine, model=model.name, input=config.input,
                             output=config.output, errors=config.errors_path)
    io.write_json(config.metrics_path, result)
    return result
