"""Chunked local attention (Llama 4: a query at position p sees keys p - p % C <= j <= p only) in
every attention path the CPU runs — the reference attention, the C kernel directly, and each
backend's forward through paged_attention — against a float64 softmax under an explicit torch
mask built from that definition."""

import pytest
import torch

from batchrun.engine.attention import StepLayout, paged_attention
from batchrun.engine.attention.base import BackendEnv
from batchrun.engine.attention.cpu_kernel import CpuKernelBackend, kernel_attention
from batchrun.engine.attention.invariant import InvariantBackend
from batchrun.engine.attention.kv_write import read_rows
from batchrun.engine.attention.reference import reference_attention
from batchrun.engine.attention.sdpa import SdpaBackend
from batchrun.engine.attention import cascade
from tests.helpers import kernel_library

H, HKV, D, BS, CHUNK = 4, 2, 64, 4, 6  # a chunk that is not a whole number of blocks
SCALE = D ** -0.5
# Decodes of sequences sharing prefix blocks (cascade groups) at positions on both sides of
# chunk starts; a chunk over a cached context that crosses a chunk start; two fresh prompts of
# one length longer than a chunk (one batched SDPA call) and a fresh one within a chunk.
SHARED = 3  # leading blocks the first three decodes share
STARTS = [12, 17, 18, 5, 10, 0, 0, 0]
COUNTS = [1, 1, 1, 1, 9, 14, 14, 4]
NUM_DECODE = 4


def step_tables(gen):
    """Block tables for STARTS/COUNTS, the first three sharing SHARED physical blocks."""
    free = torch.randperm(200, generator=gen).tolist()
    shared = [free.pop() for _ in range(SHARED)]
    tables = []
    for i, (s, n) in enumerate(zip(STARTS, COUNTS)):
        blocks = -(-(s + n) // BS)
        head = shared if i < 3 else []
        tables.append(head + [free.pop() for _ in range(blocks - len(head))])
    return tables


def explicit(q, k_cache, v_cache, layout, chunk=CHUNK):
    """float64 attention of every row over its sequence's cache, masked by the definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for s, (start, n) in enumerate(zip(layout.starts, layout.counts)):
        ctx = start + n
        kpos = torch.arange(ctx)
        slots = layout.block_tables[s, kpos // BS] * BS + kpos % BS
        keys = read_rows(k_cache, slots, torch.float64).repeat_interleave(H // HKV, 1)
        values = read_rows(v_cache, slots, torch.float64).repeat_interleave(H // HKV, 1)
        for i in range(n):
            p = start + i
            seen = (kpos <= p) & (kpos >= p - p % chunk)
            scores = torch.einsum("hd,lhd->hl", q[row + i].double(), keys) * SCALE
            probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
            out[row + i] = torch.einsum("hl,lhd->hd", probs, values)
        row += n
    return out.float()


def step(seed=0):
    gen = torch.Generator().manual_seed(seed)
    layout = StepLayout.of(step_tables(gen), STARTS, COUNTS, NUM_DECODE, BS, torch.device("cpu"))
    k_cache, v_cache = (torch.randn(200 * BS, HKV, D, generator=gen) for _ in range(2))
    t = sum(COUNTS)
    q, k, v = (torch.randn(t, heads, D, generator=gen) for heads in (H, HKV, HKV))
    return layout, k_cache, v_cache, q, k, v


def test_reference_attention_sees_only_each_rows_chunk():
    layout, k_cache, v_cache, q, k, v = step()
    meta = SdpaBackend(torch.float32).build(layout)
    out = reference_attention(q, k, v, k_cache, v_cache, meta, SCALE, chunk=CHUNK)
    expected = explicit(q, k_cache, v_cache, layout)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    causal = explicit(q, k_cache, v_cache, layout, chunk=10 ** 6)
    assert not torch.allclose(out, causal, atol=1e-3)  # the chunks changed the output


@pytest.mark.skipif(kernel_library() is None, reason="no C compiler here")
def test_c_kernel_starts_each_rows_walk_at_its_chunk():
    lib = kernel_library()
    layout, k_cache, v_cache, q, k, v = step(1)
    k_cache[layout.slot_mapping], v_cache[layout.slot_mapping] = k, v
    rows, _ = cascade.plan_rows(lib, layout.block_tables, STARTS, COUNTS, NUM_DECODE, BS)
    assert rows is not None and int(rows.group_shared.max()) > 0, "no shared-prefix group"
    got = kernel_attention(lib, q, k_cache, v_cache, rows, BS, SCALE, chunk=CHUNK)
    in_kernel = torch.cat([torch.arange(a, b) for a, b in zip(rows.group_start[:-1].tolist(),
                                                              rows.group_start[1:].tolist())])
    in_kernel = rows.order[in_kernel].long()
    expected = explicit(q, k_cache, v_cache, layout)
    torch.testing.assert_close(got[in_kernel], expected[in_kernel], atol=2e-5, rtol=2e-5)


def backends():
    lib = kernel_library()
    env = dict(device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32,
               num_heads=H, num_kv_heads=HKV, head_dim=D, block_size=BS, lib=lib)
    out = [("sdpa", SdpaBackend(torch.float32))]
    if lib is not None:
        out += [(mode, CpuKernelBackend.create(BackendEnv(**env, kernel_mode=mode)))
                for mode in ("cascade", "legacy")]
        out.append(("invariant", InvariantBackend.create(BackendEnv(**env,
                                                                    kernel_mode="invariant"))))
    return out


@pytest.mark.parametrize("name,backend", backends(), ids=[n for n, _ in backends()])
def test_every_backend_attends_within_the_chunk(name, backend):
    layout, k_cache, v_cache, q, k, v = step(2)
    meta = backend.build(layout)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, chunk=CHUNK)
    torch.testing.assert_close(out, explicit(q, k_cache, v_cache, layout), atol=2e-5, rtol=2e-5)


def test_triton_steps_send_chunked_layers_to_the_reference(monkeypatch):
    """The Triton backend takes no chunk: paged_attention hands its chunked layers to the
    reference attention (its forward, which would attend causally, is never called)."""
    from batchrun.engine.attention import registry
    from batchrun.engine.attention.cuda_triton import TritonMetadata

    layout, k_cache, v_cache, q, k, v = step(3)
    meta = TritonMetadata(**layout.metadata_fields(), num_decode=NUM_DECODE)
    monkeypatch.setitem(registry._FORWARD, TritonMetadata, lambda *a, **kw: pytest.fail(
        "the Triton forward got a chunked layer"))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, chunk=CHUNK)
    torch.testing.assert_close(out, explicit(q, k_cache, v_cache, layout), atol=2e-5, rtol=2e-5)
