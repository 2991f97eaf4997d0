"""Run a sweep: per model, one batch job of all its cells' requests through one engine (shared
prompts are computed once by the prefix cache), then the scorers, then the tables and the
report. Everything lands in the spec's output folder:

    requests/<model>.jsonl      the model's batch input (rewritten only when it changes)
    generations/<model>.jsonl   its results (+ .errors.jsonl, .metrics.json, and a staging
                                folder while it runs: a killed sweep resumes there)
    scores/<model>.parquet      its scored rows (kept: a resumed sweep re-scores nothing)
    results.parquet  summary.parquet  summary.csv  sweep.json  report.html
"""

from __future__ import annotations

import gc
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from batchrun.batch.storage import io
from batchrun.batch.job.plan import BatchConfigError, make_plan
from batchrun.batch.job.progress import format_duration
from batchrun.batch.job.result import RunResult
from batchrun.batch.job.runner import run_batch
from batchrun.batch.storage.store import Storage
from batchrun.footprint import tokenizer_model
from batchrun.openai.bodies import line_error
from batchrun.options.job import InputOptions, JobOptions
from batchrun.options.openai import OpenAIOptions
from batchrun.options.run import RunOptions
from batchrun.sweep import cells as grid
from batchrun.sweep import dataset, requests, tables
from batchrun.sweep.scorers import build as build_scorer
from batchrun.sweep.scorers.loglikelihood import LoglikelihoodChoice
from batchrun.sweep.spec import SpecError, SweepSpec

log = logging.getLogger("batchrun.sweep")


@dataclass
class SweepResult:
    status: str  # completed | interrupted
    output: str
    cells: int
    models: list[str] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    first_error: str | None = None


def slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"


def _write_if_changed(path: str, text: str, storage: Storage) -> None:
    """Keep the file (and its version: mtime or ETag, part of the run's input fingerprint)
    when its content is unchanged."""
    data = text.encode("utf-8")
    try:
        with storage.open_read(path) as f:
            if f.read() == data:
                return
    except (FileNotFoundError, OSError):
        pass
    io.write_bytes_atomic(path, data, storage.options)


def _read_records(path: str, storage: Storage
                  ) -> tuple[dict[str, dict], dict[str, str], dict[str, float]]:
    """custom_id -> response body, error message and latency, from a run's files."""
    bodies, errors, latency = {}, {}, {}
    for name in (path, io.sibling_path(path, ".errors.jsonl")):
        if not storage.exists(name):
            continue
        with storage.open_read(name) as f:
            for raw in f:
                record = json.loads(raw)
                cid = record.get("custom_id")
                error = line_error(record)
                if error is not None:
                    errors[cid] = error.get("message") or "error"
                elif record.get("response"):
                    bodies[cid] = record["response"]["body"]
                    if record.get("latency_s") is not None:
                        latency[cid] = record["latency_s"]
    return bodies, errors, latency


