"""The gated delta rule (engine/kernels/gated_delta.py) by every path: the C kernel on each of
simd.h's vector paths, the chunked PyTorch form, and the Triton kernels (under the interpreter
here: benchmarks/kernel_checks/gated_delta.py), against the plain float64 recurrence and against
transformers' own torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule on the same
inputs, one sequence at a time."""

import pytest
import torch

from batchrun.engine.kernels import gated_delta
from benchmarks.kernel_checks.gated_delta import CHECKS, TOL, make_problem, reference, run_check
from tests.helpers import kernel_library

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
def test_c_kernel_matches_the_recurrence(path):
    lib = kernel_library(path)
    if lib is None:
        pytest.skip("no C compiler here")
    err, tol = run_check(lambda q, k, v, g, b, s, slots, start, _: lib.gated_delta_rule(
        q, k, v, g, b, s, slots, start), torch.device("cpu"))
    assert err <= tol


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_torch_matches_the_recurrence(chunk):
    err, tol = run_check(lambda *a: gated_delta.chunked(*a, chunk=chunk), torch.device("cpu"))
    assert err <= tol


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_triton_kernels_match_the_recurrence(name):
    err, tol = CHECKS[name](DEVICE)
    assert err <= tol, f"{name}: max |err| {err} > {tol}"


@pytest.mark.parametrize("fn", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_transformers_functions_agree_on_the_same_inputs(fn):
    """transformers' functions take raw q and k (use_qk_l2norm_in_kernel) and one sequence
    with its initial state; our kernels take them normalised and packed."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    p = make_problem(counts=(70, 3), seed=3)
    raw_q = p.q * 2.5 * p.q.shape[-1] ** 0.5  # any length: the function normalises it again
    raw_k = p.k * 0.7
    expected_out, expected_state = reference(p)
    for i, slot in enumerate(p.slots.tolist()):
        rows = slice(int(p.query_start[i]), int(p.query_start[i + 1]))
        out, final = getattr(hf, fn)(
            raw_q[None, rows], raw_k[None, rows], p.v[None, rows], p.g[None, rows],
            p.beta[None, rows], initial_state=p.state[slot][None].clone(),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert float((out[0].double() - expected_out[rows]).abs().max()) <= TOL
        assert float((final[0].double() - expected_state[slot]).abs().max()) <= TOL


def test_dispatch_takes_the_kernel_or_pytorch():
    lib = kernel_library()
    p = make_problem(seed=4)
    expected, _ = reference(p)
    for kernels in (lib, None):
        state = p.state.clone()
        out = gated_delta.gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, state, p.slots,
                                           p.query_start, p.max_count, kernels)
        assert float((out.double() - expected).abs().max()) <= TOL
