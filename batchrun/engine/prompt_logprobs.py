"""Prompt logprobs (scoring): log P(token j | tokens < j) for every prompt token j >= 1, with the
token's rank and the top-k of that distribution.

Entries are indexed by the token they score, so the entries of a full KV block's tokens depend
only on the tokens up to the end of that block, which is exactly what the block's chained hash
covers. That lets the prefix cache keep them beside the block (`BlockScores`, keyed by the hash):
a later request whose prefix hits the cache adopts the entries of the cached blocks instead of
needing hidden states that were never kept. The one entry a cache hit cannot give is the first
token after the hit (scored from the last cached position): the runner recomputes that one
position, writing its K/V into a scratch slot (see ModelRunner), so a hit costs one extra row.

Logits are computed for at most SCORE_ROWS rows at a time and only the asked-for values are
kept: a 2,000-token prompt never holds a [2000, vocab] tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batchrun.engine.outputs import PromptLogprobs

# Rows of logits alive at once: 128 x 49k x 4 bytes = 25 MB for SmolLM2.
SCORE_ROWS = 128


@dataclass
class BlockScores:
    """The entries of one full block's tokens (token 0 of the prompt holds NaN / rank 0)."""
    logprob: torch.Tensor  # [bs] float32
    rank: torch.Tensor  # [bs] int64, 1 = the most likely token
    top_ids: torch.Tensor  # [bs, k] int64
    top_logprobs: torch.Tensor  # [bs, k] float32

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]


class PromptScores:
    """One request's prompt entries, filled in order: entries for tokens < `filled` are known."""

    def __init__(self, prompt: list[int], k: int):
        n = len(prompt)
        self.prompt = prompt
        self.k = k
        self.logprob = torch.full((n,), math.nan)
        self.rank = torch.zeros(n, dtype=torch.long)
        self.top_ids = torch.zeros((n, k), dtype=torch.long)
        self.top_logprobs = torch.zeros((n, k))
        self.filled = 1  # token 0 has no entry
        self.published = 0  # full blocks whose entries were offered to the prefix cache

    @property
    def done(self) -> bool:
        return self.filled >= len(self.prompt)

    def put(self, first: int, logprob, rank, top_ids, top_logprobs) -> None:
        """Entries for tokens first .. first + len(logprob) - 1; must extend the known prefix."""
        assert first <= self.filled, "prompt entries must be filled in order"
        end = first + logprob.shape[0]
        self.logprob[first:end] = logprob
        self.rank[first:end] = rank
        self.top_ids[first:end] = top_ids[:, :self.k]
        self.top_logprobs[first:end] = top_logprobs[:, :self.k]
        self.filled = max(self.filled, end)

    def has_block(self, i: int, bs: int) -> bool:
        return (i + 1) * bs <= self.filled

    def adopt(self, i: int, bs: int, record: BlockScores | None) -> bool:
        """Take block i's entries from the prefix cache's record unless already known (blocks are
        offered in order); False when neither has them, which ends the prefix match there."""
        if self.has_block(i, bs):
            return True
        if record is None or record.k < self.k:
            return False
        self.put(i * bs, record.logprob, record.rank, record.top_ids, record.top_logprobs)
        return True

    def block(self, i: int, bs: int) -> BlockScores:
        s = slice(i * bs, (i + 1) * bs)
        return BlockScores(self.logprob[s].clone(), self.rank[s].clone(),
                           self.top_ids[s].clone(), self.top_logprobs[s].clone())

    def output(self) -> PromptLogprobs:
        n = len(self.prompt)
        lp = self.logprob.tolist()
        rank = self.rank.tolist()
        ids = self.top_ids.tolist()
        tlp = self.top_logprobs.tolist()
        return PromptLogprobs(
            token_ids=list(self.prompt),
            logprob=[None] + lp[1:n],
            rank=[None] + rank[1:n],
            top=[None] + [list(zip(ids[j], tlp[j])) for j in range(1, n)])


def score_rows(compute_logits, hidden: torch.Tensor, targets: torch.Tensor, k: int):
    """For each hidden row: (logprob of its target token, the target's rank, top-k ids, top-k
    logprobs), computed SCORE_ROWS rows at a time; all on the CPU, float32."""
    lps, ranks, ids, tops = [], [], [], []
    for s in range(0, hidden.shape[0], SCORE_ROWS):
        logits = compute_logits(hidden[s:s + SCORE_ROWS]).float()
        tgt = targets[s:s + SCORE_ROWS].to(logits.device)
        lse = torch.logsumexp(logits, dim=-1)
        actual = logits.gather(1, tgt[:, None])[:, 0]
        # Rank as vLLM counts it: 1 + the number of tokens strictly more likely.
        ranks.append(((logits > actual[:, None]).sum(dim=-1) + 1).cpu())
        lps.append((actual - lse).cpu())
        if k:
            top_logits, top_ids = logits.topk(k, dim=-1)
            tops.append((top_logits - lse[:, None]).cpu())
            ids.append(top_ids.cpu())
        del logits
    rows = hidden.shape[0]
    lp = torch.cat(lps) if lps else torch.empty(0)
    rank = torch.cat(ranks) if ranks else torch.empty(0, dtype=torch.long)
    if k:
        return lp, rank, torch.cat(ids), torch.cat(tops)
    return lp, rank, torch.empty((rows, 0), dtype=torch.long), torch.empty((rows, 0))
