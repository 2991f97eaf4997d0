"""What a decode step and a prefill achieve against the GPU's limits: the decode step's bytes
over its time as a fraction of HBM bandwidth, the prefill's FLOPs over its time as a fraction of
dense bf16 tensor-core peak. Bytes and FLOPs are counted from the config (and the weights the
engine holds), not read off hardware counters."""

from __future__ import annotations

import time

import torch

# Datasheet peaks: HBM bandwidth (TB/s) and dense (no sparsity) bf16 / fp8 tensor TFLOP/s.
PEAKS = {
    "H100 SXM": {"hbm_tb_s": 3.35, "bf16_tflop_s": 989.4, "fp8_tflop_s": 1978.9},
    "H100 PCIe": {"hbm_tb_s": 2.0, "bf16_tflop_s": 756.0, "fp8_tflop_s": 1513.0},
    "H200": {"hbm_tb_s": 4.8, "bf16_tflop_s": 989.4, "fp8_tflop_s": 1978.9},
}


def peaks_for(device_name: str) -> tuple[str | None, dict[str, float] | None]:
    """(row name, peaks) for a torch.cuda.get_device_name(); (None, None) when not in PEAKS."""
    name = device_name.upper()
    if "H200" in name:
        key = "H200"
    elif "H100" in name:
        key = "H100 PCIe" if "PCIE" in name else "H100 SXM"  # "H100 80GB HBM3" is the SXM part
    else:
        return None, None
    return key, PEAKS[key]


def _dims(cfg) -> dict[str, int]:
    heads = cfg.num_attention_heads
    return {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads}


def linear_params_per_token(cfg) -> int:
    """Weights each token multiplies through in the decoder layers: attention projections and
    the MLP, for an MoE its router and top-k experts (embedding and logits head apart)."""
    d = _dims(cfg)
    attn = d["hidden"] * (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"] \
        + d["heads"] * d["head_dim"] * d["hidden"]
    experts = getattr(cfg, "num_experts", None)
    if experts:
        mlp = d["hidden"] * experts + cfg.num_experts_per_tok * 3 * d["hidden"] * cfg.moe_intermediate_size
    else:
        mlp = 3 * d["hidden"] * cfg.intermediate_size
    return d["layers"] * (attn + mlp)


def prefill_flops(cfg, length: int) -> float:
    """One prompt of `length` tokens from an empty cache: the GEMMs, causal attention (QK^T and
    PV over i + 1 keys for token i), and the logits of its last token."""
    d = _dims(cfg)
    attention = 4 * d["layers"] * d["heads"] * d["head_dim"] * length * (length + 1) / 2
    return 2.0 * linear_params_per_token(cfg) * length + attention + 2.0 * cfg.vocab_size * d["hidden"]


def kv_bytes_per_token(cfg, element_bytes: int) -> int:
    d = _dims(cfg)
    return d["layers"] * 2 * d["kv_heads"] * d["head_dim"] * element_bytes


def held_weight_bytes(model) -> int:
    """Every distinct tensor the model holds (parameters and the tensors quantized layers keep):
    what a decode step streams."""
    from tests.helpers import held_bytes

    return held_bytes(model)


def decode_bytes(cfg, weight_bytes: int, embed_bytes: int, contexts: list[float],
                 kv_element_bytes: int) -> float:
    """A decode step's HBM reads: every weight (an untied embedding table only for its rows,
    counted as none; at 256 sequences x top-8 every expert is hit) and each sequence's KV."""
    weights = weight_bytes - (0 if cfg.tie_word_embeddings else embed_bytes)
    return float(weights + sum(contexts) * kv_bytes_per_token(cfg, kv_element_bytes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_decode(engine, cfg, device: torch.device, dtype: torch.dtype, sequences: int,
                   prompt_len: int, steps: int, peak: dict[str, float] | None, vocab: int) -> dict:
    """`sequences` requests of `prompt_len` random tokens prefilled, then `steps` decode steps
    with every sequence in the batch timed together (the scheduler's work included)."""
    from batchrun.engine import SamplingParams

    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(sequences):
        engine.add_request(f"d{i}", torch.randint(10, vocab, (prompt_len,), generator=gen).tolist(),
                           params)
    stats, full = engine.stats, 0
    while full < 2:  # all prefilled, and one whole decode step behind (its graph replayed)
        if not engine.has_unfinished_requests():
            raise RuntimeError("requests finished before every sequence was decoding")
        before = stats.computed_tokens, stats.prefill_tokens
        engine.step()
        whole = (stats.computed_tokens - before[0] == sequences
                 and stats.prefill_tokens == before[1])
        full = full + 1 if whole else 0
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    model = engine.runner.model
    weights = held_weight_bytes(model)
    element = torch.empty((), dtype=dtype).element_size()  # the embedding table's
    kv_element = engine.runner.tensors[0][0].element_size()
    embed = cfg.vocab_size * cfg.hidden_size * element
    context = prompt_len + 2 + (steps - 1) / 2  # each sequence's mean context over the timed steps
    moved = decode_bytes(cfg, weights, embed, [context] * sequences, kv_element)
    out = {"sequences": sequences, "context": prompt_len, "step_ms": seconds * 1e3,
           "gb_per_step": moved / 1e9, "achieved_tb_s": moved / seconds / 1e12,
           "weight_gb": weights / 1e9}
    if peak:
        out["fraction_of_hbm_peak"] = out["achieved_tb_s"] / peak["hbm_tb_s"]
    return out


def measure_prefill(engine, cfg, device: torch.device, prompts: int, length: int,
                    peak: dict[str, float] | None, vocab: int, peak_key: str = "bf16_tflop_s") -> dict:
    """`prompts` prompts of `length` random tokens, one output token each, timed whole (the
    engine's step budget sets the chunk; a warm-up prompt first)."""
    from batchrun.engine import SamplingParams

    gen = torch.Generator().manual_seed(6)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.generate([torch.randint(10, vocab, (length,), generator=gen).tolist()], params)
    batch = [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(prompts)]
    engine.kv.reset_prefix_cache()
    _sync(device)
    start = time.perf_counter()
    engine.generate(batch, params)
    _sync(device)
    seconds = time.perf_counter() - start
    flops = prompts * prefill_flops(cfg, length)
    out = {"prompts": prompts, "length": length, "seconds": seconds,
           "tokens_s": prompts * length / seconds, "achieved_tflop_s": flops / seconds / 1e12}
    if peak:
        out["fraction_of_peak"] = out["achieved_tflop_s"] / peak[peak_key]
        out["peak"] = peak_key
    return out
