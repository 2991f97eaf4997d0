"""The one tie-aware comparison every greedy-equality test uses.

fp32 matmuls on the CPU round differently with the number of rows in a step (a few 1e-5), so two
correct greedy decoders may part ways where the reference's top two logits are a numerical tie.
Sequences must be equal, or first differ at a position where the reference's top-2 margin is
below TIE_MARGIN. Anything else is a real mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TIE_MARGIN = 1e-3


@dataclass
class ParityReport:
    compared: int = 0
    ties: int = 0
    tie_positions: list[tuple[str, int, float]] = field(default_factory=list)


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def assert_greedy_match(ours: list[int], ref: list[int], ref_logits, label: str = "",
                        report: ParityReport | None = None) -> None:
    """ref_logits[i]: the reference logits that produced ref[i], or their top-2 margin as a float
    (top-2 logprobs give the same margin); None when no tie rule is available."""
    if report is not None:
        report.compared += 1
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            margin = float("inf") if ref_logits is None else (
                ref_logits[i] if isinstance(ref_logits[i], float) else top2_margin(ref_logits[i]))
            assert margin < TIE_MARGIN, (
                f"{label}: greedy tokens differ at position {i} ({ours[i]} vs reference {ref[i]}) "
                f"where the reference's top-2 margin is {margin:.2e} (not a tie)\n"
                f"ours={ours}\nref ={ref}")
            if report is not None:
                report.ties += 1
                report.tie_positions.append((label, i, margin))
            return
    assert len(ours) == len(ref), f"{label}: same tokens but lengths {len(ours)} vs {len(ref)}"
