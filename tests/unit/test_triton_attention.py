"""The Triton attention kernels (engine/kernels/triton_*.py, through TritonBackend) against the
reference attention: on a CPU under Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a
GPU on CUDA. Each case is a kernel check of benchmarks/kernel_checks (the GPU suite's too)."""

import json

import pytest
import torch

from benchmarks import gpu_suite
from benchmarks.kernel_checks import attention, attention_fp8

CHECKS = {**attention.CHECKS, **attention_fp8.CHECKS}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_matches_reference(name):
    err, tol = CHECKS[name](DEVICE)
    assert err <= tol, f"{name}: max |err| {err} > {tol}"


def test_suite_writes_the_contract(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the interpreter run is the CPU's")
    out = tmp_path / "kernels.json"
    assert gpu_suite.main(["--interpret", "--json", str(out), "--only", "decode,softcap"]) == 0
    kernels = json.loads(out.read_text())["kernels"]
    assert set(kernels) == {"decode", "softcap"}
    for result in kernels.values():
        assert result["pass"] is True and isinstance(result["max_err"], float)
        assert result["max_err"] <= result["tol"]


def test_suite_fails_on_a_wrong_kernel(tmp_path, monkeypatch):
    """A check over its tolerance, or one that raises, fails the suite and says which."""
    def wrong(device):
        return 1.0, 1e-4

    def broken(device):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(gpu_suite, "discover_checks", lambda: {"wrong": wrong, "broken": broken})
    out = tmp_path / "kernels.json"
    assert gpu_suite.main(["--interpret", "--json", str(out)]) == 1
    kernels = json.loads(out.read_text())["kernels"]
    assert kernels["wrong"] == {"pass": False, "max_err": 1.0, "tol": 1e-4,
                                "seconds": kernels["wrong"]["seconds"]}
    assert kernels["broken"]["pass"] is False and kernels["broken"]["max_err"] is None


def test_every_check_module_is_discovered():
    names = gpu_suite.discover_checks()
    assert set(CHECKS) <= set(names)
