"""A model's batch results scored into rows (one per cell x example x choice), and the rows
summarised per cell (each scorer's metrics with their 95% intervals, tokens, time)."""

from __future__ import annotations

import json
import math
from typing import Any

from batchrun.sweep.cells import Cell
from batchrun.sweep.scorers import Example, ScoreError

PICKED_PREFIX = "picked:"  # results column: the choice a loglikelihood scorer picked


def axis_value(value: Any) -> Any:
    """A setting as a table cell: lists and tables (a stop list) as their JSON text."""
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, ensure_ascii=False)
    return value


def _settings(cell: Cell, axes: list[str]) -> dict[str, Any]:
    settings = dict(cell.settings)
    return {a: axis_value(settings.get(a, cell.model if a == "model" else None)) for a in axes}


def _choice_text(choice: dict[str, Any]) -> str:
    message = choice.get("message") or {}
    return message.get("content") or choice.get("text") or ""


def _continuation_logprob(body: dict[str, Any], n_context: int) -> float:
    """The sum of the continuation's token logprobs in an echoed /v1/completions body."""
    lp = body["choices"][0]["logprobs"]["token_logprobs"]
    return float(sum(x for x in lp[n_context:] if x is not None))


def score_rows(cells: list[Cell], axes: list[str], examples: list[Example],
               outputs: dict[str, dict], errors: dict[str, str], context_tokens: dict[str, int],
               generators: list[Any], choosers: list[Any],
               latency: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """`outputs`: custom_id -> response body; `errors`: custom_id (or cell/example) -> message.
    `generators` score generated text; `choosers` (loglikelihood_choice) pick a choice by the
    log-probabilities of the `ll/...` requests."""
    logprobs = _choice_logprobs(cells, examples, outputs, errors, context_tokens, choosers)
    rows = []
    for cell in cells:
        base = {"cell": cell.id, **_settings(cell, axes)}
        for ex in examples:
            key = f"{cell.id}/{ex.id}"
            found = logprobs.get((cell.prompt, ex.id))  # (logprobs, continuations) or an error
            choice_scores: dict[str, Any] = {}
            pick = found
            for s in choosers:  # each its own pick: loglikelihood_choice_norm normalises
                if isinstance(found, tuple) and _same_choices(s, ex, found[1]):
                    index = s.pick(ex, found[0])
                    pick = (index, found[1][index])
                    choice_scores[f"score:{s.name}"], _ = _score(s, ex, str(index))
                    choice_scores[f"{PICKED_PREFIX}{s.name}"] = found[1][index].strip()
                else:
                    choice_scores[f"score:{s.name}"] = None
                    choice_scores[f"{PICKED_PREFIX}{s.name}"] = None
            base_ex = {**base, "id": ex.id, "reference": reference_text(ex, choosers)}
            if not generators:
                rows.append({**base_ex, "choice": 0,
                             "output": pick[1] if isinstance(pick, tuple) else None,
                             "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0,
                             "latency_s": None,
                             "error": None if isinstance(pick, tuple) else pick,
                             **choice_scores})
                continue
            body = outputs.get(key)
            if body is None:
                rows.append({**base_ex, "choice": 0, "output": None,
                             "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0,
                             "latency_s": None,
                             "error": errors.get(key, "no result for this request"),
                             **{f"score:{s.name}": None for s in generators}, **choice_scores})
                continue
            usage = body.get("usage") or {}
            for j, choice in enumerate(body.get("choices") or []):
                text = _choice_text(choice)
                row = {**base_ex, "choice": j, "output": text,
                       "finish_reason": choice.get("finish_reason"),
                       # usage is per request: on its first choice, so sums stay right
                       "prompt_tokens": usage.get("prompt_tokens", 0) if j == 0 else 0,
                       "completion_tokens": usage.get("completion_tokens", 0) if j == 0 else 0,
                       "latency_s": (latency or {}).get(key), "error": None, **choice_scores}
                problems = []
                for s in generators:
                    row[f"score:{s.name}"], problem = _score(s, ex, text)
                    if problem:
                        problems.append(problem)
                row["error"] = "; ".join(problems) or None
                rows.append(row)
    return rows


def _score(scorer: Any, example: Example, output: str) -> tuple[float | None, str | None]:
    try:
        return float(scorer.score(example, output)), None
    except ScoreError as exc:
        return None, str(exc)


def _same_choices(scorer: Any, example: Example, continuations: list[str]) -> bool:
    """Whether `scorer` asks about the choices the requests were made of (the first chooser's):
    a chooser of other choices has no logprobs to pick from."""
    try:
        return scorer.continuations(example) == continuations
    except ScoreError:
        return False


def reference_text(example: Example, choosers: list[Any]) -> str | None:
    """An example's reference as the report shows it (JSON for what is not a string), with the
    choice it names for a loglikelihood scorer ("2: Paris" for the index of "Paris")."""
    ref = example.reference
    if ref is None:
        return None
    text = ref if isinstance(ref, str) else json.dumps(ref, ensure_ascii=False, default=str)
    if choosers:
        try:
            choices = choosers[0].choices_for(example)
            named = [choices[i] for i in sorted(choosers[0].gold(example))]
        except ScoreError:
            return text
        if named != [text]:
            text += ": " + " | ".join(named)
    return text


def _choice_logprobs(cells, examples, outputs, errors, context_tokens, choosers):
    """(prompt variant, example id) -> (each choice's continuation logprob, the continuations),
    or the error that left it without them. The choices are the same for every chooser (one
    set of `ll/...` requests); each chooser picks from them by its own normalisation."""
    if not choosers:
        return {}
    scorer = choosers[0]
    picked: dict[tuple[str, str], Any] = {}
    for variant in sorted({c.prompt for c in cells}):
        for ex in examples:
            prefix = f"ll/{variant}/{ex.id}"
            if prefix in errors:
                picked[(variant, ex.id)] = errors[prefix]
                continue
            try:
                continuations = scorer.continuations(ex)
            except ScoreError as exc:
                picked[(variant, ex.id)] = str(exc)
                continue
            logprobs = []
            for j in range(len(continuations)):
                body = outputs.get(f"{prefix}/{j}")
                if body is None:
                    logprobs = None
                    picked[(variant, ex.id)] = errors.get(f"{prefix}/{j}", "no result")
                    break
                logprobs.append(_continuation_logprob(body, context_tokens[f"{prefix}/{j}"]))
            if logprobs is not None:
                picked[(variant, ex.id)] = (logprobs, continuations)
    return picked


def summarize(rows: list[dict[str, Any]], cells: list[Cell], axes: list[str], scorers: list[Any],
              wall_by_model: dict[str, float]) -> list[dict[str, Any]]:
    """One row per cell. A model's wall time is shared among its cells by their tokens (they
    ran together through one engine)."""
    by_cell: dict[str, list[dict]] = {c.id: [] for c in cells}
    for row in rows:
        by_cell[row["cell"]].append(row)
    tokens = {c.id: sum(r["prompt_tokens"] + r["completion_tokens"] for r in by_cell[c.id])
              for c in cells}
    model_tokens: dict[str, int] = {}
    for c in cells:
        model_tokens[c.model] = model_tokens.get(c.model, 0) + tokens[c.id]
    out = []
    for cell in cells:
        cell_rows = by_cell[cell.id]
        share = tokens[cell.id] / model_tokens[cell.model] if model_tokens[cell.model] else \
            1 / sum(1 for c in cells if c.model == cell.model)
        wall = wall_by_model.get(cell.model, 0.0) * share
        completion = sum(r["completion_tokens"] for r in cell_rows)
        summary = {"cell": cell.id, **_settings(cell, axes),
                   "examples": len({r["id"] for r in cell_rows}),
                   "errors": sum(1 for r in cell_rows if r.get("error")),
                   "prompt_tokens": sum(r["prompt_tokens"] for r in cell_rows),
                   "completion_tokens": completion, "wall_time_s": wall,
                   "output_tokens_per_s": completion / wall if wall > 0 else 0.0}
        for scorer in scorers:
            per_example: dict[str, list[float]] = {}
            for r in cell_rows:
                value = r.get(f"score:{scorer.name}")
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    per_example.setdefault(r["id"], []).append(value)
            metrics = scorer.summarize(list(per_example.values())) if per_example else {}
            summary.update(_metric_columns(scorer.name, metrics))
        out.append(summary)
    return out


def _metric_columns(name: str, metrics: dict[str, float]) -> dict[str, float]:
    """{"mean", "ci_low", "ci_high"} or {"pass@1", "pass@1_ci_low", ...} -> `name:metric`,
    `name:metric_ci_low`, `name:metric_ci_high`."""
    out = {}
    for key, value in metrics.items():
        if key in ("ci_low", "ci_high"):
            key = f"mean_{key}"
        out[f"{name}:{key}"] = value
    return out
