"""Seed statistics for reports (SPEC §9; SCSE "Seed Protocol and Aggregation").

- Aggregates over seeds are ``mean ± std`` with the sample standard deviation (ddof = 1).
- Paired comparisons match two variants by (seed, depth) and take ``delta = variant − baseline``;
  they report the mean delta with a small-sample 95% t-interval half-width
  ``t_{(1+c)/2, n−1} · sd / √n`` (Student t, SciPy) and a deterministic paired-bootstrap percentile
  interval (NumPy ``Generator`` with a fixed seed, resampling the matched pairs with replacement).

Both intervals are paired robustness checks over a handful of seeds, not large-sample significance
claims. All functions take plain sequences of floats and return floats (NaN where a quantity is
undefined, e.g. a standard deviation of one value).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np
from scipy import stats as _sps

DEFAULT_RESAMPLES = 10_000
DEFAULT_BOOTSTRAP_SEED = 0


def _as_array(values: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{name}: need at least one value")
    return arr


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std with ddof=1)`` of ``values``; the std is NaN for a single value.

    Raises:
        ValueError: empty ``values``.
    """
    arr = _as_array(values, "values")
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else math.nan


def t_half_width(values: Sequence[float], confidence: float = 0.95) -> float:
    """Half-width of the two-sided Student-t confidence interval for the mean of ``values``.

    ``t_{(1+c)/2, n−1} · sd / √n`` with the sample sd (ddof=1); e.g. [1, 2, 3] → 4.302653/√3 =
    2.48414. NaN for fewer than two values; 0 when all values are equal.

    Raises:
        ValueError: empty ``values`` or ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    arr = _as_array(values, "values")
    n = arr.size
    if n < 2:
        return math.nan
    q = float(_sps.t.ppf(0.5 + confidence / 2.0, df=n - 1))
    return q * float(arr.std(ddof=1)) / math.sqrt(n)


def bootstrap_interval(values: Sequence[float], *, confidence: float = 0.95,
                       n_resamples: int = DEFAULT_RESAMPLES,
                       seed: int = DEFAULT_BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval for the mean of ``values`` (e.g. paired deltas).

    Draws ``n_resamples`` resamples of size n with replacement from ``np.random.default_rng(seed)``
    and returns the ``(1−c)/2`` and ``(1+c)/2`` percentiles (linear interpolation) of the resample
    means. Deterministic: the same inputs give the same interval on every call. Constant values
    give a zero-width interval; a single value gives ``(value, value)``.

    Raises:
        ValueError: empty ``values``, ``confidence`` outside (0, 1) or ``n_resamples < 1``.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples: must be >= 1, got {n_resamples}")
    arr = _as_array(values, "values")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(n_resamples, arr.size))  # (n_resamples, n)
    means = arr[idx].mean(axis=1)  # (n_resamples,)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.percentile(means, [100.0 * alpha, 100.0 * (1.0 - alpha)])
    return float(lo), float(hi)


@dataclass(frozen=True)
class PairedSummary:
    """Summary of matched deltas ``variant − baseline`` (one per seed).

    ``n`` pairs, ``mean`` and sample ``sd`` of the deltas, ``t_half_width`` (95% by default;
    NaN for n < 2), ``t_interval`` = mean ∓ half-width, ``bootstrap`` = percentile interval,
    ``keys`` = the matched keys (e.g. seeds) in sorted order, ``deltas`` in that order.
    """

    n: int
    mean: float
    sd: float
    t_half_width: float
    t_interval: tuple[float, float]
    bootstrap: tuple[float, float]
    keys: tuple
    deltas: tuple[float, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["t_interval"], d["bootstrap"] = list(self.t_interval), list(self.bootstrap)
        d["keys"], d["deltas"] = list(self.keys), list(self.deltas)
        return d


def paired_deltas(variant: Mapping[Hashable, float], baseline: Mapping[Hashable, float]
                  ) -> tuple[list, list[float]]:
    """Match two ``{key: value}`` maps (key: seed, or (seed, depth)) on their common keys.

    Returns:
        ``(keys, deltas)``: the common keys sorted, and ``variant[k] − baseline[k]`` in that order.
        Keys present in only one map are dropped (an unpaired seed is not a paired observation).
    """
    keys = sorted(set(variant) & set(baseline))
    return keys, [float(variant[k]) - float(baseline[k]) for k in keys]


def summarize_paired(variant: Mapping[Hashable, float], baseline: Mapping[Hashable, float], *,
                     confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES,
                     seed: int = DEFAULT_BOOTSTRAP_SEED) -> PairedSummary | None:
    """Paired-delta summary of ``variant − baseline`` over their common keys (None if none match).

    Example: deltas [1, 2, 3] → mean 2, sd 1, t half-width 2.48414, t interval (−0.484, 4.484).
    """
    keys, deltas = paired_deltas(variant, baseline)
    if not deltas:
        return None
    mean, sd = mean_std(deltas)
    hw = t_half_width(deltas, confidence)
    return PairedSummary(n=len(deltas), mean=mean, sd=sd, t_half_width=hw, t_interval=(mean - hw, mean + hw),
                         bootstrap=bootstrap_interval(deltas, confidence=confidence, n_resamples=n_resamples,
                                                      seed=seed),
                         keys=tuple(keys), deltas=tuple(deltas))


#: Fewest paired seeds a verdict on a paper's claim is given from (SPEC §9's default seed set).
MIN_VERDICT_PAIRS = 3


def claim_verdict(summary: PairedSummary | None, *, expect: str = "negative",
                  min_pairs: int = MIN_VERDICT_PAIRS) -> str:
    """Verdict of a paper's directional claim about a paired delta ``variant − baseline``.

    Args:
        summary: :func:`summarize_paired` of the two variants (None: nothing matched).
        expect: ``"negative"`` when the paper claims delta < 0 (e.g. a lower PPL), ``"positive"`` for > 0.
        min_pairs: fewest paired observations a verdict is given from.

    Returns:
        ``"reproduces"`` when the t interval excludes 0 on the claimed side, ``"opposite"`` when it
        excludes 0 on the other side, ``"not resolved"`` when it contains 0; with fewer than
        ``min_pairs`` pairs ``"provisional (n pairs): claimed side"`` / ``… other side`` / ``… tie`` by the
        sign of the mean only; ``"no data"`` without pairs.

    Raises:
        ValueError: ``expect`` not ``"negative"`` or ``"positive"``, or ``min_pairs`` < 2.
    """
    if expect not in ("negative", "positive"):
        raise ValueError(f"expect: 'negative' or 'positive', got {expect!r}")
    if min_pairs < 2:
        raise ValueError(f"min_pairs: at least 2 (an interval needs two pairs), got {min_pairs}")
    if summary is None or summary.n == 0:
        return "no data"
    sign = -1.0 if expect == "negative" else 1.0
    if summary.n < min_pairs:
        side = "tie" if summary.mean == 0 else ("claimed side" if sign * summary.mean > 0 else "other side")
        return f"provisional ({summary.n} pair{'s' if summary.n > 1 else ''}): {side}"
    lo, hi = summary.t_interval
    if (hi < 0) if sign < 0 else (lo > 0):
        return "reproduces"
    if (lo > 0) if sign < 0 else (hi < 0):
        return "opposite"
    return "not resolved"
