"""SmoothQuant's per-input-channel smoothing for W8A8, from calibrated activation statistics.

A linear's input channel j with large activations (this model's residual-stream outliers) is
divided by s[j] before the per-token int8 quantization and its weight column multiplied by s[j]:
x @ W.T == (x / s) @ (W * s).T, with the activations' range flattened and the weights' widened.
s[j] = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha) (Xiao et al., 2022), max|x_j| collected
by `record_input_max` on calibration text that the quality gate does not score."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_FLOOR = 1e-5  # a channel that never fired (or a zero weight column) is left near unsmoothed


def smoothing_factors(input_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """float32 [K] factors s for a weight [N, K] whose input channels reached input_max [K]."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=_FLOOR)
    s = input_max.float().to(w_max.device).clamp(min=_FLOOR).pow(alpha) / w_max.pow(1 - alpha)
    return s.clamp(min=_FLOOR)


@contextlib.contextmanager
def record_input_max(modules: dict[str, nn.Linear]):
    """While open, {name: float32 [in_features]}: the largest |input| each module's input
    channels have seen (over every row of every call), on the CPU whatever the model's device."""
    stats = {name: torch.zeros(m.in_features) for name, m in modules.items()}

    def hook(name):
        def record(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if x.shape[0]:
                torch.maximum(stats[name], x.abs().amax(dim=0).cpu(), out=stats[name])
            # returns None: a forward pre-hook's return value would replace the input
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in modules.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def record_output_max(module: nn.Module, size: int):
    """While open, float32 [size]: the largest |output| each channel of `module`'s output (a
    decoder's final hidden states: the logits layer's input) has reached."""
    stats = torch.zeros(size)

    def record(_module, _args, out):
        y = out.detach().reshape(-1, size).float()
        if y.shape[0]:
            torch.maximum(stats, y.abs().amax(dim=0).cpu(), out=stats)

    handle = module.register_forward_hook(record)
    try:
        yield stats
    finally:
        handle.remove()
