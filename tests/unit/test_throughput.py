"""The throughput model: calibration on a tiny model, the estimate's monotonicity, the run store."""

import dataclasses
import json
import math
import time

import pytest
from transformers import AutoConfig

from batchrun.batch.estimate import run_store

from batchrun.batch.estimate import throughput
from batchrun.batch.estimate.run_store import load_runs, save_run
from batchrun.batch.estimate.calibrate import _bench_model, _NoTokenizer, _StepRecorder, calibrate
from batchrun.batch.estimate.throughput import (Calibration, WorkloadShape, calibration_from_run,
                                       estimate_seconds, estimate_steps)
from batchrun.options.engine import EngineConfig
from batchrun.models.arch.llama import ModelConfig
from tests.tiny_models import make_tiny

CAL = Calibration("test", step_s=0.02, token_s=1e-4, context_s=1e-7, pair_s=1e-9,
                  sample_s=5e-4, request_s=1e-3)


def shape(requests=100, prompt=300, completion=128, cached=0):
    s = WorkloadShape()
    for _ in range(requests):
        s.add(prompt, completion, cached)
    return s


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny("llama", folder, num_hidden_layers=4)
    return ModelConfig.from_hf(AutoConfig.from_pretrained(folder))


def test_micro_benchmark_gives_positive_finite_coefficients(tiny_config):
    start = time.perf_counter()
    cal = calibrate(tiny_config, EngineConfig.default(device="cpu"), seconds=1.0)
    took = time.perf_counter() - start
    assert took < 60  # generous: shared machines
    coefs = [cal.step_s, cal.token_s, cal.context_s, cal.pair_s, cal.sample_s, cal.request_s]
    assert all(math.isfinite(c) and c >= 0 for c in coefs)
    assert cal.step_s > 0 and (cal.token_s > 0 or cal.sample_s > 0)
    assert cal.details["layers_timed"] == 2 and cal.details["depth"] == 4
    assert cal.details["per_layer"][0] > 0  # the decoder layers' time was measured
    assert cal.source.startswith("micro-benchmark")
    assert estimate_seconds(shape(), cal, EngineConfig.default()) > 0


