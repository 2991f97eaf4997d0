"""The aggregates of a scorer's per-choice scores, each with a 95% confidence interval.

Examples are the unit: example i contributes the mean of its n choices' scores, every example
weighs the same (with a constant n this is the mean over all choices).

- mean_summary: 0/1 scores get the Wilson score interval, with the sum of the per-example means
  as the successes and the number of examples as the trials. With n = 1 that is the textbook
  interval; with n > 1 it is conservative (the variance of a mean of per-example proportions is
  at most p(1-p)/examples), never the too-narrow interval that counting all n*examples choices
  as independent trials would give. Continuous scores get Student's t interval on the
  per-example means (mean +- t(0.975, examples-1) * sd / sqrt(examples)).
- pass_at_k_summary: the unbiased estimator of Chen et al. (2021), pass@k = mean over examples
  of 1 - C(n-c, k)/C(n, k), computed as the product 1 - prod_{i=n-c+1..n} (1 - k/i) (no huge
  binomials). Its CI is a percentile bootstrap over examples (2000 resamples, fixed seed 0), so
  the same scores always give the same interval.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Z95 = 1.959963984540054
# Student t's 0.975 quantile for 1..30 degrees of freedom (beyond: a Cornish-Fisher expansion).
_T975 = [12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.13145, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.04523, 2.042272]
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
NAN = float("nan")


def t975(df: int) -> float:
    """Student t's 0.975 quantile with `df` degrees of freedom (within 1e-5 of the exact)."""
    if df < 1:
        raise ValueError("t quantile needs df >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = Z95, float(df)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def wilson(successes: float, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (successes may be fractional, see above)."""
    if trials <= 0:
        return NAN, NAN
    p = successes / trials
    denom = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def t_interval(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    if n < 2:
        return NAN, NAN
    arr = np.asarray(values, dtype=float)
    mean = float(arr.mean())
    half = t975(n - 1) * float(arr.std(ddof=1)) / math.sqrt(n)
    return mean - half, mean + half


def _example_means(per_example: Sequence[Sequence[float]]) -> list[float]:
    return [sum(scores) / len(scores) for scores in per_example if len(scores)]


def mean_summary(per_example: Sequence[Sequence[float]]) -> dict[str, float]:
    """{"mean", "ci_low", "ci_high"}: Wilson for 0/1 scores, Student t otherwise (see above).
    Examples with no scores are left out; none at all gives NaNs."""
    means = _example_means(per_example)
    if not means:
        return {"mean": NAN, "ci_low": NAN, "ci_high": NAN}
    mean = sum(means) / len(means)
    binary = all(s in (0.0, 1.0) for scores in per_example for s in scores)
    low, high = wilson(sum(means), len(means)) if binary else t_interval(means)
    return {"mean": mean, "ci_low": low, "ci_high": high}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k for one problem with c of n samples correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def bootstrap_mean_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap 95% CI of the mean (resampling the values), deterministic."""
    arr = np.asarray(values, dtype=float)
    n = len(arr)
    if n == 0:
        return NAN, NAN
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    rows = max(1, 4_000_000 // n)  # bound the index matrix to ~32 MB
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        means[start:stop] = arr[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def pass_at_k_summary(per_example: Sequence[Sequence[float]],
                      ks: Sequence[int]) -> dict[str, float]:
    """{"pass@k", "pass@k_ci_low", "pass@k_ci_high"} for each k in ks with k <= the smallest n
    of the examples (a choice passed where its score is > 0.5)."""
    scored = [scores for scores in per_example if len(scores)]
    out: dict[str, float] = {}
    if not scored:
        return out
    n_min = min(len(scores) for scores in scored)
    for k in sorted(set(ks)):
        if k > n_min:
            continue
        values = [pass_at_k(len(s), sum(1 for x in s if x > 0.5), k) for s in scored]
        low, high = bootstrap_mean_ci(values)
        out[f"pass@{k}"] = float(np.mean(values))
        out[f"pass@{k}_ci_low"] = low
        out[f"pass@{k}_ci_high"] = high
    return out
