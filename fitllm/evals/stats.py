"""Paired bootstrap confidence intervals.

Paired: base and candidate are scored on the same items, so each resample draws the same item
indices for both and the CI is on the difference of the statistic. That cancels the item-to-item
variance both share, which is what makes small quality differences detectable at all.
Items are windows (perplexity, KL: tokens of a window are correlated, so they resample together),
questions (accuracy) or prompts (generation agreement).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def ratio_stat(num: np.ndarray, den: np.ndarray, transform: Optional[Callable] = None):
    """Statistic sum(num)/sum(den) (optionally transformed, e.g. exp for perplexity) over rows of
    an index matrix; works on one index vector too."""
    def stat(idx: np.ndarray) -> np.ndarray:
        r = num[idx].sum(-1) / np.maximum(den[idx].sum(-1), 1e-12)
        return transform(r) if transform else r
    return stat


def mean_stat(values: np.ndarray):
    return lambda idx: values[idx].mean(-1)


def paired_diff_ci(stat_base, stat_cand, n: int, resamples: int = RESAMPLES, seed: int = 0,
                   level: float = LEVEL) -> dict:
    """Point difference stat_cand - stat_base over all n items, and its percentile bootstrap CI."""
    everything = np.arange(n)
    diff = float(stat_cand(everything) - stat_base(everything))
    if n < 2:
        return {"diff": diff, "lo": None, "hi": None}
    idx = _indices(n, resamples, seed)
    d = stat_cand(idx) - stat_base(idx)
    a = (1 - level) / 2
    return {"diff": diff, "lo": float(np.quantile(d, a)), "hi": float(np.quantile(d, 1 - a))}


def ci(stat, n: int, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict:
    """A statistic that is itself a comparison (KL, agreement): its value and bootstrap CI."""
    value = float(stat(np.arange(n)))
    if n < 2:
        return {"value": value, "lo": None, "hi": None}
    s = stat(_indices(n, resamples, seed))
    a = (1 - level) / 2
    return {"value": value, "lo": float(np.quantile(s, a)), "hi": float(np.quantile(s, 1 - a))}
