"""`batchrun plan`: what a run would do, checked against what the run does.

The time estimate's calibration is seeded from a recorded run (tests/conftest.py points
BATCHRUN_RUNS_DIR at a temporary folder), so these tests do not spend seconds benchmarking."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchrun.batch.shell.commands import plan, validate
from batchrun.batch.estimate.job_estimate import run_key
from batchrun.batch.estimate.run_store import save_run
from batchrun.batch.job.lease import OutputLease
from batchrun.batch.job.staging import Record, Staging
from batchrun.batch.storage.lines import position
from batchrun.options.engine import EngineConfig
from tests.openai_batch_shape import error_of

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_data"


@pytest.fixture(scope="module", autouse=True)
def recorded_run():
    """A last run of the bundled model on this machine (plan calibrates from it)."""
    save_run({"status": "completed", "requests": {"total": 30, "ok": 30, "failed": 0},
              "prompt_tokens": 1401, "completion_tokens": 1000, "cached_tokens": 224,
              "requested_completion_tokens": 1304, "wall_time_s": 30.0,
              "engine": {"steps": 120}}, run_key("smollm2-135m", EngineConfig()))


def run_plan(*args):
    result = CliRunner().invoke(plan, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_counts_and_tokens_match_what_the_run_reported(tmp_path):
    """sample_data/chat.jsonl's run on the bundled model (greedy, prefix cache on) reported
    1,401 prompt tokens and 224 served by the prefix cache: the plan says the same, and that
    30 lines request 1,304 completion tokens."""
    got = run_plan(SAMPLES / "chat.jsonl")
    assert (got["lines"], got["valid"], got["invalid"], got["requests"]) == (30, 30, 0, 30)
    assert got["prompt_tokens"] == 1401 and got["cached_tokens"] == 224
    assert got["requested_completion_tokens"] == 1304
    # The last run generated 1000 of its 1304 requested tokens: each request is scaled so.
    assert abs(got["expected_completion_tokens"] - 1000) <= 30
    assert "last run" in got["calibration"] and got["estimated_seconds"] > 0
    assert got["weights_bytes"] > 500 << 20 and got["kv_blocks"] > 0 and got["kv_bytes"] > 0


def test_a_small_last_run_does_not_calibrate_and_the_range_is_stated(tmp_path, monkeypatch):
    """A one-request run after the sample's 30-request run: the plan still calibrates on the
    30-request run (its file is planned at that run's time) and states the likely range."""
    from batchrun.batch.estimate import calibrate, throughput

    monkeypatch.setenv("BATCHRUN_RUNS_DIR", str(tmp_path))
    key = run_key("smollm2-135m", EngineConfig())
    save_run({"status": "completed", "requests": {"total": 30, "ok": 30, "failed": 0},
              "prompt_tokens": 1401, "completion_tokens": 1019, "cached_tokens": 224,
              "requested_completion_tokens": 1304, "wall_time_s": 40.1, "input": "chat.jsonl",
              "engine": {"steps": 129}}, key)
    save_run({"status": "completed", "requests": {"total": 1, "ok": 1, "failed": 0},
              "prompt_tokens": 37, "completion_tokens": 8, "cached_tokens": 0,
              "requested_completion_tokens": 32, "wall_time_s": 6.3, "input": "one.jsonl",
              "engine": {"steps": 8}}, key)
    got = run_plan(SAMPLES / "chat.jsonl")
    assert "chat.jsonl (30 requests, 40.1 s)" in got["calibration"]
    assert got["estimated_seconds"] == pytest.approx(40.1, rel=0.05)
    assert got["estimated_seconds_low"] < got["estimated_seconds"] < got["estimated_seconds_high"]
    assert got["confidence"] == "medium"
    text = CliRunner().invoke(plan, [str(SAMPLES / "chat.jsonl")]).stdout
    assert "likely" in text and "confidence  medium: 1 run of at least 16 requests" in text

    # Only the small run left: the micro-benchmark (stubbed here: seconds of benchmarking) with
    # a low confidence saying why.
    monkeypatch.setenv("BATCHRUN_RUNS_DIR", str(tmp_path / "small"))
    save_run({"status": "completed", "requests": {"total": 1, "ok": 1, "failed": 0},
              "prompt_tokens": 37, "completion_tokens": 8, "wall_time_s": 6.3,
              "engine": {"steps": 8}}, key)
    monkeypatch.setattr(calibrate, "calibrate", lambda cfg, engine: throughput.prior(cfg))
    got = run_plan(SAMPLES / "chat.jsonl")
    assert got["confidence"] == "low" and "(1 request, 8 engine steps) is too small" in \
        got["confidence_basis"]
    assert got["estimated_seconds_high"] / got["estimated_seconds_low"] > 10


def test_invalid_lines_are_counted_as_validate_counts_them():
    got = run_plan(SAMPLES / "malformed.jsonl")
    result = CliRunner().invoke(validate, [str(SAMPLES / "malformed.jsonl"), "--check-prompts",
                                           "--json"])
    problems = [json.loads(x) for x in result.stdout.splitlines()]
    assert got["invalid"] == len(problems) > 0 and got["valid"] == got["lines"] - len(problems)
    codes = {}
    for p in problems:
        codes[error_of(p)["code"]] = codes.get(error_of(p)["code"], 0) + 1
    assert got["invalid_by_code"] == codes


def test_parquet_input_and_no_cache_hits_without_a_prefix_cache():
    got = run_plan(SAMPLES / "prompts.parquet", "--column", "custom_id=id", "--column",
                   "prompt=question")
    assert got["lines"] == got["valid"] > 0 and got["prompt_tokens"] > 0
    off = run_plan(SAMPLES / "chat.jsonl", "--no-prefix-cache")
    assert off["cached_tokens"] == 0 and off["prompt_tokens"] == 1401


def test_the_resume_decision_follows_the_output(tmp_path):
    src = tmp_path / "in.jsonl"
    shutil.copy(SAMPLES / "chat.jsonl", src)
    out = tmp_path / "out.jsonl"
    assert run_plan(src)["start"] == "unknown"
    assert run_plan(src, "-o", out)["start"] == "fresh"
    staging = Staging(str(tmp_path / "out.jsonl.batchrun-staging"))
    staging.create({"inputs": [[str(src), None, None]]})
    staging.commit([Record(position(0, line), 1, "{}") for line in (1, 2, 5)])
    # A run would refuse (exit 2) until told: the plan says what each choice would do.
    result = CliRunner().invoke(plan, [str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "holds 3 committed lines of an interrupted run; with --resume a run would keep " \
        "them" in result.stdout and "with --restart it would discard them" in result.stdout
    got = run_plan(src, "-o", out, "--resume")
    assert got["start"] == "resume" and got["committed"] == 3
    assert run_plan(src, "-o", out, "--restart")["start"] == "fresh"
    holder = OutputLease(str(out)).acquire()  # another run is writing it
    try:
        got = run_plan(src, "-o", out, "--resume")
    finally:
        holder.release()
    assert got["start"] == "busy" and "another batchrun run is writing" in got["busy"]


def test_text_report_names_every_figure():
    result = CliRunner().invoke(plan, [str(SAMPLES / "chat.jsonl")])
    assert result.exit_code == 0, result.output
    for words in ("30: 30 valid", "1,401 tokens", "expected hit rate 16.0%", "1,304 requested",
                  "weights", "KV cache", "estimated, likely", "(calibrated by last run"):
        assert words in result.stdout, result.stdout


@pytest.mark.parametrize("arch", ["qwen2_moe", "gemma2", "gpt_neox"])
def test_plan_sizes_every_model_path_as_the_engine_holds_it(arch, tmp_path, smol_tokenizer):
    """A native MoE, a windowed native model (gemma2: a window of 8 on one of its two layers)
    and one the native path lacks: plan's weights and KV figures equal what the loaded engine
    holds, its parameters transformers' count, and its calibration times the model's own kind."""
    from batchrun import llm
    from tests.helpers import held_bytes
    from tests.tiny_models import BACKEND_ARCHS, make_tiny

    folder = tmp_path / arch
    reference = make_tiny(arch, folder, archs=BACKEND_ARCHS, vocab_size=len(smol_tokenizer))
    smol_tokenizer.save_pretrained(folder)
    got = run_plan(SAMPLES / "chat.jsonl", "--model", folder, "--kv-cache-memory", "1MiB")
    engine = llm.load_from_path(folder, EngineConfig.default(
        device="cpu", kv_cache_memory=1 << 20)).engine
    assert got["weights_bytes"] == held_bytes(engine.runner.model)
    assert got["parameters"] == sum(p.numel() for p in reference.parameters())
    assert got["kv_blocks"] == engine.kv.num_blocks
    assert got["kv_bytes"] == sum(k.nbytes + v.nbytes for k, v in engine.runner.tensors)
    assert [g["window"] for g in got["kv_groups"]] == engine.kv.groups.windows
    k = engine.runner.tensors[0][0]  # one layer's K: [slots, KV heads, head dim]
    per_layer = 2 * k.nbytes // k.shape[0]
    assert all(g["bytes_per_token"] == per_layer * engine.kv.groups.layers_per_block
               for g in got["kv_groups"])
    native, moe = arch in ("qwen2_moe", "gemma2"), arch == "qwen2_moe"
    assert got["model_path"] == ("native" if native else "transformers")
    assert "micro-benchmark" in got["calibration"] and got["estimated_seconds"] > 0
    assert ("expert" in got["calibration"]) == moe
    assert ("transformers backend" in got["calibration"]) == (not native)
    if moe:
        assert got["experts"] == "4 experts, 2 per token"
        assert got["active_parameters"] < got["parameters"]
    else:
        assert got["active_parameters"] == got["parameters"]
    windowed = "a sliding-window (or chunked-attention) group"
    assert any(windowed in a for a in got["assumptions"]) == (arch == "gemma2")


def test_plan_on_a_refused_model_says_why(tmp_path, smol_tokenizer):
    from transformers import AutoConfig, MambaConfig, MambaForCausalLM

    AutoConfig.for_model("bailing_hybrid", vocab_size=len(smol_tokenizer), hidden_size=64,
                         num_hidden_layers=2, architectures=["BailingHybridForCausalLM"]
                         ).save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    result = CliRunner().invoke(plan, [str(SAMPLES / "chat.jsonl"), "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "bailing_hybrid keeps a recurrent" in result.output and "models check" in result.output
    # a Mamba runs on the engine's state slots: plan sizes it (from its config: the weights are
    # only looked for)
    MambaForCausalLM(MambaConfig(vocab_size=len(smol_tokenizer), hidden_size=64,
                                 num_hidden_layers=2)).save_pretrained(tmp_path / "mamba")
    smol_tokenizer.save_pretrained(tmp_path / "mamba")
    result = CliRunner().invoke(plan, [str(SAMPLES / "chat.jsonl"), "--model",
                                       str(tmp_path / "mamba")])
    assert result.exit_code == 0, result.output
    assert "0 from the prefix cache" in result.output  # off for a model with state
