"""reference_attention (engine/attention/reference.py) against attention computed plainly in
float64 from the sequences' full K/V, with and without each extra (sliding window, softcap,
sinks, ALiBi), and against every backend that runs here on the same step's metadata (with each
backend's own sliding window and soft-capping)."""

import importlib.util
import math

import pytest
import torch

from batchrun.engine.attention import BackendEnv, StepLayout, paged_attention, reference_attention
from batchrun.engine.attention.cpu_kernel import CpuKernelBackend
from batchrun.engine.attention.cuda_triton import TritonBackend
from batchrun.engine.attention.invariant import InvariantBackend
from batchrun.engine.attention.sdpa import SdpaBackend
from tests.helpers import kernel_library

H, HKV, D, BS = 6, 2, 32, 4
# (context before the step, rows in the step): two decodes, a chunk over a cached context,
# fresh prompts of one length (a same-length run) and one of another.
SEQS = [(12, 1), (5, 1), (7, 6), (0, 5), (0, 5), (0, 3)]
NUM_DECODE = 2


# Decodes of a shared 3-block prefix (the cascade kernel's groups), then prefills as in SEQS.
SHARED_SEQS = [(12, 1), (13, 1), (14, 1), (20, 1), (7, 6), (0, 5), (0, 5), (0, 3)]


