"""Logit adjustments before sampling, each vectorised over the rows that ask for it.

Rows are the engine's sequences, as the sampler reads them (sampler.SamplingRow). Only rows that use a feature pay for it; the per-row Python work is
collecting token id lists, never a loop over the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from batchrun.engine.sampler import SamplingRow


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each token id in each list."""
    counts = torch.zeros((len(seqs), vocab), device=device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    if int(lengths.sum()) == 0:
        return counts
    flat = torch.tensor([t for s in seqs for t in s], device=device, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
    keep = flat < vocab
    counts.index_put_((rows[keep], flat[keep]), torch.ones_like(flat[keep], dtype=counts.dtype),
                      accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output, then OpenAI's frequency / presence penalties over
    the output, as vLLM and OpenAI define them."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    sel = [rows[i] for i in idx]
    outputs = [r.all_token_ids[r.num_prompt_tokens:] for r in sel]
    out_counts = _token_counts(outputs, vocab, dev)
    sub = logits[idx]
    rep = torch.tensor([r.params.repetition_penalty for r in sel], device=dev, dtype=sub.dtype)
    if bool((rep != 1.0).any()):
        prompts = [r.all_token_ids[:r.num_prompt_tokens] if r.params.repetition_penalty != 1.0
                   else [] for r in sel]
        seen = (_token_counts(prompts, vocab, dev) > 0) | (out_counts > 0)
        penalised = torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None])
        sub = torch.where(seen, penalised, sub)
    freq = torch.tensor([r.params.frequency_penalty for r in sel], device=dev, dtype=sub.dtype)
    pres = torch.tensor([r.params.presence_penalty for r in sel], device=dev, dtype=sub.dtype)
    sub = sub - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).to(sub.dtype)
    logits = logits.clone()
    logits[idx] = sub
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    entries = [(i, tok, bias) for i, r in enumerate(rows) if r.params.logit_bias
               for tok, bias in r.params.logit_bias.items() if 0 <= tok < logits.shape[1]]
    if not entries:
        return logits
    dev = logits.device
    rows_t = torch.tensor([e[0] for e in entries], device=dev)
    toks = torch.tensor([e[1] for e in entries], device=dev)
    bias = torch.tensor([float(e[2]) for e in entries], device=dev, dtype=logits.dtype)
    return logits.index_put((rows_t, toks), bias, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow],
                     eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Mask EOS and the stop token ids of rows that have not yet generated min_tokens."""
    entries = [(i, tok) for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens
               for tok in (*([] if r.params.ignore_eos else eos_token_ids),
                           *r.params.stop_token_ids)
               if 0 <= tok < logits.shape[1]]
    if not entries:
        return logits
    dev = logits.device
    rows_t = torch.tensor([e[0] for e in entries], device=dev)
    toks = torch.tensor([e[1] for e in entries], device=dev)
    return logits.index_put((rows_t, toks), torch.tensor(float("-inf"), device=dev,
                                                         dtype=logits.dtype))
