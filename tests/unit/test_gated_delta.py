"""The linear-attention rules against references: gated_delta.py's delta rule against
transformers' own (torch_recurrent_gated_delta_rule; the chunked WY form over several chunks
from a non-zero state, the recurrence, padding positions with g = 0 and beta = 0 leaving the
state as it was), Kimi's per-channel decay against transformers' recurrent_kimi_delta_attention,
and lightning.py's chunked decayed linear attention against its per-position recurrence."""

import pytest
import torch

from batchrun.models.transformers import gated_delta


def inputs(S=3, L=37, Hk=2, Hv=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(S, L, Hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(S, L, Hv, dv, generator=gen)
    beta = torch.rand(S, L, Hv, generator=gen) * 2  # up to 2: OLMo-Hybrid's negative eigenvalues
    g = -torch.rand(S, L, Hv, generator=gen) * 0.5
    state = torch.randn(S, Hv, dk, dv, generator=gen) * 0.1
    return q, k, v, beta, g, state


class Mixer:  # what heads_first reads of a mixer
    num_k_heads, num_v_heads, head_k_dim = 2, 4, 16


def reference(q, k, v, beta, g, state):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    return torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state.clone(),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("rule", ["chunked", "recurrent"])
def test_delta_rule_matches_transformers_from_a_state(rule):
    q, k, v, beta, g, state = inputs()
    ref_out, ref_state = reference(q, k, v, beta, g, state)
    args = gated_delta.heads_first(Mixer, q, k, v, beta, g)
    if rule == "chunked":  # chunks of 8: five of them, the last padded
        out, final = gated_delta.chunked(*args, state, size=8)
    else:
        out, final = gated_delta.recurrent(*args, state)
    torch.testing.assert_close(out.transpose(1, 2), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=2e-5, rtol=1e-4)


def test_padding_positions_leave_the_state():
    """Sequence 0 has 37 rows, sequence 1 only 20 (then padding): its final state is the one
    after its 20th row."""
    q, k, v, beta, g, state = inputs(S=2)
    pad = torch.arange(37)[None, :] >= torch.tensor([37, 20])[:, None]
    beta, g = beta.masked_fill(pad[..., None], 0), g.masked_fill(pad[..., None], 0)
    args = gated_delta.heads_first(Mixer, q, k, v, beta, g)
    _, final = gated_delta.chunked(*args, state, size=8)
    _, short = reference(q[1:, :20], k[1:, :20], v[1:, :20], beta[1:, :20], g[1:, :20],
                         state[1:])
    torch.testing.assert_close(final[1:], short, atol=2e-5, rtol=1e-4)


def test_per_channel_decay_matches_kimi_delta_attention():
    """Kimi's decay per key channel (g [S, L, H, dk]) through the same recurrence, against
    transformers' recurrent_kimi_delta_attention from a non-zero state."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        recurrent_kimi_delta_attention)

    from batchrun.models.transformers.kimi_delta import l2norm

    S, L, H, d = 2, 9, 3, 8
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(S, L, H, d, generator=gen) for _ in range(3))
    g = -torch.rand(S, L, H, d, generator=gen)
    beta = torch.rand(S, L, H, generator=gen)
    state = torch.randn(S, H, d, d, generator=gen) * 0.1
    ref_out, ref_state = recurrent_kimi_delta_attention(
        q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    heads = [t.transpose(1, 2) for t in (q, k, v, beta, g)]
    out, final = gated_delta.recurrent(l2norm(heads[0]) * d ** -0.5, l2norm(heads[1]),
                                       *heads[2:], state)
    torch.testing.assert_close(out.transpose(1, 2), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=2e-5, rtol=1e-4)


def test_lightning_attention_chunks_match_its_recurrence():
    """MiniMax's decayed linear attention (models/transformers/lightning.py) in chunks of 8 from
    a non-zero state, against KV <- exp(g) KV + k^T v, o = q KV one position at a time."""
    from batchrun.models.transformers.lightning import decayed

    S, H, L, d = 2, 3, 21, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, H, L, d, generator=gen) for _ in range(3))
    g = -torch.rand(S, H, 1, generator=gen).expand(S, H, L)
    state = torch.randn(S, H, d, d, generator=gen)
    out, final = decayed(q, k, v, g, state, size=8)
    kv, ref = state, []
    for t in range(L):
        kv = g[:, :, t, None, None].exp() * kv + k[:, :, t, :, None] * v[:, :, t, None, :]
        ref.append(q[:, :, t, None, :] @ kv)
    torch.testing.assert_close(out, torch.cat(ref, dim=2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, kv, atol=1e-4, rtol=1e-4)
