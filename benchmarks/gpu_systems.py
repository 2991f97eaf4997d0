"""The GPU benchmark's systems on one workload, every request run to its max_tokens (random
weights: EOS would end requests at random): batchrun's engine, transformers' continuous batching
(generate_batch) and transformers' generate on left-padded static batches."""

from __future__ import annotations

import time

import torch

from benchmarks.bench import Workload


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def figures(seconds: float, work: Workload, output_tokens: int, requests: int) -> dict:
    prompt = sum(len(p) for p in work.prompts[:requests])
    return {"requests": requests, "prompt_tokens": prompt, "output_tokens": output_tokens,
            "seconds": round(seconds, 3), "out_tok_s": output_tokens / seconds,
            "total_tok_s": (prompt + output_tokens) / seconds}


def run_batchrun(engine, work: Workload, device: torch.device) -> dict:
    from batchrun.engine import SamplingParams

    engine.kv.reset_prefix_cache()  # every system starts cold
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    before = engine.stats.cached_tokens, engine.stats.prompt_tokens
    _sync(device)
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    _sync(device)
    seconds = time.perf_counter() - start
    out = figures(seconds, work, sum(len(o.outputs[0].token_ids) for o in outs), len(work.prompts))
    prompt = engine.stats.prompt_tokens - before[1]
    out["cache_hit_rate"] = (engine.stats.cached_tokens - before[0]) / prompt if prompt else 0.0
    return out


def run_hf_continuous(hf, work: Workload, device: torch.device, limit: int,
                      num_blocks: int | None = None) -> dict:
    """transformers' own continuous batching (generate_batch, paged attention) on the first
    `limit` requests: one untimed call on two of them first (its manager's warm-up, CUDA graph
    captures included, kept for the timed call); `num_blocks` of 256-token pages (None: as
    transformers sizes it from free GPU memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    prompts = work.prompts[:limit]
    longest = max(work.max_tokens[:limit])
    cfg = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks,
                                  max_batch_tokens=None if num_blocks is None else 256)
    try:
        with torch.inference_mode():
            hf.generate_batch(inputs=prompts[:2], generation_config=cfg, progress_bar=False,
                              continuous_batching_config=cb, persistent_manager=True)
            _sync(device)
            start = time.perf_counter()
            res = hf.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False,
                                    continuous_batching_config=cb, persistent_manager=True)
            _sync(device)
            seconds = time.perf_counter() - start
    finally:
        hf.destroy_cached_continuous_batching_manager()
    if len(res) != len(prompts) or any(r.error for r in res.values()):
        raise RuntimeError(f"generate_batch returned {len(res)} of {len(prompts)} requests")
    tokens = sum(len(r.generated_tokens) for r in res.values())
    return figures(seconds, work, tokens, len(prompts))


def run_hf_static(hf, work: Workload, device: torch.device, box_s: float,
                  batch_size: int = 32) -> dict:
    """generate on batches of `batch_size` in input order until `box_s` seconds have passed
    (static batches run at the same rate batch after batch: the rate of those run stands for
    the whole workload's)."""
    done = tokens = 0
    _sync(device)
    start = time.perf_counter()
    while done < len(work.prompts) and (done == 0 or time.perf_counter() - start < box_s):
        batch = work.prompts[done:done + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        longest = max(work.max_tokens[done:done + batch_size])
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                              max_new_tokens=longest, min_new_tokens=longest, pad_token_id=0,
                              eos_token_id=None)
        tokens += (out.shape[1] - width) * len(batch)
        done += len(batch)
    _sync(device)
    return figures(time.perf_counter() - start, work, tokens, done)
