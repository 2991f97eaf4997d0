"""The fused causal convolution + SiLU of the gated delta layers (engine/kernels/causal_conv.c)
on each of simd.h's vector paths, and the PyTorch form the model falls back to
(gated_delta_net.causal_conv), against a float64 convolution of each sequence's [slot's last
inputs, its rows] one sequence at a time: outputs and the slots' new last inputs."""

import pytest
import torch
import torch.nn.functional as F

from batchrun.engine.state_slots import StepState
from batchrun.models.layers.gated_delta_net import causal_conv
from tests.helpers import kernel_library

pytestmark = pytest.mark.usefixtures("one_torch_thread")
K = 4
# (rows, fresh) per sequence: a long prefill, decodes, a chunk shorter than K - 1 after a
# state and a fresh one shorter than K - 1 (its slot keeps zeros before its rows)
SEQS = [(37, True), (1, False), (2, False), (1, True), (2, True), (20, False)]
SLOTS = [4, 0, 6, 2, 1, 5]


def make_problem(channels: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(n for n, _ in SEQS), channels, generator=gen)
    weight = torch.randn(channels, K, generator=gen)
    state = torch.randn(8, K - 1, channels, generator=gen)
    step = StepState.of([], SLOTS, [0 if fresh else 5 for _, fresh in SEQS],
                        [n for n, _ in SEQS], torch.device("cpu"))
    return x, weight, state, step


def reference(x, weight, state, step):
    """(silu(conv) [T, C], the state after) in float64, one sequence at a time."""
    out, after = [], state.double().clone()
    for i, (slot, fresh) in enumerate(zip(step.slots.tolist(), step.fresh.tolist())):
        rows = x[int(step.query_start[i]):int(step.query_start[i + 1])].double()
        before = torch.zeros(K - 1, x.shape[1], dtype=torch.float64) if fresh else after[slot]
        joined = torch.cat([before, rows])  # [K - 1 + n, C]
        conv = F.conv1d(joined.T[None], weight.double()[:, None], groups=x.shape[1])[0].T
        out.append(F.silu(conv))
        after[slot] = joined[-(K - 1):]
    return torch.cat(out), after


@pytest.mark.parametrize("channels", [40, 300])  # a vector tail; more than one channel block
@pytest.mark.parametrize("path", ["native", "avx2", "portable"])
def test_c_kernel_matches_the_convolution(path, channels):
    lib = kernel_library(path)
    if lib is None:
        pytest.skip("no C compiler here")
    x, weight, state, step = make_problem(channels)
    want, want_state = reference(x, weight, state, step)
    got = lib.causal_conv_silu(x, weight, state, step.slots, step.query_start, step.fresh)
    assert float((got.double() - want).abs().max()) < 1e-5
    assert torch.equal(state.double(), want_state)  # copies of inputs: exact


def test_torch_form_matches_the_convolution():
    x, weight, state, step = make_problem(40, seed=1)
    want, want_state = reference(x, weight, state, step)
    got = F.silu(causal_conv(x, weight, state, step))
    assert float((got.double() - want).abs().max()) < 1e-5
    assert torch.equal(state.double(), want_state)
