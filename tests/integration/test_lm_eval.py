"""EleutherAI's lm-evaluation-harness against `batchrun serve` gives the scores of its own `hf`
backend on the same weights and documents: multiple choice (loglikelihood), perplexity
(loglikelihood_rolling) and generation (generate_until), through `local-completions`, and
generation through `local-chat-completions`. The tasks and their data are local
(lm_eval_tasks/); nothing comes from a hub. The README shows the same runs as commands."""

import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("aiohttp")  # lm-eval[api], which local-completions needs

from tests.helpers import serve_cli  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
SCORED = ["br_mc", "br_ppl", "br_gen"]
TIE = 1e-4  # loglikelihoods this close are a tie in the choice of answer


@pytest.fixture(scope="module")
def offline(monkeypatch_module):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch_module.setenv(name, "1")
    monkeypatch_module.chdir(TASKS)  # the task files name their data relative to here


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def model_dir():
    from batchrun.models.weights.resolve import resolve_model

    return str(resolve_model(None).path)  # the bundled GGUF, dequantised to a HF folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    with serve_cli("--data-dir", tmp_path_factory.mktemp("serve"),
                   env={"BATCHRUN_THREADS": "1", "BATCHRUN_API_KEY": None}) as running:
        yield running.url


def evaluate(model, model_args, tasks, **kwargs):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   task_manager=TaskManager(include_path=str(TASKS)),
                                   log_samples=True, device="cpu", **kwargs)


def samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def hf_results(offline, model_dir):
    return evaluate("hf", f"pretrained={model_dir},dtype=float32", SCORED, batch_size=4)


@pytest.fixture(scope="module")
def batchrun_results(offline, server, model_dir):
    args = (f"base_url={server}/v1/completions,model=smollm2-135m,tokenizer={model_dir},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    return evaluate("local-completions", args, SCORED, batch_size=4)


def test_multiple_choice_picks_the_same_answers(hf_results, batchrun_results):
    ours, ref = samples(batchrun_results, "br_mc"), samples(hf_results, "br_mc")
    assert len(ours) == len(ref) == 6
    for a, b in zip(ours, ref):
        la = [float(ll) for ll, _ in a["filtered_resps"]]
        lb = [float(ll) for ll, _ in b["filtered_resps"]]
        best = sorted(lb, reverse=True)
        if best[0] - best[1] > TIE:
            assert la.index(max(la)) == lb.index(max(lb)), f"document {a['doc_id']}"
        assert all(abs(x - y) < 1e-3 for x, y in zip(la, lb))
        assert [g for _, g in a["filtered_resps"]] == [g for _, g in b["filtered_resps"]]
    assert batchrun_results["results"]["br_mc"]["acc,none"] == \
        hf_results["results"]["br_mc"]["acc,none"]


def test_perplexity_within_a_tenth_of_a_percent(hf_results, batchrun_results):
    for a, b in zip(samples(batchrun_results, "br_ppl"), samples(hf_results, "br_ppl")):
        assert math.isclose(float(a["filtered_resps"][0]), float(b["filtered_resps"][0]),
                            rel_tol=1e-3)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(batchrun_results["results"]["br_ppl"][metric],
                            hf_results["results"]["br_ppl"][metric], rel_tol=1e-3), metric


def test_generation_gives_the_same_text(hf_results, batchrun_results):
    ours, ref = samples(batchrun_results, "br_gen"), samples(hf_results, "br_gen")
    assert [s["resps"] for s in ours] == [s["resps"] for s in ref]
    assert batchrun_results["results"]["br_gen"]["exact_match,last_word"] == \
        hf_results["results"]["br_gen"]["exact_match,last_word"] > 0


def test_chat_generation_gives_the_same_text(offline, server, model_dir):
    ours = evaluate("local-chat-completions",
                    f"base_url={server}/v1/chat/completions,model=smollm2-135m,max_retries=1",
                    ["br_gen"], apply_chat_template=True)
    ref = evaluate("hf", f"pretrained={model_dir},dtype=float32", ["br_gen"],
                   apply_chat_template=True, batch_size=4)
    assert [s["resps"] for s in samples(ours, "br_gen")] == \
        [s["resps"] for s in samples(ref, "br_gen")]


def test_a_sweeps_loglikelihood_choice_picks_what_lm_evals_hf_backend_picks(hf_results,
                                                                             tmp_path):
    """The same documents and prompt as br_mc, through `batchrun sweep` (loglikelihood_choice,
    no server): per document the same pick as lm-eval's `hf` backend, and the same accuracy."""
    import polars as pl

    from batchrun.sweep.run import run_sweep
    from batchrun.sweep.spec import load
    from batchrun.commandkit import load_model

    spec = tmp_path / "mc.toml"
    spec.write_text(f'''name = "br_mc"
output = "out"
[dataset]
path = "{TASKS / 'mc.jsonl'}"
prompt = "Question: {{{{question}}}}\\nAnswer:"
reference = "answer"
[[scorers]]
type = "loglikelihood_choice"
choices_column = "choices"
''')
    parsed, text = load(str(spec))
    result = run_sweep(parsed, text, load_model)
    rows = pl.read_parquet(tmp_path / "out" / "results.parquet").sort(
        pl.col("id").cast(pl.Int64))
    ref = samples(hf_results, "br_mc")
    assert rows.height == len(ref) == 6
    for row, sample in zip(rows.iter_rows(named=True), ref):
        lls = [float(ll) for ll, _ in sample["filtered_resps"]]
        best = sorted(lls, reverse=True)
        if best[0] - best[1] > TIE:
            picked = sample["doc"]["choices"][lls.index(max(lls))]
            assert row["output"].strip() == picked.strip(), f"document {sample['doc_id']}"
    assert result.summary[0]["loglikelihood_choice:mean"] == pytest.approx(
        hf_results["results"]["br_mc"]["acc,none"])