def problem(device="cpu", seed=0, seqs=SEQS, num_decode=NUM_DECODE, shared=0, d=D):
    """The step's tensors and layout; the first `shared` blocks of the first three sequences are
    the same physical blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BS) for c, n in seqs) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // BS))] for c, n in seqs]
    for table in tables[1:3 if shared else 1]:
        table[:shared] = tables[0][:shared]
    k_cache = torch.randn(num_blocks * BS, HKV, d, generator=g)
    v_cache = torch.randn(num_blocks * BS, HKV, d, generator=g)
    history = []  # each sequence's cached K/V, as the cache holds them
    for table, (c, _) in zip(tables, seqs):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(c)], dtype=torch.long)
        history.append((k_cache[slots], v_cache[slots]))
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, H, d, generator=g)
    k = torch.randn(rows, HKV, d, generator=g)
    v = torch.randn(rows, HKV, d, generator=g)
    layout = StepLayout.of(tables, [c for c, _ in seqs], [n for _, n in seqs], num_decode, BS,
                           torch.device(device))
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(k_cache), to(v_cache), history, layout


def plain(q, k, v, history, scale, window=None, softcap=None, sinks=None, until=None,
          alibi=None):
    """float64, one query row and head at a time; until[row]: keys after the row's position
    and before until[row] are seen too (an image's tokens, both ways); alibi [H]: the score of
    key j from the query at p gains alibi[h] * (j - p) (MPT's form of ALiBi)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for (c, n), (hk, hv) in zip(SEQS, history):
        keys = torch.cat([hk, k[row:row + n]]).double()
        values = torch.cat([hv, v[row:row + n]]).double()
        for t in range(n):
            p = c + t
            seen = [j for j in range(p + 1) if window is None or j > p - window]
            if until is not None:
                seen += list(range(p + 1, until[row + t]))
            for h in range(H):
                kv = h // (H // HKV)
                scores = [float(q[row + t, h].double() @ keys[j, kv]) * scale for j in seen]
                if softcap is not None:
                    scores = [softcap * math.tanh(s / softcap) for s in scores]
                if alibi is not None:
                    scores = [s + float(alibi[h]) * (j - p) for s, j in zip(scores, seen)]
                top = max(scores + ([float(sinks[h])] if sinks is not None else []))
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0)
                out[row + t, h] = sum(w / total * values[j, kv] for w, j in zip(weights, seen))
        row += n
    return out


EXTRAS = {"none": {}, "sliding_window": {"sliding_window": 3}, "softcap": {"softcap": 0.5},
          "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])},
          "all": {"sliding_window": 4, "softcap": 1.0, "sinks": torch.linspace(-1, 1, H)},
          "alibi": {"alibi": torch.tensor([1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125])},
          "alibi+window": {"alibi": torch.tensor([0.7, 0.3, 0.1, 0.05, 0.02, 0.01]),
                           "sliding_window": 4}}


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_reference_matches_plain_float64(extra):
    q, k, v, kc, vc, history, layout = problem()
    meta = SdpaBackend(torch.float32).build(layout)
    kw = EXTRAS[extra]
    got = reference_attention(q, k, v, kc, vc, meta, D ** -0.5, **kw)
    expected = plain(q, k, v, history, D ** -0.5, kw.get("sliding_window"), kw.get("softcap"),
                     kw.get("sinks"), alibi=kw.get("alibi"))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # the step's K/V went into the cache
    assert torch.equal(kc[layout.slot_mapping], k) and torch.equal(vc[layout.slot_mapping], v)


def backends():
    found = [("sdpa", SdpaBackend(torch.float32), "cpu")]
    lib = kernel_library()
    if lib is not None:
        found += [("cpu-kernel cascade", CpuKernelBackend(lib, cascade=True), "cpu"),
                  ("cpu-kernel legacy", CpuKernelBackend(lib, cascade=False), "cpu"),
                  ("cpu-invariant", InvariantBackend(lib), "cpu")]
    if torch.cuda.is_available():
        env = BackendEnv(torch.device("cuda"), torch.float32, torch.float32, H, HKV, D, BS)
        triton = TritonBackend.create(env)
        if triton is not None:
            found.append(("triton", triton, "cuda"))
    elif importlib.util.find_spec("triton") is not None:  # under the interpreter (conftest)
        found.append(("triton interpreted", TritonBackend(), "cpu"))
    return found


# (sliding window, soft-cap, sinks, ALiBi slopes) a layer passes to the backend; windows of 3 and
# 6 tokens end inside a block and cut both decodes and chunks, 2 keeps one position of the
# previous block; the ALiBi slopes are 2^-h (BLOOM's for 8 heads start at 2^-1).
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
ALIBI = torch.tensor([1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125])
MASKS = {"plain": (None, None, None, None), "window": (6, None, None, None),
         "softcap": (None, 0.5, None, None), "window+softcap": (3, 2.0, None, None),
         "window 2": (2, None, None, None), "sinks": (None, None, SINKS, None),
         "window+sinks": (6, None, SINKS, None), "alibi": (None, None, None, ALIBI),
         "window+alibi": (6, None, None, ALIBI)}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", ["d32", "d64 shared prefix"])
@pytest.mark.parametrize("name,backend,device", backends(), ids=[b[0] for b in backends()])
def test_every_backend_matches_the_reference(name, backend, device, shape, mask):
    """Head dim 64 takes the kernel's specialised loops, and with a shared prefix its grouped
    pass over the shared blocks (group_tile), which a windowed layer must not take."""
    d = 64 if shape.startswith("d64") else D
    kw = dict(seqs=SHARED_SEQS, num_decode=4, shared=3) if "shared" in shape else {}
    q, k, v, kc, vc, _, layout = problem(device, d=d, **kw)
    meta = backend.build(layout)
    window, softcap, sinks, alibi = MASKS[mask]
    sinks = None if sinks is None else sinks.to(device)
    alibi = None if alibi is None else alibi.to(device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    expected = reference_attention(q, k, v, kc_ref, vc_ref, meta, 0.3,
                                   sliding_window=window, softcap=softcap, sinks=sinks,
                                   alibi=alibi)
    got = paged_attention(q, k, v, kc, vc, meta, 0.3, window=window, softcap=softcap,
                          sinks=sinks, alibi=alibi)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("extra", ["none", "sliding_window", "window+softcap"])
@pytest.mark.parametrize("name,backend,device", [("reference", None, "cpu")] + backends(),
                         ids=["reference"] + [b[0] for b in backends()])
def test_rows_of_an_image_see_the_whole_image(extra, name, backend, device):
    """meta.visible_until: the rows of an image span (tokens [8, 11) of the chunk over a cached
    context, [1, 4) of a fresh prompt) see every key of their image; other rows stay causal.
    The window (3) is as long as the images, as the model's is at least an image long.
    reference_attention, and paged_attention on each backend (the CPU kernels read it; the
    others hand such steps to the reference)."""
    q, k, v, kc, vc, history, layout = problem(device)
    meta = (backend or SdpaBackend(torch.float32)).build(layout)
    until = [0] * q.shape[0]
    first_row = {i: sum(n for _, n in SEQS[:i]) for i in range(len(SEQS))}
    for seq, (a, b) in ((2, (8, 11)), (3, (1, 4))):
        c = SEQS[seq][0]
        for p in range(a, b):
            until[first_row[seq] + p - c] = b
    meta.visible_until = torch.tensor(until, device=device)
    window = 3 if extra != "none" else None
    softcap = 1.0 if "softcap" in extra else None
    if backend is None:
        got = reference_attention(q, k, v, kc, vc, meta, D ** -0.5, sliding_window=window,
                                  softcap=softcap)
    else:
        got = paged_attention(q, k, v, kc, vc, meta, D ** -0.5, window=window, softcap=softcap)
    expected = plain(q.cpu(), k.cpu(), v.cpu(), history, D ** -0.5, window, softcap, until=until)
    torch.testing.assert_close(got.cpu().double(), expected, atol=1e-5, rtol=1e-5)
    causal = plain(q.cpu(), k.cpu(), v.cpu(), history, D ** -0.5, window, softcap)
    assert not torch.allclose(got.cpu().double(), causal, atol=1e-3)
