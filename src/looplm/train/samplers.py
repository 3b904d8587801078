"""Depth samplers (SPEC §5; PLN from Huginn, arXiv:2502.05171; the learned prior from LMDR, arXiv:2610.06833,
eq. 5–6): one loop depth per microbatch, a pure function of (seed, step, micro) (and of logits every rank
updates identically), so every rank and every resume draws the same depths. ``SAMPLERS`` is keyed by
``depth.sampler``, each built from its validated ``depth`` section; ``observe`` / ``update`` / state are no-ops
except for the learned prior.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import torch
from scipy import optimize, special, stats

from looplm.config import DepthConfig, FixedDepthConfig, LearnedDepthConfig, PLNDepthConfig, UniformDepthConfig


def _rng(seed: int, step: int, micro: int, stream: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{stream}:{seed}:{step}:{micro}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


class DepthSampler:
    """Base class: ``sample(seed, step, micro) -> T``, at most the config's ``max_depth()``."""

    def sample(self, seed: int, step: int, micro: int = 0) -> int:
        raise NotImplementedError

    def observe(self, depth: int, ce: float, n_tokens: int) -> None:
        """Record one microbatch's feedback (ignored by fixed samplers)."""

    def update(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """One sampler update per optimizer step; returns metrics ({} for fixed samplers)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FixedDepth(DepthSampler):
    """Always T = depth."""

    def __init__(self, cfg: FixedDepthConfig):
        self.depth = cfg.depth

    def sample(self, seed, step, micro=0):
        return self.depth


class UniformDepth(DepthSampler):
    """T ~ Uniform{lo, …, hi} (inclusive); SCSE trains with 1..8."""

    def __init__(self, cfg: UniformDepthConfig):
        self.lo, self.hi = cfg.lo, cfg.hi

    def sample(self, seed, step, micro=0):
        return int(_rng(seed, step, micro, "depth").integers(self.lo, self.hi + 1))


def _normal_nodes(sigma: float, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes z, weights w (n,): Σ w f(z) ≈ E[f(Z)], Z ~ N(0, 1), for f = Poisson(k; e^{μ+σz}). Trapezoid rule on
    [−12, 12] with a ξ step ≤ 1/(8√cap), below Poisson's width 1/√k, so it converges geometrically (Gauss–Hermite
    with fixed nodes does not: ~4e-4 error at σ = 2, 160 nodes)."""
    h = min(1.0, 1.0 / (sigma * np.sqrt(cap))) / 8.0
    z = np.linspace(-12.0, 12.0, int(np.ceil(24.0 / h)) + 1)
    w = np.exp(-0.5 * z**2)
    w[[0, -1]] *= 0.5
    return z, w / w.sum()


def pln_pmf(mu: float, sigma: float, cap: int) -> np.ndarray:
    """P(R = r), r = 1..cap, float64 (cap,), of the capped Poisson log-normal (SPEC §5; LMDR eq. 5): ξ ~ N(μ, σ²),
    K | ξ ~ Poisson(e^ξ), R = min(K + 1, cap), by quadrature; the tail P(K ≥ cap − 1) lands on r = cap."""
    z, w = _normal_nodes(sigma, cap)
    log_lam = mu + sigma * z  # (nodes,)
    lam = np.exp(log_lam)
    k = np.arange(cap - 1)  # K = 0..cap-2  ->  R = 1..cap-1
    log_pois = k[None, :] * log_lam[:, None] - lam[:, None] - special.gammaln(k + 1)[None, :]  # (nodes, cap-1)
    body = w @ np.exp(log_pois)  # (cap-1,)
    tail = w @ stats.poisson.sf(cap - 2, lam)  # P(K > cap-2) = P(R >= cap)
    return np.append(body, tail)


class PoissonLogNormalDepth(DepthSampler):
    """Huginn's capped Poisson log-normal depth prior (SPEC §5 ``pln``; LMDR eq. 5, App. B.3), with ``mu`` solved
    (brentq) so that E[min(R, cap)] = ``mean`` exactly under ``pmf()``. ValueError: mean = 1 (depth.mean)."""

    def __init__(self, cfg: PLNDepthConfig):
        if not 1 < cfg.mean < cfg.cap:
            raise ValueError(f"depth.mean: pln needs 1 < mean < depth.cap={cfg.cap}, got {cfg.mean}")
        self.mean, self.sigma, self.cap = float(cfg.mean), float(cfg.sigma), int(cfg.cap)
        self.mu = self._solve_mu()
        self._pmf = pln_pmf(self.mu, self.sigma, self.cap)

    def _solve_mu(self) -> float:
        # E[min(R, cap)] rises monotonically in μ from 1 (μ → −∞) to cap (μ → +∞).
        lo, hi = -40.0, np.log(self.cap) + 10.0 + 10.0 * self.sigma
        f = lambda mu: float(np.arange(1, self.cap + 1) @ pln_pmf(mu, self.sigma, self.cap)) - self.mean  # noqa: E731
        if f(lo) > 0 or f(hi) < 0:
            raise ValueError(f"depth.mean: cannot reach capped mean {self.mean} with "
                             f"σ={self.sigma}, cap={self.cap}")
        return float(optimize.brentq(f, lo, hi, xtol=1e-14, rtol=1e-14, maxiter=500))

    def pmf(self) -> np.ndarray:
        """P(R = r) for r = 1..cap, float64 (cap,)."""
        return self._pmf.copy()

    def sample(self, seed, step, micro=0):
        rng = _rng(seed, step, micro, "depth")
        xi = rng.normal(self.mu, self.sigma)
        return int(min(rng.poisson(np.exp(xi)) + 1, self.cap))


# Reward arms u = ω(CE) of the learned prior (SPEC §5; LMDR App. B.3 "Alternative prior signals").
# CE in nats per token; log_ce floors CE at 1e-12 as the paper does.
REWARDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg_ce": lambda ce: -ce,
    "log_ce": lambda ce: -torch.log(ce.clamp_min(1e-12)),
    "exp_ce": lambda ce: -torch.exp(ce),
    "inv_ppl": lambda ce: torch.exp(-ce),
}