def run_sweep(spec: SweepSpec, spec_text: str, load: Callable[[str | None, Any], Any],
              resume: bool = False, restart: bool = False, stop: Any = None,
              on_stage: Callable[[str], None] = lambda text: None,
              overwrite: bool = False) -> SweepResult:
    """Raises sweep.spec.SpecError and batch.plan.BatchConfigError for what the user must fix,
    an output folder that holds a sweep's results included (unless resume, restart or
    overwrite says what to do with them)."""
    import polars as pl

    out, storage = spec.output.rstrip("/"), Storage(spec.dataset.storage_options)
    if not (resume or restart or overwrite):
        _refuse_existing(out, storage)
    rows = dataset.read_rows(spec.dataset)
    prompts = {t.name: t for t in dataset.templates(spec.dataset, spec.grid.get("prompt"))}
    examples = dataset.examples(spec.dataset, rows, list(prompts.values()))
    scorers = []
    for number, config in enumerate(spec.scorers):
        try:
            scorers.append(build_scorer(config, base_dir=Path(spec.folder) if spec.folder else None))
        except ValueError as exc:  # an unimportable function, a missing file, no sandbox...
            raise SpecError(f"scorers[{number}] ({config.scorer_name}): {exc}") from None
    choosers = [s for s in scorers if isinstance(s, LoglikelihoodChoice)]
    generators = [s for s in scorers if not isinstance(s, LoglikelihoodChoice)]
    cells = grid.cells(spec.grid)
    axes = grid.axes(spec.grid)
    engine = spec.engine_config()
    models = list(dict.fromkeys(c.model for c in cells))
    result = SweepResult("completed", out, len(cells), models)
    on_stage(f"{len(cells)} cells x {len(examples)} examples, {len(models)} model(s), "
             f"scorers: {', '.join(s.name for s in scorers)}")

    base_of = lora_bases(models, engine.lora.adapters)
    models.sort(key=lambda m: list(base_of.values()).index(base_of[m]))  # a base, its adapters
    scored: list[dict[str, Any]] = []
    wall_by_model: dict[str, float] = {}
    started, cells_done = time.monotonic(), 0
    loaded, loaded_base = None, None
    for number, model in enumerate(models, start=1):
        model_cells = [c for c in cells if c.model == model]
        name, base = slug(model), base_of[model]
        # tokenizer only, no weights
        served = tokenizer_model(base, engine.max_model_len, engine.trust_remote_code)
        reqs = requests.build(model_cells, examples, prompts, bool(generators), choosers,
                              served.tokenizer, spec.dataset.endpoint,
                              adapter=model if model != base else None,
                              image=spec.dataset.image)
        request_path = f"{out}/requests/{name}.jsonl"
        _write_if_changed(request_path, "".join(line + "\n" for line in reqs.lines), storage)
        generation_path = f"{out}/generations/{name}.jsonl"
        scores_path = f"{out}/scores/{name}.parquet"
        plan = make_plan(RunOptions(
            inputs=InputOptions(input=[request_path], storage_options=spec.dataset.storage_options),
            job=JobOptions(output=generation_path, resume=resume, restart=restart, overwrite=True,
                           progress="auto", record_latency=True),
            engine=engine, openai=OpenAIOptions(ignore_model_field=True)))
        previous = plan.previous  # set when plan.start is "done"
        if plan.start == "done" and storage.exists(scores_path):
            assert previous is not None
            on_stage(f"model {number}/{len(models)} {model}: already run and scored")
            with storage.open_read(scores_path) as f:
                scored.extend(pl.read_parquet(f).to_dicts())
            wall_by_model[model] = RunResult.of(previous).wall_time_s
            cells_done += len(model_cells)
            continue
        if plan.start == "done":
            assert previous is not None
            run = RunResult.of(previous)
        else:
            on_stage(f"model {number}/{len(models)} {model}: {len(model_cells)} cells, "
                     f"{len(reqs.lines)} requests ({plan.start})")
            if loaded_base != base:  # a base model's adapters run on its engine, not reloaded
                loaded = None
                gc.collect()
                loaded, loaded_base = load(base, engine), base
            run = run_batch(loaded, plan, stop=stop)
            if not run.completed:
                result.status = "interrupted"
                return result
        wall_by_model[model] = run.wall_time_s
        on_stage(f"scoring {model}")
        bodies, errors, latency = _read_records(generation_path, storage)
        errors.update(reqs.errors)
        model_rows = tables.score_rows(model_cells, axes, examples, bodies, errors,
                                       reqs.context_tokens, generators, choosers, latency)
        _write_parquet(pl.DataFrame(model_rows, infer_schema_length=None), scores_path, storage)
        scored.extend(model_rows)
        cells_done += len(model_cells)
        elapsed = time.monotonic() - started
        left = elapsed / cells_done * (len(cells) - cells_done)
        on_stage(f"cells done {cells_done}/{len(cells)} in {format_duration(elapsed)}"
                 + (f", about {format_duration(left)} left" if cells_done < len(cells) else ""))

    result.summary = tables.summarize(scored, cells, axes, scorers, wall_by_model)
    result.first_error = next((f"{r['cell']}/{r['id']}: {r['error']}" for r in scored
                               if r.get("error")), None)
    _write_outputs(out, spec, spec_text, axes, scored, result.summary, storage)
    return result


def _refuse_existing(out: str, storage: Storage) -> None:
    """As `batchrun run` refuses to replace an output without --overwrite."""
    found = [name for name in ("sweep.json", "scores", "generations")
             if storage.exists(f"{out}/{name}")]
    if found:
        what = "a finished sweep" if "sweep.json" in found else "a sweep"
        raise BatchConfigError(
            f"{out} holds the results of {what} ({', '.join(found)}). Pass --resume to keep "
            "them (only what is missing runs; nothing, for a finished sweep), --restart to "
            "discard what an interrupted one committed, or --overwrite to replace them.")


def lora_bases(models: list[str], adapters: dict[str, str]) -> dict[str, str]:
    """model -> the model loaded to run it: itself, or for a LoRA adapter ([engine] lora) the
    grid's one base model (the default model when the grid names only adapters)."""
    bases = [m for m in models if m not in adapters]
    named = [m for m in models if m in adapters]
    if named and len(bases) > 1:
        raise SpecError(f"grid.model names LoRA adapters ({', '.join(named)}) and several base "
                        f"models ({', '.join(bases)}): adapters run on one base model")
    base = bases[0] if bases else grid.DEFAULT_MODEL
    return {m: base if m in adapters else m for m in models}


def _write_parquet(frame: Any, path: str, storage: Storage) -> None:
    import io as _io

    buffer = _io.BytesIO()
    frame.write_parquet(buffer)
    io.write_bytes_atomic(path, buffer.getvalue(), storage.options)


def _write_outputs(out: str, spec: SweepSpec, spec_text: str, axes: list[str],
                   rows: list[dict], summary: list[dict], storage: Storage) -> None:
    import polars as pl

    from batchrun.sweep.report import write_report

    results = pl.DataFrame(rows, infer_schema_length=None)
    table = pl.DataFrame(summary, infer_schema_length=None)
    _write_parquet(results, f"{out}/results.parquet", storage)
    _write_parquet(table, f"{out}/summary.parquet", storage)
    io.write_bytes_atomic(f"{out}/summary.csv", table.write_csv().encode(), storage.options)
    storage.write_json(f"{out}/sweep.json", {"name": spec.name, "axes": axes, "spec": spec_text})
    write_report(out, storage)
