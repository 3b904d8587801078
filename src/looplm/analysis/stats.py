"""Seed statistics for reports (SPEC §9; SCSE "Seed Protocol and Aggregation").

Aggregates are ``mean ± std`` (ddof = 1). Paired comparisons match variants by (seed, depth), ``delta =
variant − baseline``: mean with a 95% Student-t half-width ``t_{(1+c)/2, n−1} · sd / √n`` and a deterministic
paired-bootstrap percentile interval (robustness checks over a few seeds, not significance claims). NaN where a
quantity is undefined (the std of one value).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np
from scipy import stats as _sps

DEFAULT_RESAMPLES = 10_000
DEFAULT_BOOTSTRAP_SEED = 0


def _as_array(values: Sequence[float], confidence: float = 0.5) -> np.ndarray:
    """``values`` as a flat float64 array; ValueError when empty or ``confidence`` is outside (0, 1)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("values: need at least one value")
    return arr


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std)`` of ``values``; the std is NaN for a single value. ValueError when empty."""
    arr = _as_array(values)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else math.nan


def t_half_width(values: Sequence[float], confidence: float = 0.95) -> float:
    """``t_{(1+c)/2, n−1} · sd / √n``, e.g. [1, 2, 3] → 4.302653/√3 = 2.48414; NaN for one value. ValueError:
    empty ``values`` or ``confidence`` outside (0, 1)."""
    arr = _as_array(values, confidence)
    n = arr.size
    if n < 2:
        return math.nan
    q = float(_sps.t.ppf(0.5 + confidence / 2.0, df=n - 1))
    return q * float(arr.std(ddof=1)) / math.sqrt(n)


def bootstrap_interval(values: Sequence[float], *, confidence: float = 0.95,
                       n_resamples: int = DEFAULT_RESAMPLES,
                       seed: int = DEFAULT_BOOTSTRAP_SEED) -> tuple[float, float]:
    """The ``(1−c)/2`` and ``(1+c)/2`` percentiles of the means of ``n_resamples`` resamples with replacement
    (``np.random.default_rng(seed)``: deterministic). ValueError: no values, a bad confidence or n_resamples."""
    arr = _as_array(values, confidence)
    if n_resamples < 1:
        raise ValueError(f"n_resamples: must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(n_resamples, arr.size))  # (n_resamples, n)
    means = arr[idx].mean(axis=1)  # (n_resamples,)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.percentile(means, [100.0 * alpha, 100.0 * (1.0 - alpha)])
    return float(lo), float(hi)


@dataclass(frozen=True)
class PairedSummary:
    """Summary of matched deltas ``variant − baseline`` over the sorted common ``keys`` (seeds)."""

    n: int
    mean: float
    sd: float
    t_half_width: float
    t_interval: tuple[float, float]
    bootstrap: tuple[float, float]
    keys: tuple
    deltas: tuple[float, ...]

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def summarize_paired(variant: Mapping[Hashable, float], baseline: Mapping[Hashable, float], *,
                     confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES,
                     seed: int = DEFAULT_BOOTSTRAP_SEED) -> PairedSummary | None:
    """Paired-delta summary of ``variant − baseline`` over their sorted common keys (None if none match)."""
    keys = sorted(set(variant) & set(baseline))
    deltas = [float(variant[k]) - float(baseline[k]) for k in keys]
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
    """Verdict of the claim "delta is ``expect``" ("negative" or "positive"): "reproduces" / "opposite" when the
    t interval excludes 0 on that / the other side, "not resolved"; with fewer than ``min_pairs`` pairs
    "provisional (n pairs): claimed side / other side / tie" by the mean's sign; "no data" without pairs."""
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
