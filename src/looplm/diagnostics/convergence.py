"""Token convergence along the recurrence (SPEC §6; LMDR, arXiv:2610.06833, §2, Figure 2).

ρ_{r,t} = ‖h_t^r − h_t^{r−1}‖₂ / (‖h_t^{r−1}‖₂ + 1e-8); token t's convergence depth is the smallest r with
ρ_{r',t} < τ for all r' ≥ r, else R + 1 (our choice: a "never" bin, ranked latest). Pooled over batches:
mean ρ per r, the depth histogram, and Spearman's ρ of depth with position (Figure 2c).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from looplm.eval.exits import relative_change

DEFAULT_TAU = 0.02  # τ = 2% (LMDR Figure 2; SPEC §6)


def relative_changes(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """(R, B, L) float64 ρ_r from states h^0 … h^R, each (B, L, d); ValueError: < 2 states or mixed shapes."""
    if len(states) < 2:
        raise ValueError(f"states: need h^0 … h^R with R >= 1, got {len(states)} state(s)")
    if any(s.shape != states[0].shape for s in states):
        raise ValueError(f"states: all states must share one shape, got {[tuple(s.shape) for s in states]}")
    h = torch.stack([s.detach() for s in states])  # (R+1, B, L, d)
    return relative_change(h[:-1], h[1:], torch.float64)  # (R, B, L)


def convergence_depths(rho: torch.Tensor, tau: float = DEFAULT_TAU) -> torch.Tensor:
    """int64 convergence depths in 1 … R + 1 of shape ``rho.shape[1:]`` from ρ (R, ...); ValueError: τ <= 0."""
    if tau <= 0:
        raise ValueError(f"tau: need a threshold > 0, got {tau}")
    if rho.dim() < 1 or rho.shape[0] < 1:
        raise ValueError(f"rho: need shape (R, ...) with R >= 1, got {tuple(rho.shape)}")
    R = rho.shape[0]
    below = rho < tau  # (R, ...)
    # suffix-all: tail[r] is True when every r' >= r is below τ (reverse cumulative product)
    tail = below.flip(0).to(torch.int64).cumprod(0).flip(0).bool()  # (R, ...)
    return R + 1 - tail.sum(0)  # the converged suffix has length tail.sum(), starting at r = R + 1 − len


class ConvergenceAccumulator:
    """Pools ρ and convergence depths over batches: ``add(states h^0 … h^R, mask of real tokens)``."""

    def __init__(self, tau: float = DEFAULT_TAU):
        if tau <= 0:
            raise ValueError(f"tau: need a threshold > 0, got {tau}")
        self.tau = float(tau)
        self.R: int | None = None
        self.rho_sum: torch.Tensor | None = None  # (R,) Σ over tokens
        self.depths: list[np.ndarray] = []
        self.positions: list[np.ndarray] = []

    def add(self, states: Sequence[torch.Tensor], mask: torch.Tensor | None = None) -> None:
        rho = relative_changes(states)  # (R, B, L)
        R, B, L = rho.shape
        if self.R is not None and R != self.R:
            raise ValueError(f"states: every batch needs the same depth R={self.R}, got R={R}")
        self.R = R
        keep = torch.ones(B, L, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
        rho = rho.cpu()
        depth = convergence_depths(rho, self.tau)  # (B, L)
        s = rho[:, keep].sum(1)  # (R,)
        self.rho_sum = s if self.rho_sum is None else self.rho_sum + s
        self.depths.append(depth[keep].numpy())
        self.positions.append(torch.arange(L).expand(B, L)[keep].numpy())

    def result(self) -> dict[str, Any]:
        """``tau``, ``depth``, ``tokens``, ``rho_mean`` (R), ``depth_hist`` (R + 1: never last), depth mean and
        median, ``never_fraction``, ``spearman`` and ``spearman_p`` (None when constant). ValueError: empty."""
        from scipy.stats import spearmanr

        if self.R is None or not self.depths:
            raise ValueError("convergence: no batches were added")
        R = self.R
        depth = np.concatenate(self.depths)
        pos = np.concatenate(self.positions)
        n = int(depth.size)
        hist = np.bincount(depth, minlength=R + 2)[1:R + 2]  # depths 1 … R+1
        rho, p = None, None
        if n >= 2 and np.ptp(depth) > 0 and np.ptp(pos) > 0:
            res = spearmanr(depth, pos)
            rho, p = (None if math.isnan(v) else v for v in (float(res.statistic), float(res.pvalue)))
        return {
            "tau": self.tau, "depth": R, "tokens": n,
            "rho_mean": [float(v) / max(n, 1) for v in self.rho_sum.tolist()],
            "depth_hist": [int(c) for c in hist],
            "depth_mean": float(depth.mean()) if n else None,
            "depth_median": float(np.median(depth)) if n else None,
            "never_fraction": float((depth == R + 1).mean()) if n else None,
            "spearman": rho, "spearman_p": p,
        }
