"""batchrun as a Ray Data stage: a processor that turns a Dataset of requests into a Dataset of
results, each engine replica an actor of `map_batches` that loads the model once.

    import ray
    from batchrun.batch.ray_data import build_processor

    processor = build_processor(model=None, engine={"max_num_seqs": 64}, replicas=2,
                                cpus_per_replica=1, batch_size=256)
    ds = ray.data.read_text("requests.jsonl")          # one batch line per row ("text")
    processor(ds).write_parquet("results/")

It lives in batchrun.batch (not batchrun.distributed, which the import layers put below the
batch runner): it is a batch front-end, reusing the Parquet reader's row mapping, the runner's
line preparation and the Parquet writer's result columns.

Input rows take any of the forms batchrun reads:
  * the OpenAI batch columns: `custom_id`, `method`, `url`, `body` (a struct or JSON text);
  * a flat table: `custom_id` + `messages` (JSON text or a list of structs) or `prompt`
    (+ `system`), + sampling columns named like the request fields (`max_tokens`, ...);
    `columns={"prompt": "question"}` maps differently named columns (like `--column`);
  * the raw text of a batch line in `text_column` ("text", what `ray.data.read_text` gives),
    when the table has no custom_id column: a malformed line then fails alone.
Each row becomes the JSON text of one batch line exactly as the Parquet reader makes it, then
is validated and rendered by the batch runner's own `prepare_line`.

Output rows have the Parquet output's columns (`batch.parquet.RESULT_SCHEMA`: id, custom_id,
status_code, content, finish_reason, token counts, body, error), one per input row, built from
the batch file's response records. A row that cannot run (bad JSON, a bad field, a prompt too
long, an engine error) is an error row (error set, status_code 400/500, or null when the row
had no custom_id), never the end of the dataset. `carry=("col", ...)` copies input columns to
the output unchanged (to join results back, or to tell rows without a custom_id apart).

Unlike `batchrun run`, nothing checks that custom_ids are unique across the dataset, there is no
resume, and error rows carry no line number (a Dataset row has none).

Each `map_batches` call pushes its whole batch into the replica's engine at once and steps until
every request has finished: the engine's continuous batching (max_num_seqs, the KV cache) decides
what runs together; `batch_size` bounds how many rows a replica holds at a time, and Ray hands
out about that many rows per call, so a dataset of fewer than replicas x batch_size rows leaves
replicas idle: give a small one a smaller batch_size.

The replicas reserve `cpus_per_replica` each; the dataset's reads and writes reserve a CPU per
task by default, so when the replicas hold every CPU give those `ray_remote_args={"num_cpus":
0}` (they are I/O), or they wait forever (a warning says so).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from batchrun.batch.storage.parquet import (RESULT_SCHEMA, request_fields, resolve_columns, result_row,
                                    row_custom_id, row_text)
from batchrun.engine.errors import PromptTooLongError
from batchrun.openai.wire import LineError, RequestError, peek_custom_id
from batchrun.openai.bodies import batch_error_line, batch_output_line, engine_error

log = logging.getLogger("batchrun.ray_data")
WHERE = "the dataset"  # how schema errors name the input


def _plain(error: RequestError, custom_id: str | None = None
           ) -> tuple[RequestError, str | None]:
    """A LineError without its line number (a Dataset row has none): the same error, and the
    custom_id it had got to."""
    if isinstance(error, LineError):
        custom_id = error.custom_id if custom_id is None else custom_id
        error = RequestError(error.message, code=error.code, param=error.param,
                             type=error.type, status_code=error.status_code)
    return error, custom_id


def _internal(stage: str, exc: Exception) -> RequestError:
    return RequestError(f"internal error while {stage}: {type(exc).__name__}: {exc}",
                        code="internal_error", type="server_error", status_code=500)


def input_mode(names: Sequence[str], columns: dict[str, str], text_column: str | None
               ) -> dict[str, str] | None:
    """The field -> column mapping of a table (resolve_columns), or None when its rows are raw
    batch lines in `text_column`. Raises ValueError for a table that is neither."""
    raw = (text_column is not None and text_column in names and not columns
           and not any(f in names for f in ("custom_id", "body", "messages", "prompt")))
    if raw:
        return None
    try:
        return resolve_columns(WHERE, list(names), columns)
    except ValueError as exc:
        if text_column and text_column not in names:
            raise ValueError(f"{exc} (or give the raw batch lines in a {text_column!r} "
                             "column)") from None
        raise


def line_texts(table: Any, columns: dict[str, str], text_column: str | None
               ) -> list[tuple[str | None, RequestError | None, str | None]]:
    """Each row of a pyarrow table -> (its batch line's JSON text, or None with the problem and
    the custom_id it has)."""
    mapping = input_mode(table.column_names, columns, text_column)
    out: list[tuple[str | None, RequestError | None, str | None]] = []
    for row in table.to_pylist():
        if mapping is None:
            text = row[text_column]
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            if not isinstance(text, str) or not text.strip():
                out.append((None, RequestError(f"{text_column}: expected the JSON text of a "
                                               "batch line", code="invalid_json",
                                               param=text_column), None))
            else:
                out.append((text, None, None))
            continue
        try:
            out.append((row_text(row, mapping), None, None))
        except RequestError as exc:
            out.append((None, exc, row_custom_id(row, mapping)))
    return out


class BatchEngine:
    """One replica: the model loaded once; `run(texts)` -> one batch output / error record
    (dict) per line text, in order. Plain Python (Ray-free) so it can be tested alone."""

    def __init__(self, load: Callable[[str | None, Any], Any], model: str | None,
                 engine_config: Any, serving_options: Any, threads: int | None = None):
        from batchrun.openai.serving import OpenAIServing

        if threads:
            os.environ["BATCHRUN_THREADS"] = str(threads)
            import torch

            torch.set_num_threads(threads)
        self.model = load(model, engine_config)
        self.engine = self.model.engine
        self.serving = OpenAIServing(self.model, serving_options)

    def run(self, lines: Sequence[tuple[str | None, RequestError | None, str | None]]
            ) -> list[dict]:
        from batchrun.batch.job.runner import prepare_line

        records: list[dict | None] = [None] * len(lines)
        prepared: dict[int, Any] = {}
        for i, (text, problem, cid) in enumerate(lines):
            if text is None:
                assert problem is not None  # a line without text has its problem
                records[i] = batch_error_line(*_plain(problem, cid))
                continue
            try:
                prepared[i] = prepare_line(text, 0, self.serving)
            except LineError as exc:
                records[i] = batch_error_line(*_plain(exc))
            except Exception as exc:  # a bug preparing this row: it fails, the batch goes on
                records[i] = batch_error_line(_internal("preparing the request", exc),
                                              peek_custom_id(text))
        waiting = self._add(prepared, records)
        outputs: dict[int, dict[str, Any]] = {i: {} for i in prepared}
        while waiting:
            for out in self.engine.step():
                if not out.finished or out.request_id not in waiting:
                    continue
                i = waiting.pop(out.request_id)
                p = prepared[i]
                err = engine_error(out)
                if err is not None:
                    self._drop(p, waiting)
                    records[i] = batch_error_line(err, p.custom_id, out.request_id)
                    continue
                outputs[i][out.request_id] = out
                parts = [outputs[i].get(rid) for rid, _ in p.engine_requests]
                if None in parts:
                    continue  # a completions line with several prompts: wait for all
                try:
                    records[i] = batch_output_line(p.custom_id, p.request_id,
                                                   p.request.finalize(parts))
                except Exception as exc:  # a parser bug on this output: this row fails
                    records[i] = batch_error_line(_internal("building the response", exc),
                                                  p.custom_id, p.request_id)
        return records  # type: ignore[return-value]

    def _add(self, prepared: dict[int, Any], records: list) -> dict[str, int]:
        """Every prepared row's engine requests into the engine; engine request id -> row."""
        waiting: dict[str, int] = {}
        for i, p in prepared.items():
            try:
                images = p.request.multimodal  # a chat row's images: never dropped silently
                extra = {} if images is None else {"multimodal": images}
                for request_id, prompt in p.engine_requests:
                    self.engine.add_request(request_id, prompt, p.params, **extra)
                    waiting[request_id] = i
            except ValueError as exc:  # the engine refuses what it cannot run
                if isinstance(exc, PromptTooLongError):
                    error = RequestError(str(exc), code="context_length_exceeded",
                                         param="messages")
                else:
                    error = RequestError(str(exc), code="unsupported_value")
                self._drop(p, waiting)
                records[i] = batch_error_line(error, p.custom_id, p.request_id)
        return waiting

    def _drop(self, p: Any, waiting: dict[str, int]) -> None:
        for request_id, _ in p.engine_requests:
            if waiting.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)