def test_step_recorder_times_the_layers_on_the_cpu_kernels_path(tiny_config):
    """On the CPU kernels' float32 path the recorder times each layer's forward, or every step's
    layer time reads 0."""
    import torch

    from batchrun.engine.engine import Engine
    from batchrun.engine.sampling_params import SamplingParams

    model, _ = _bench_model(tiny_config, 2, torch.device("cpu"), torch.float32)
    if model.cpu_kernels is None:
        pytest.skip("no CPU kernels here: the model runs the plain forward")
    config = EngineConfig.default(device="cpu")
    engine = Engine(model, _NoTokenizer(), config, [], torch.device("cpu"), torch.float32, 64, 256)
    recorder = _StepRecorder(engine)
    engine.generate([[5, 6, 7, 8] * 4, [9, 10, 11]],
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(recorder.rows) >= 3  # a prefill step, then decodes
    for *_, layer_s, step_s in recorder.rows:
        assert 0 < layer_s <= step_s


def test_the_int8_bench_model_has_a_calibrated_loads_layers(tiny_config):
    """The cost model times int8 on what an int8 load runs: smoothed projections with float
    outlier channels and the int8 logits layer (not plain W8A8 and a bfloat16 logits GEMM)."""
    import torch

    from batchrun.engine.engine import Engine
    from batchrun.engine.sampling_params import SamplingParams
    from batchrun.models.quant.int8_linear import Int8Linear

    model, _ = _bench_model(tiny_config, 2, torch.device("cpu"), torch.float32, "int8")
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.outliers is not None
    assert all(layer.self_attn.qkv_proj.outliers is not None for layer in model.layers)
    engine = Engine(model, _NoTokenizer(), EngineConfig.default(device="cpu"), [],
                    torch.device("cpu"), torch.float32, 64, 256)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_calibration_respects_small_max_num_seqs(tiny_config):
    cal = calibrate(tiny_config, EngineConfig.default(device="cpu", max_num_seqs=4,
                                                      max_num_batched_tokens=64), seconds=0.5)
    assert cal.step_s > 0


def test_shape_sums():
    s = WorkloadShape()
    s.add(10, 4, 4)
    assert (s.requests, s.prompt_tokens, s.cached_tokens, s.completion_tokens) == (1, 10, 4, 4)
    assert s.decode_rows == 3
    assert s.decode_context_tokens == 11 + 12 + 13
    assert s.prefill_pairs == sum(range(5, 11))
    t = WorkloadShape.from_totals(1, 10, 4, 4)
    assert (t.decode_context_tokens, t.prefill_pairs) == (s.decode_context_tokens, s.prefill_pairs)


def test_estimate_is_monotonic_in_completion_and_prompt_tokens():
    config = EngineConfig.default()
    times = [estimate_seconds(shape(completion=g), CAL, config) for g in (1, 16, 64, 128, 512)]
    assert times == sorted(times) and times[0] < times[-1]
    times = [estimate_seconds(shape(prompt=p), CAL, config) for p in (10, 100, 1000, 4000)]
    assert times == sorted(times) and times[0] < times[-1]
    times = [estimate_seconds(shape(requests=n), CAL, config) for n in (1, 10, 300, 3000)]
    assert times == sorted(times)


def test_cache_hits_make_it_faster():
    config = EngineConfig.default()
    times = [estimate_seconds(shape(cached=c), CAL, config) for c in (0, 64, 160, 288)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_steps_follow_the_scheduler():
    config = EngineConfig.default(max_num_seqs=8, max_num_batched_tokens=64)
    # One request: ceil(100 / 64) prefill steps, then 9 decode steps.
    assert estimate_steps(shape(1, 100, 10), config) == 2 + 9
    # Far more requests than seats: about completion / seats steps per request.
    many = estimate_steps(shape(800, 4, 33), config)
    assert 800 * 32 / 8 <= many <= 800 * 32 / 8 * 1.2
    # Prefill-bound: every step full.
    bound = estimate_steps(shape(100, 640, 1), EngineConfig.default(max_num_batched_tokens=64))
    assert bound == pytest.approx(100 * 640 / 64, rel=0.02)
    # The extrapolation from a few waves agrees with simulating everything.
    s = shape(200, 40, 20)
    width = throughput.concurrency(s, config)
    full = throughput._simulate(200, width, 40, 19, 64)[-1]
    assert estimate_steps(s, config) == pytest.approx(full, rel=0.03)


def test_kv_pool_limits_concurrency():
    s = shape(100, 100, 28)  # 8 blocks per request
    config = EngineConfig.default()
    assert throughput.concurrency(s, config, num_blocks=80) == 10
    assert estimate_steps(s, config, num_blocks=80) > estimate_steps(s, config)


def summary(wall=40.0, steps=500):
    return {"requests": {"total": 100, "ok": 100, "failed": 0}, "prompt_tokens": 30000,
            "completion_tokens": 12800, "cached_tokens": 6000, "wall_time_s": wall,
            "input": "/data/chat.jsonl", "engine": {"steps": steps}}


def test_calibration_from_run_round_trips_a_summary(tiny_config):
    config = EngineConfig.default()
    cal = calibration_from_run(summary(), config, tiny_config)
    assert cal is not None and "chat.jsonl" in cal.source and "100 requests" in cal.source
    again = WorkloadShape.from_totals(100, 30000, 12800, 6000)
    assert estimate_seconds(again, cal, config, steps=500) == pytest.approx(40.0)
    assert estimate_seconds(again, cal, config) == pytest.approx(40.0, rel=0.5)
    slower = calibration_from_run(summary(wall=80.0), config, tiny_config)
    assert slower.token_s == pytest.approx(2 * cal.token_s)
    based = calibration_from_run(summary(), config, tiny_config, base=CAL)
    assert based.step_s / based.token_s == pytest.approx(CAL.step_s / CAL.token_s)
    assert calibration_from_run({"wall_time_s": 0}, config, tiny_config) is None
    assert calibration_from_run({**summary(), "requests": {"ok": 0}}, config, tiny_config) is None


def test_store_keys_by_model_and_machine(tmp_path, monkeypatch, tiny_config):
    monkeypatch.setenv("BATCHRUN_RUNS_DIR", str(tmp_path / "runs"))
    assert load_runs("smollm2-135m") == []
    path = save_run(summary(), "smollm2-135m")
    assert path.parent == tmp_path / "runs"
    [record] = load_runs("smollm2-135m")
    assert record["summary"]["wall_time_s"] == 40.0 and record["model"] == "smollm2-135m"
    cal = calibration_from_run(record, EngineConfig.default(), tiny_config)
    assert cal.source.startswith("last run 20")
    assert load_runs("other/model") == []
    save_run(summary(wall=50.0), "smollm2-135m")
    assert [r["summary"]["wall_time_s"] for r in load_runs("smollm2-135m")] == [50.0, 40.0]
    real = run_store.machine_info()
    monkeypatch.setattr(run_store, "machine_info", lambda: {**real, "cpu": "another CPU"})
    assert load_runs("smollm2-135m") == []  # another machine's run does not calibrate
    monkeypatch.setattr(run_store, "machine_info", lambda: {**real, "threads": real["threads"] + 1})
    assert load_runs("smollm2-135m") == []


def test_the_store_keeps_recent_runs_and_reads_a_single_run_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_RUNS_DIR", str(tmp_path))
    for wall in range(1, run_store.KEEP + 3):
        save_run(summary(wall=float(wall)), "m")
    walls = [r["summary"]["wall_time_s"] for r in load_runs("m")]
    assert walls == [float(w) for w in range(run_store.KEEP + 2, 2, -1)]
    # The file an earlier version wrote: one record, no list.
    path = save_run(summary(), "old")
    stored = json.loads(path.read_text())["runs"][0]
    path.write_text(json.dumps(stored))
    assert [r["summary"]["wall_time_s"] for r in load_runs("old")] == [40.0]


# sample_data/chat.jsonl's kind of run: 30 lines sent at once, max_tokens 128 each, answers
# that stop anywhere from 6 tokens to the cap, the short ones first.
COMPLETIONS = [6, 9, 12, 15, 18, 22, 26, 30, 35, 40, 45, 50, 60, 70, 80, 90, 100, 110, 120, 128,
               8, 14, 20, 28, 38, 48, 58, 75, 95, 128]
PROMPTS = [30 + 3 * i for i in range(len(COMPLETIONS))]


def _recorded_run(config):
    """The run's metrics summary, its wall time from CAL on its exact requests and the steps a
    batch of these requests takes: its prefill, then decode until its longest answer ends."""
    exact = WorkloadShape()
    for p, g in zip(PROMPTS, COMPLETIONS):
        exact.add(p, g)
    budget = config.scheduler.max_num_batched_tokens
    steps = math.ceil(sum(PROMPTS) / budget) + max(COMPLETIONS) - 1
    wall = estimate_seconds(exact, CAL, config, steps=steps)
    return {"status": "completed", "requests": {"total": 30, "ok": 30, "failed": 0},
            "prompt_tokens": sum(PROMPTS), "completion_tokens": sum(COMPLETIONS),
            "requested_completion_tokens": 128 * 30, "cached_tokens": 0, "wall_time_s": wall,
            "input": "chat.jsonl", "engine": {"steps": steps}}


def test_planning_the_file_a_run_calibrated_on_gives_that_runs_time(tiny_config):
    config = EngineConfig.default()
    run = _recorded_run(config)
    cal = calibration_from_run(run, config, tiny_config)
    # What `batchrun plan` then does with the same file (job_estimate.scan): every line's
    # requested tokens, scaled by the share the last run generated.
    share = run["completion_tokens"] / run["requested_completion_tokens"]
    planned = WorkloadShape()
    for p in PROMPTS:
        planned.add(p, max(1, round(128 * share)))
    estimate = estimate_seconds(planned, cal, config)
    assert estimate == pytest.approx(run["wall_time_s"], rel=0.10)
    # Before steps_factor: the simulation of 30 identical mean-length requests ends after the
    # mean answer, the run after its longest: 39 s planned for a 55.9 s run.
    without = dataclasses.replace(cal, steps_factor=1.0)
    assert estimate_seconds(planned, without, config) < 0.85 * run["wall_time_s"]
    assert cal.steps_factor > 1.5
