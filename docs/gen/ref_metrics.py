"""reference/metrics.md: the fields of a run's metrics file, read from a real metrics file
written by a small job on the test suite's fake engine at build time. Every field needs a line
here, and every line a field (or a note saying when it appears): the build fails otherwise."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from md import table

FIELDS = {
    "model": "The served model's name.",
    "status": "`completed`, `expired` (the deadline passed), `interrupted`, `incomplete` (the "
              "merged output lacks records) or `failed`.",
    "input": "The inputs, as the job named them.",
    "output": "The output file.",
    "errors": "The error file.",
    "requests": "`total`, `ok` and `failed` lines of the job, earlier attempts included.",
    "prompt_tokens": "Prompt tokens of this run's finished requests.",
    "completion_tokens": "Completion tokens generated in this run.",
    "requested_completion_tokens": "Completion tokens the requests asked for (max_tokens x n).",
    "cached_tokens": "Prompt tokens served from the prefix cache.",
    "cache_hit_rate": "cached_tokens / prompt_tokens.",
    "wall_time_s": "Seconds from the job's start to its end.",
    "requests_per_s": "Lines finished per second.",
    "output_tokens_per_s": "Completion tokens per second.",
    "total_tokens_per_s": "Prompt and completion tokens per second.",
    "ttft_s": "Time to first token, `p50` and `p90`, seconds.",
    "engine": "The engine's counters (below).",
    "resumed": "Lines an earlier, interrupted attempt had committed.",
    "lines_in_job": "Input lines of the job.",
    "this_run": "`ok` and `failed` lines of this attempt alone.",
    "input_fingerprint": "What identifies the inputs (paths, sizes, times): a rerun over the "
                         "same inputs finds its own completed job.",
    "batch_invariant": "Whether `--batch-invariant` was on.",
}
SOMETIMES = {
    "replicas": "With `--ray`: per replica, the requests it finished and the prompt tokens it "
                "served from its cache.",
    "expired": "When the deadline passed: the lines that got `batch_expired`.",
    "expired_at": "When the deadline passed: the Unix time it did.",
    "deadline": "When the deadline passed: the deadline, as given.",
    "merged_records": "With status `incomplete`: the records the merged output holds.",
}


def _sample_metrics(root: Path) -> dict:
    import sys

    from click.testing import CliRunner

    if str(root) not in sys.path:  # tests/ (the fake engine) is the repository's, not installed
        sys.path.insert(0, str(root))

    from batchrun.cli import main
    from tests.fake_engine import load

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        # the fake run's timings must not calibrate `batchrun plan` for the real model
        result = CliRunner().invoke(main, ["run", str(root / "sample_data" / "chat.jsonl"), "-o",
                                           str(out), "-q"], obj={"load_model": load},
                                    env={"BATCHRUN_RUNS_DIR": str(Path(tmp) / "runs")})
        if result.exit_code != 0:
            raise RuntimeError(f"the sample job failed ({result.exit_code}): {result.output}") \
                from result.exception
        text = (Path(tmp) / "out.metrics.json").read_text()
        # the example names its files as a reader's would be named, not the build's
        text = text.replace(str(Path(tmp)) + "/", "").replace(str(root.resolve()) + "/", "")
        return json.loads(text)


def render(root: Path) -> str:
    from batchrun.engine.client import EngineStats

    sample = _sample_metrics(root)
    unknown = sorted(set(sample) - set(FIELDS) - set(SOMETIMES))
    absent = sorted(set(FIELDS) - set(sample))
    if unknown or absent:
        raise RuntimeError(f"docs/gen/ref_metrics.py is out of date: fields without a line "
                           f"{unknown}, lines for fields a run does not write {absent}")
    rows = [[f"`{k}`", FIELDS[k]] for k in sample] + \
        [[f"`{k}`", v] for k, v in SOMETIMES.items()]
    engine = [[f"`engine.{f.name}`", f.type if isinstance(f.type, str) else f.type.__name__]
              for f in dataclasses.fields(EngineStats)]
    return "\n".join([
        "# Metrics file\n",
        "`batchrun run` writes `<output stem>.metrics.json` (`--metrics` to move it) at the "
        "end of a job. Its fields, as a job on the test suite's fake engine wrote them when "
        "this site was built (so the example's times and token counts are not a model's):\n", table(["field", "meaning"], rows),
        "## `engine`\n", table(["field", "type"], engine),
        "## An example\n", "```json\n" + json.dumps(sample, indent=2) + "\n```\n"])
