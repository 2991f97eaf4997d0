"""The n choices of a user request: each choice's sampling seed (the Group of their sequences
is in request.py, beside Request)."""

from __future__ import annotations

import dataclasses

from batchrun.engine.sampling_params import SamplingParams


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 and choice 0 of n agree); others get their own stream."""
    if index == 0:
        return seed
    return (seed * 6364136223846793005 + index * 1442695040888963407) % (1 << 63)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=choice_seed(params.seed, index))
