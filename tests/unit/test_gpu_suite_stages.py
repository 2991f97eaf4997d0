"""The GPU suite's stage plumbing (benchmarks/gpu_stages.py, gpu_suite.py), checked on the CPU in
seconds: a stage past its time box is killed with every process it started, a broken or failing
stage is named in the report without hiding the stages after it, and the CUDA tests' outcomes are
read by test name. (`gpu_suite.py --dry-run` runs the real stages at tiny sizes, about 45 s.)"""

import json
import sys
import time

from benchmarks import gpu_stages, gpu_suite


def test_a_stage_past_its_box_is_killed_with_its_children():
    # the child holds the pipe open: only killing the whole session ends the wait in time
    script = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    start = time.monotonic()
    code, _, _ = gpu_stages.run_boxed([sys.executable, "-c", script], timeout=2)
    assert code is None and time.monotonic() - start < 15


def test_failed_and_broken_stages_are_named_and_the_rest_still_run(monkeypatch, tmp_path):
    ran = []

    def broken(report, options):
        ran.append("broken")
        raise RuntimeError("no device")

    def failing(report, options):
        ran.append("failing")
        report["failing"] = {"pass": False}
        return False

    def fine(report, options):
        ran.append("fine")
        report["fine"] = {"pass": True}
        return True

    monkeypatch.setattr(gpu_suite, "GPU_STAGES", [("broken", broken), ("failing", failing), ("fine", fine)])
    out = tmp_path / "gpu.json"
    assert gpu_suite.main(["--dry-run", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert ran == ["broken", "failing", "fine"]
    assert report["failed"] == ["broken", "failing"]
    assert report["broken"]["error"] == "RuntimeError: no device" and report["fine"]["pass"]


def test_cuda_tests_reads_each_outcome_by_name(monkeypatch):
    output = ("tests/unit/test_cuda_e2e.py::test_native_model PASSED [ 50%]\n"
              "tests/unit/test_cuda_e2e.py::test_moe FAILED [100%]\n")
    monkeypatch.setattr(gpu_stages, "run_boxed", lambda cmd, timeout, env=None: (1, output, 3.0))
    report: dict = {}
    options = gpu_stages.StageOptions(dry_run=False, deadline=time.monotonic() + 60)
    assert gpu_stages.cuda_tests(report, options) is False
    assert report["cuda_tests"]["tests"] == {"test_native_model": "passed", "test_moe": "failed"}
    assert "test_moe FAILED" in report["cuda_tests"]["output_tail"]