class LearnedDepthPrior(DepthSampler):
    """The learned depth prior (SPEC §5 ``learned``; LMDR §4.1 eq. 6, App. B.3): a categorical p_φ over 1..R_max
    (float64 logits, from the capped PLN of R̄ = ``budget_mean``, σ, or from ``init``) trained by its own Adam on

        J(φ) = −Ê_n[sg(A_n) log p_φ(r_n)] − λ_H H(p_φ) + λ_m (E_p[R] − R̄)²,

    Ê_n token-weighted over the step's microbatches, A_n = u_n − b, u_n = ω(CE_n) the reward arm. Our choices: b
    is one scalar EMA (decay ``baseline_decay``) of the mean reward, from the first step's, taken before the step;
    the first ``warmup`` updates move only b and s. ``scale`` multiplies A_n by s = max(std(CE), 1e-12) /
    max(std(u), 1e-12), token-weighted population stds over the previous ``scale_window`` updates (s = 1
    before; exactly 1 for neg_ce). Per step: ``sample`` and ``observe`` per microbatch, then ``update``.
    """

    baseline_decay = 0.9

    def __init__(self, cfg: LearnedDepthConfig):
        pln = PoissonLogNormalDepth(cfg).pmf()  # also when init is given: it checks depth.mean
        init = np.asarray(cfg.init, dtype=np.float64) / sum(cfg.init) if cfg.init else pln
        self.r_max = int(cfg.cap)
        self.budget_mean = float(cfg.mean)
        self.entropy_weight, self.budget_weight = float(cfg.entropy), float(cfg.budget)
        self.warmup, self.reward = int(cfg.warmup), cfg.reward
        self.logits = torch.nn.Parameter(torch.from_numpy(np.log(init)))  # (R_max,) float64
        self.optimizer = torch.optim.Adam([self.logits], lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.baseline: float | None = None
        self.updates = 0
        self.scale, self.scale_window = bool(cfg.scale), int(cfg.scale_window)
        self.advantage_scale = 1.0  # s, from the previous updates (1 until there are any)
        self._scale_history: list[list[list[float]]] = []  # per update: [CE (M), reward (M), tokens (M)]
        self._obs: list[tuple[int, float, int]] = []  # (depth, mean CE in nats, tokens) per microbatch
        self._depths = torch.arange(1, self.r_max + 1, dtype=torch.float64)  # (R_max,)
        self._refresh()

    def _refresh(self) -> None:
        # Cache p_φ as numpy: it changes only in update/load_state_dict, and sample() runs per microbatch.
        with torch.no_grad():
            self._probs = torch.softmax(self.logits, 0).numpy().copy()

    def probs(self) -> np.ndarray:
        """p_φ(r) for r = 1..R_max, float64 (R_max,)."""
        return self._probs.copy()

    def mean_depth(self) -> float:
        """E_p[R] in loop steps."""
        return float(self._probs @ self._depths.numpy())

    def entropy(self) -> float:
        """H(p_φ) in nats."""
        with torch.no_grad():
            logp = torch.log_softmax(self.logits, 0)
            return float(-(logp.exp() * logp).sum())

    def sample(self, seed, step, micro=0):
        """One draw r ≥ 1 from p_φ, inverting its CDF with a single uniform."""
        cdf = np.cumsum(self._probs)
        r = int(np.searchsorted(cdf, _rng(seed, step, micro, "depth").random() * cdf[-1], side="right")) + 1
        return min(r, self.r_max)  # guards u·cdf[-1] == cdf[-1] in floating point

    def observe(self, depth: int, ce: float, n_tokens: int) -> None:
        """Record one microbatch's depth, mean CE (nats/token) and tokens (ValueError outside 1..R_max or n < 1)."""
        if not 1 <= depth <= self.r_max:
            raise ValueError(f"learned prior: depth {depth} outside 1..{self.r_max}")
        if n_tokens < 1:
            raise ValueError(f"learned prior: n_tokens must be >= 1, got {n_tokens}")
        self._obs.append((int(depth), float(ce), int(n_tokens)))

    def update(self, reduce=None):
        """Fold the observations into one step of J. ``reduce`` (a sum over ranks) is applied to
        [N_n·CE_n, N_n, r_n, 1] before the nonlinear reward, so every rank takes the identical global step.
        Returns {} or {"loss" (before), "reward", "baseline", "mean_depth", "entropy", "updates"}.
        RuntimeError: the ranks disagreed on the microbatch depths."""
        if not self._obs:
            return {}
        depth, ce, ntok = (torch.tensor(c, dtype=torch.float64) for c in zip(*self._obs))  # each (M,)
        self._obs = []
        stats_ = torch.cat([ntok * ce, ntok, depth, torch.ones(1, dtype=torch.float64)])  # (3M+1,)
        if reduce is not None:
            stats_ = reduce(stats_).to(torch.float64)
            m = len(depth)
            ce_sum, ntok, depth_sum, world = stats_[:m], stats_[m:2 * m], stats_[2 * m:3 * m], stats_[-1]
            if not torch.allclose(depth_sum, world * depth):
                raise RuntimeError("learned prior: ranks drew different depths for the same microbatch")
            ce = ce_sum / ntok
        weight = ntok / ntok.sum()  # (M,) Ê_n token weights
        reward = REWARDS[self.reward](ce)  # (M,)
        mean_reward = float(weight @ reward)
        if self.baseline is None:
            self.baseline = mean_reward
        advantage = reward - self.baseline  # (M,) sg(A_n): plain tensor, no grad
        if self.scale:
            advantage = self.advantage_scale * advantage

        logp = torch.log_softmax(self.logits, 0)  # (R_max,)
        p = logp.exp()
        idx = depth.long() - 1
        loss = (-(weight * advantage * logp[idx]).sum()
                + self.entropy_weight * (p * logp).sum()  # −λ_H H(p)
                + self.budget_weight * ((p * self._depths).sum() - self.budget_mean) ** 2)
        if self.updates >= self.warmup:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self._refresh()
        self.baseline = self.baseline_decay * self.baseline + (1 - self.baseline_decay) * mean_reward
        self.updates += 1
        out = {"loss": float(loss.detach()), "reward": mean_reward, "baseline": self.baseline,
               "mean_depth": self.mean_depth(), "entropy": self.entropy(), "updates": self.updates}
        if self.scale:
            out["advantage_scale"] = self.advantage_scale  # the s this update used
            self._scale_history = (self._scale_history + [[ce.tolist(), reward.tolist(), ntok.tolist()]]
                                   )[-self.scale_window:]
            self.advantage_scale = self._std_ratio()
        return out

    def _std_ratio(self) -> float:
        """s = max(std(CE), 1e-12) / max(std(u), 1e-12) over the scale window (token-weighted)."""
        ce, reward, ntok = (torch.tensor([v for upd in self._scale_history for v in upd[i]], dtype=torch.float64)
                            for i in range(3))
        w = ntok / ntok.sum()

        def std(x: torch.Tensor) -> float:
            return float((w @ (x - w @ x) ** 2).sqrt())

        return max(std(ce), 1e-12) / max(std(reward), 1e-12)

    def state_dict(self) -> dict:
        """Logits, Adam state, baseline, updates, s and its window (checkpoints fall between steps: no pending obs)."""
        return {"logits": self.logits.detach().clone(), "optimizer": self.optimizer.state_dict(),
                "baseline": self.baseline, "updates": self.updates, "advantage_scale": self.advantage_scale,
                "scale_history": [list(map(list, upd)) for upd in self._scale_history]}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output exactly (ValueError for another R_max)."""
        logits = torch.as_tensor(state["logits"], dtype=torch.float64)
        if logits.shape != self.logits.shape:
            raise ValueError(f"learned prior: checkpoint has R_max={logits.numel()}, config has "
                             f"depth.cap={self.r_max}")
        with torch.no_grad():
            self.logits.copy_(logits)
        self.optimizer.load_state_dict(state["optimizer"])
        self.baseline = state["baseline"]
        self.updates = int(state["updates"])
        self.advantage_scale = float(state["advantage_scale"])
        self._scale_history = [list(map(list, upd)) for upd in state["scale_history"]]
        self._obs = []
        self._refresh()


SAMPLERS = {"fixed": FixedDepth, "uniform": UniformDepth, "pln": PoissonLogNormalDepth,
            "learned": LearnedDepthPrior}


def build_sampler(cfg: DepthConfig) -> DepthSampler:
    """The sampler of the ``depth`` section ``cfg``."""
    return SAMPLERS[cfg.NAME](cfg)
