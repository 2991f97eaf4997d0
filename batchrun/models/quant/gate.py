"""The int8 load gate: the quantized model against the float model it was made from, on this
machine, before any request runs.

The float model's next-token choices on GATE_TOKENS of the calibration text are recorded before
its linears are quantized (cached beside the calibration); once the int8 model is complete
(smoothed layers, outlier channels, the C kernels attached: the kernels this CPU will run), it
reads the same tokens. Counted are the decisive positions, where float32's top token leads the
next by at least MARGIN nats: a near tie may go either way under any rounding and says nothing
about the kernels. An int8 model that picks another token at more than WARN_BELOW of them is
reported; below REFUSE_BELOW (a kernel computing wrong sums on this CPU kind, not quantization
noise) the load is refused. A model whose logits are too flat to have MIN_DECISIVE such
positions (a random test model) is not judged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from batchrun.models.quant.decoder import as_decoder
from batchrun.models.quant.errors import QuantizationError

log = logging.getLogger(__name__)
GATE_TOKENS = 256
MARGIN = 1.0
MIN_DECISIVE = 24
WARN_BELOW = 0.95
REFUSE_BELOW = 0.8


@dataclass(frozen=True)
class GateResult:
    decisive: int  # positions where float32's top token leads by MARGIN or more
    agree: int  # of those, where int8 picks the same token

    @property
    def judged(self) -> bool:
        return self.decisive >= MIN_DECISIVE

    @property
    def share(self) -> float:
        return self.agree / self.decisive if self.decisive else 1.0

    def describe(self) -> str:
        return (f"int8 picks float32's next token at {self.agree} of {self.decisive} decisive "
                f"positions ({100 * self.share:.1f}%) of the calibration text")


@dataclass(frozen=True)
class Gate:
    """The float model's choices on the gate's tokens, taken before its linears are quantized."""

    ids: list[int]
    ref: dict[str, torch.Tensor]

    @classmethod
    def before(cls, model: nn.Module, files: list[Path], tokenizer_path: Path) -> Gate:
        from batchrun.models.quant import calibration

        ids = [t for w in calibration.token_windows(tokenizer_path) for t in w][:GATE_TOKENS]
        # beside the calibration, not a calibration (*.pt) itself
        dtype = as_decoder(model).embed_tokens.weight.dtype
        cache = calibration.cache_path(files, "int8-gate", dtype).with_suffix(".gate")
        return cls(ids, reference(model, ids, cache))

    def judge(self, model: nn.Module) -> GateResult:
        """The finished int8 `model` against the reference (see judge)."""
        return judge(model, self.ids, self.ref)


def next_tokens(model: nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(top token, its lead over the runner-up in logprob) at every position of `ids`, on the
    CPU (a cached reference compares with a model on any device)."""
    from batchrun.models.quant.calibration import window_forward

    with torch.no_grad():
        logits = as_decoder(model).compute_logits(window_forward(model, ids)[0])
    top2 = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1)
    return top2.indices[:, 0].cpu(), (top2.values[:, 0] - top2.values[:, 1]).cpu()


def reference(model: nn.Module, ids: list[int], cache: Path) -> dict[str, torch.Tensor]:
    """The float model's choices on `ids` ({"top", "lead"}), from `cache` when it holds them."""
    if cache.is_file():
        try:
            cached = torch.load(cache, weights_only=True)
            if set(cached) == {"top", "lead"} and len(cached["top"]) == len(ids):
                return cached
        except (RuntimeError, OSError, ValueError) as exc:
            log.warning("ignoring the unreadable int8 gate cache %s: %s", cache, exc)
    top, lead = next_tokens(model, ids)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"top": top, "lead": lead}, cache)
    return {"top": top, "lead": lead}


def judge(model: nn.Module, ids: list[int], ref: dict[str, torch.Tensor]) -> GateResult:
    """The int8 `model` on the gate's tokens against the float reference: warns below
    WARN_BELOW, raises QuantizationError below REFUSE_BELOW."""
    top, _ = next_tokens(model, ids)
    decisive = ref["lead"] >= MARGIN
    result = GateResult(int(decisive.sum()), int((top == ref["top"])[decisive].sum()))
    if not result.judged:
        log.info("int8 gate: %s; too few to judge", result.describe())
    elif result.share < REFUSE_BELOW:
        raise QuantizationError(
            f"--quantization int8 computes wrong answers on this CPU: {result.describe()} (the "
            f"gate asks {100 * REFUSE_BELOW:.0f}%); use --quantization bf16 or int8-weight, or "
            "none, and report the CPU (lscpu) with this message")
    elif result.share < WARN_BELOW:
        log.warning("--quantization int8 fails its quality gate on this CPU: %s (the gate asks "
                    "%.0f%%); greedy answers will differ from float32's more than usual: "
                    "--quantization bf16 or int8-weight stay closer", result.describe(),
                    100 * WARN_BELOW)
    else:
        log.info("int8 gate passed: %s", result.describe())
    return result
