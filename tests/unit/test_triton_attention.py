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


def suite_args(out) -> list[str]:
    """gpu_suite's arguments for this machine: the interpreter without a GPU."""
    return ([] if torch.cuda.is_available() else ["--interpret"]) + ["--json", str(out)]


def test_suite_writes_the_contract(tmp_path):
    out = tmp_path / "kernels.json"
    assert gpu_suite.main(suite_args(out) + ["--only", "decode,softcap"]) == 0
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
    assert gpu_suite.main(suite_args(out) + ["--only", "wrong,broken"]) == 1
    kernels = json.loads(out.read_text())["kernels"]
    assert kernels["wrong"] == {"pass": False, "max_err": 1.0, "tol": 1e-4,
                                "seconds": kernels["wrong"]["seconds"]}
    assert kernels["broken"]["pass"] is False and kernels["broken"]["max_err"] is None


def test_every_check_module_is_discovered():
    names = gpu_suite.discover_checks()
    assert set(CHECKS) <= set(names)


def test_shared_prefix_plan_groups_only_what_saves_reads():
    from batchrun.engine.kernels.triton_cascade import TILE_MEMBERS, plan_shared_prefixes

    cpu = torch.device("cpu")
    # nothing shared: the plain decode kernel runs
    assert plan_shared_prefixes([[0, 1], [2, 3], [4, 5]], [8, 8, 6], 4, cpu) is None
    # 10 sequences on one 2-block prefix (then their own blocks), one alone
    tables = [[7, 8, 10 + i] for i in range(10)] + [[30, 31, 32]]
    plan = plan_shared_prefixes(tables, [11] * 10 + [12], 4, cpu)
    assert plan is not None
    assert plan.order.tolist() == list(range(10))
    assert plan.tile_first.tolist() == [0, TILE_MEMBERS] and plan.tile_end.tolist() == [10, 10]
    assert plan.tile_shared.tolist() == [8, 8]
    assert plan.skip.tolist() == [8] * 10 + [0]
    # one shared block among 2 of 11 long contexts saves too little
    tables = [[7, 1, 2, 3], [7, 4, 5, 6]] + [[20 + 4 * i + j for j in range(4)] for i in range(9)]
    assert plan_shared_prefixes(tables, [16] * 11, 4, cpu) is None


@pytest.mark.parametrize("splits", [1, 3])
def test_padding_rows_of_a_captured_batch_write_zeros(splits):
    """A captured decode graph's padding rows have context length 0 (engine/cuda_graphs.py): the
    decode kernels write zeros there (with a sink too) and attend the real rows as usual."""
    from benchmarks.kernel_checks.attention_problems import make_problem
    from batchrun.engine.kernels.triton_decode import paged_decode_attention
    from batchrun.engine.kernels.triton_splitk import splitk_decode_attention

    p = make_problem(DEVICE, starts=[9, 4, 6], counts=[1] * 3, num_decode=3)
    expected = p.reference()
    lay = p.layout
    kc, vc = p.caches()
    kc[lay.slot_mapping], vc[lay.slot_mapping] = p.k, p.v
    lens = lay.context_lens.clone()
    lens[1] = 0
    for sinks in (None, torch.ones(4, device=DEVICE)):
        args = (p.q, kc, vc, lay.block_tables, lens, lay.block_size, p.scale)
        out = (paged_decode_attention(*args, sinks=sinks) if splits == 1
               else splitk_decode_attention(*args, splits, sinks=sinks))
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        if sinks is None:
            torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)
