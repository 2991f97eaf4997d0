"""Vectorised sampling over a step's batch of logits.

Greedy rows take the argmax. Sampled rows are scaled by temperature, filtered by top-k / top-p /
min-p, and drawn with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which turns
sampling into one vectorised argmax. A request with a seed draws its noise from its own
generator, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, [(token id, logprob)] top alternatives) or None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 request_ids: list[str]) -> SamplerOutput:
        """logits: [N, V] float32, one row per sequence that samples this step."""
        n = logits.shape[0]
        greedy = [p.temperature == 0.0 for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if all(greedy):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._sample(logits, params, request_ids, greedy)

        logprobs: list = [None] * n
        if want_logprobs:
            chosen_lp = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
            k = max(p.logprobs or 0 for p in params)
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                top = []
                if p.logprobs:
                    top = list(zip(top_ids[i, :p.logprobs].tolist(), top_lp[i, :p.logprobs].tolist()))
                logprobs[i] = (chosen_lp[i], top)
        return SamplerOutput(chosen.tolist(), logprobs)

    def _sample(self, logits, params, request_ids, greedy) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                             device=dev, dtype=logits.dtype)
        scaled = logits / temps[:, None]
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[1]
            ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=probs.dtype)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the mass before it already reaches top_p (the first always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=probs.dtype)
            floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)

        noise = torch.empty_like(probs).exponential_()
        for i, (p, rid) in enumerate(zip(params, request_ids)):
            if p.seed is not None and not greedy[i]:
                gen = self._generators.get(rid)
                if gen is None:
                    gen = torch.Generator(device=dev).manual_seed(p.seed)
                    self._generators[rid] = gen
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            mask = torch.tensor(greedy, device=dev)
            sampled = torch.where(mask, logits.argmax(dim=-1), sampled)
        return sampled
