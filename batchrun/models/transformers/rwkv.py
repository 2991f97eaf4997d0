"""RWKV (v4) on the engine's state slots: transformers' RwkvSelfAttention (time mixing: the WKV
recurrence) and RwkvFeedForward (channel mixing), for a step's packed sequences at once, laid
out one sequence per row of a padded [S, L] batch as mamba.py lays them.

Both mix each position with the one before it (the time shift): a sequence's first row takes
its slot's last input (zero when fresh). The WKV recurrence keeps a numerator, a denominator
and a running maximum (the exponents' scale) per channel, updated per position as
transformers' CPU path does; a padding position leaves them as they are.

One sequence's state: time mixing, its last input [hidden] in the model's dtype and the
numerator, denominator and maximum [attention_hidden] in float32; channel mixing, its last
input [hidden] in the model's dtype (transformers' five state tensors, split by layer).
"""

from __future__ import annotations

import torch

from batchrun.engine.state_slots import StateTensor, StepState

MIXERS = ("RwkvSelfAttention", "RwkvFeedForward")
# RWKV's eval forward rescales these weights in place once (rescale_every): kept unpacked
PLAIN = {"RwkvSelfAttention": ("output",), "RwkvFeedForward": ("value",)}


def state_tensors(mixer, dtype: torch.dtype) -> tuple[StateTensor, ...]:
    shift = StateTensor((mixer.config.hidden_size,), dtype)
    if type(mixer).__name__ == "RwkvFeedForward":
        return (shift,)
    wkv = StateTensor((mixer.attention_hidden_size,), torch.float32)
    return (shift, wkv, wkv, wkv)


def plain_linears(mixer) -> tuple[str, ...]:
    return PLAIN[type(mixer).__name__]


def shifted(x: torch.Tensor, shift_cache: torch.Tensor, step: StepState
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each sequence's rows [S, L, hidden], the rows before them, valid [S, L]); the slots
    get each sequence's last row."""
    rows, valid = step.padded_rows()
    xs = x[rows]
    before = shift_cache[step.slots].to(x.dtype).masked_fill(step.fresh[:, None], 0)
    shift_cache[step.slots] = x[step.query_start[1:] - 1].to(shift_cache.dtype)
    return xs, torch.cat([before[:, None], xs[:, :-1]], dim=1), valid


def mix(x: torch.Tensor, before: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * weight + before * (1 - weight)


def forward(mixer, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            step: StepState) -> tuple[torch.Tensor, None]:
    """The layer's (output [1, T, hidden], None) for the step's flat rows `hidden`, updating
    the step's sequences' slots of its state."""
    xs, before, valid = shifted(hidden[0], tensors[0], step)
    if type(mixer).__name__ == "RwkvFeedForward":
        key = torch.square(torch.relu(mixer.key(mix(xs, before, mixer.time_mix_key))))
        out = torch.sigmoid(mixer.receptance(mix(xs, before, mixer.time_mix_receptance))) * \
            mixer.value(key)
        return out[valid][None], None
    key = mixer.key(mix(xs, before, mixer.time_mix_key))
    value = mixer.value(mix(xs, before, mixer.time_mix_value))
    receptance = torch.sigmoid(mixer.receptance(mix(xs, before, mixer.time_mix_receptance)))
    wkv = time_mix(mixer, key, value, valid, tensors[1:], step).to(key.dtype)
    return mixer.output(receptance * wkv)[valid][None], None


def time_mix(mixer, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
             tensors: tuple[torch.Tensor, ...], step: StepState) -> torch.Tensor:
    """The WKV outputs [S, L, A] (float32) from each slot's numerator, denominator and maximum
    (a fresh sequence's: 0, 0 and -1e38); the slots get their values after each last row."""
    num_cache, den_cache, max_cache = tensors
    fresh = step.fresh[:, None]
    num, den = (c[step.slots].masked_fill(fresh, 0) for c in (num_cache, den_cache))
    top = max_cache[step.slots].masked_fill(fresh, -1e38)
    decay, first = -torch.exp(mixer.time_decay.float()), mixer.time_first.float()
    outs = []
    for t in range(key.shape[1]):
        k, v, ok = key[:, t].float(), value[:, t].float(), valid[:, t, None]
        peak = torch.maximum(top, k + first)
        e1, e2 = torch.exp(top - peak), torch.exp(k + first - peak)
        outs.append((e1 * num + e2 * v) / (e1 * den + e2))
        peak = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - peak), torch.exp(k - peak)
        num = torch.where(ok, e1 * num + e2 * v, num)
        den = torch.where(ok, e1 * den + e2, den)
        top = torch.where(ok, peak, top)
    num_cache[step.slots], den_cache[step.slots], max_cache[step.slots] = num, den, top
    return torch.stack(outs, dim=1)