class _Stage:
    """The map_batches callable class: a pyarrow batch of requests -> a pyarrow batch of
    results (RESULT_SCHEMA + the carried columns)."""

    def __init__(self, load, model, engine_config, serving_options, threads, columns,
                 text_column, carry):
        self.replica = BatchEngine(load, model, engine_config, serving_options, threads)
        self.columns, self.text_column, self.carry = columns, text_column, tuple(carry)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        records = self.replica.run(line_texts(batch, self.columns, self.text_column))
        table = pa.Table.from_pylist([result_row(r) for r in records], schema=RESULT_SCHEMA)
        for name in self.carry:
            table = table.append_column(name, batch.column(name))
        return table


@dataclass
class Processor:
    """`processor(ds)` -> the results Dataset (lazy, like any Dataset transform)."""

    load: Callable[[str | None, Any], Any]
    model: str | None
    engine_config: Any
    serving_options: Any
    replicas: int
    cpus_per_replica: float
    gpus_per_replica: float
    batch_size: int
    columns: dict[str, str] = field(default_factory=dict)
    text_column: str | None = "text"
    carry: tuple[str, ...] = ()
    preprocess: Callable[[dict], dict] | None = None
    postprocess: Callable[[dict], dict] | None = None

    def check_schema(self, names: Sequence[str]) -> None:
        """Raise ValueError now for a table the stage could not read (no custom_id, ...)."""
        input_mode(names, self.columns, self.text_column)
        missing = [c for c in self.carry if c not in names]
        if missing:
            raise ValueError(f"carry: {WHERE} has no column {missing[0]!r} (it has: "
                             f"{', '.join(names)})")

    def check_cpus(self) -> None:
        """Warn when the replicas would hold every CPU of the cluster: the dataset's other tasks
        (reading, writing, preprocess) reserve a CPU each by default and would wait forever."""
        import ray

        if not ray.is_initialized():
            return
        total = ray.cluster_resources().get("CPU", 0)
        if total and self.replicas * self.cpus_per_replica > total - 1:
            log.warning("%d replicas x %g CPUs leave under one CPU of %g for the dataset's "
                        "other tasks: give the reads and writes ray_remote_args={'num_cpus': 0} "
                        "(or fewer cpus_per_replica), or they may wait forever",
                        self.replicas, self.cpus_per_replica, total)

    def __call__(self, ds: Any) -> Any:
        self.check_cpus()
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        schema = ds.schema(fetch_if_missing=False)  # known without running anything, or None
        if schema is not None:
            self.check_schema(list(schema.names))
        import ray

        ds = ds.map_batches(
            _Stage, batch_format="pyarrow", batch_size=self.batch_size,
            compute=ray.data.ActorPoolStrategy(size=self.replicas),  # `concurrency=` before 2.51
            num_cpus=self.cpus_per_replica,
            num_gpus=self.gpus_per_replica or None,
            fn_constructor_kwargs=dict(
                load=self.load, model=self.model, engine_config=self.engine_config,
                serving_options=self.serving_options,
                threads=max(1, int(self.cpus_per_replica)), columns=self.columns,
                text_column=self.text_column, carry=self.carry))
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_processor(model: str | None = None, *, engine: dict[str, Any] | None = None,
                    openai: dict[str, Any] | None = None,
                    defaults: dict[str, Any] | None = None, replicas: int = 1,
                    cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0,
                    batch_size: int = 256, columns: dict[str, str] | None = None,
                    text_column: str | None = "text", carry: Sequence[str] = (),
                    preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None,
                    load: Callable[[str | None, Any], Any] | None = None) -> Processor:
    """A processor running `model` (a registry name, folder, .gguf or hub id; None: the bundled
    one) on `replicas` engine actors.

    engine: engine options by their public names ({"max_num_seqs": 64, "dtype": "float32"});
    openai: the OpenAI adapter's (tool_parser, reasoning_parser, chat_template FILE,
    ignore_model_field); defaults: request defaults (temperature, max_tokens, seed). All are
    validated here, so a typo fails before Ray starts anything (OptionsError, a ValueError).
    columns: field -> column mappings, like `--column FIELD=COLUMN`.
    text_column: the column holding raw batch lines (a table without custom_id); None: never.
    carry: input columns copied to each result row. preprocess / postprocess: row functions
    run (ds.map) before and after, like Ray Data LLM's.
    load: how a replica loads the model, `(model, EngineConfig) -> LoadedModel`
    (default batchrun.commandkit.load_model; the tests pass their fake engine's).
    """
    from batchrun.openai.serving import ServingOptions
    from batchrun.options.engine import EngineConfig
    from batchrun.options.fields import validate
    from batchrun.options.openai import OpenAIOptions, RequestDefaults
    from batchrun.options.ray import RayOptions

    engine_config = validate(EngineConfig, dict(engine or {}), where="engine")
    serving = ServingOptions.of(validate(OpenAIOptions, dict(openai or {}), where="openai"),
                                validate(RequestDefaults, dict(defaults or {}),
                                         where="defaults"))
    shape = validate(RayOptions, {"replicas": replicas, "cpus_per_replica": float(cpus_per_replica),
                                  "gpus_per_replica": float(gpus_per_replica)})
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    columns = dict(columns or {})
    known = request_fields()
    for f in columns:
        if f not in known:
            raise ValueError(f"columns: {f!r} is not a request field (one of: {', '.join(known)})")
    clash = [c for c in carry if c in RESULT_SCHEMA.names]
    if clash:
        raise ValueError(f"carry: {clash[0]!r} is a result column")
    if load is None:
        from batchrun.commandkit import load_model

        load = load_model
    return Processor(load, model, engine_config, serving, shape.replicas,
                     shape.cpus_per_replica, shape.gpus_per_replica, batch_size, columns,
                     text_column, tuple(carry), preprocess, postprocess)
