"""Depth samplers (SPEC §5; PLN from Huginn, arXiv:2502.05171; the learned prior from "Towards Looped
Models Done Right", arXiv:2610.06833, eq. 5–6): one loop depth per microbatch, a pure function of
(seed, step, micro).

Because a draw depends only on (seed, step, micro) — and, for the learned depth prior, on logits that
every rank updates identically — every distributed rank draws the same depth and a resumed run draws
exactly the depths the uninterrupted run would have drawn.

Registry (``SAMPLERS``, keyed by ``depth.sampler``; each built from its config class in
:data:`looplm.config.DEPTH_SAMPLERS`):

- ``fixed``    T = depth.
- ``uniform``  T ~ Uniform{lo..hi}.
- ``pln``      Huginn's Poisson log-normal prior, capped, with μ recalibrated to a target capped mean.
- ``learned``  the learned depth prior of Looped Models Done Right (LMDR §4.1, App. B.3): a categorical
               over 1..R_max initialized to the capped PLN and trained by REINFORCE on the model's CE.

The trainer may call ``observe`` / ``update`` / ``state_dict`` / ``load_state_dict`` on every sampler;
they are no-ops except for the learned prior.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import torch
from scipy import optimize, special, stats

from looplm.config import DepthConfig


def _rng(seed: int, step: int, micro: int, stream: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{stream}:{seed}:{step}:{micro}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _draw_categorical(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from P(R = r) = probs[r-1] by inverting the CDF with a single uniform; returns r >= 1."""
    cdf = np.cumsum(probs)
    r = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")) + 1
    return min(r, len(probs))  # guards u·cdf[-1] == cdf[-1] in floating point


class DepthSampler:
    """Base class: ``sample(seed, step, micro) -> T`` and the largest depth it can return.

    ``observe``/``update``/``state_dict``/``load_state_dict`` are no-ops here so the trainer can call
    them on any sampler; only samplers that learn (``LearnedDepthPrior``) override them.
    """

    name = ""

    def sample(self, seed: int, step: int, micro: int = 0) -> int:
        raise NotImplementedError

    @property
    def max_depth(self) -> int:
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

    name = "fixed"

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth.depth: must be >= 1, got {depth}")
        self.depth = depth

    def sample(self, seed, step, micro=0):
        return self.depth

    @property
    def max_depth(self):
        return self.depth


class UniformDepth(DepthSampler):
    """T ~ Uniform{lo, …, hi} (inclusive); SCSE trains with 1..8."""

    name = "uniform"

    def __init__(self, lo: int, hi: int):
        if not 1 <= lo <= hi:
            raise ValueError(f"depth.lo/hi: need 1 <= lo <= hi, got {lo}..{hi}")
        self.lo, self.hi = lo, hi

    def sample(self, seed, step, micro=0):
        return int(_rng(seed, step, micro, "depth").integers(self.lo, self.hi + 1))

    @property
    def max_depth(self):
        return self.hi


def _normal_nodes(sigma: float, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes z, weights w (each (n,)): Σ w f(z) ≈ E[f(Z)], Z ~ N(0, 1), for f = Poisson(k; e^{μ+σz}).

    Trapezoid rule on z ∈ [−12, 12] (Gaussian mass outside < 1e-32), weights renormalized to sum to 1.
    Poisson(k; e^ξ) has width ≈ 1/√k in ξ, so the step in ξ is at most 1/(8√cap) (and 1/8 in z):
    the trapezoid rule on a smooth integrand that vanishes at both ends converges geometrically once the
    step resolves its narrowest feature. (Gauss–Hermite with a fixed node count does not: its spacing in
    ξ grows with σ — about 4e-4 error at σ = 2 with 160 nodes.)
    """
    h = min(1.0, 1.0 / (sigma * np.sqrt(cap))) / 8.0
    z = np.linspace(-12.0, 12.0, int(np.ceil(24.0 / h)) + 1)
    w = np.exp(-0.5 * z**2)
    w[[0, -1]] *= 0.5
    return z, w / w.sum()


def pln_pmf(mu: float, sigma: float, cap: int) -> np.ndarray:
    """P(R = r) for r = 1..cap of the capped Poisson log-normal (SPEC §5; LMDR eq. 5).

    ξ ~ N(μ, σ²), K | ξ ~ Poisson(e^ξ), R = min(K + 1, cap).
    P(K = k) = ∫ Poisson(k; e^ξ) N(ξ; μ, σ²) dξ by quadrature over ξ (``_normal_nodes``); all tail mass
    P(K >= cap − 1) lands on r = cap (integrated as the Poisson survival function, so the pmf sums to 1
    to rounding).

    Returns:
        float64 array of shape (cap,).
    """
    z, w = _normal_nodes(sigma, cap)
    log_lam = mu + sigma * z  # (nodes,)
    lam = np.exp(log_lam)
    k = np.arange(cap - 1)  # K = 0..cap-2  ->  R = 1..cap-1
    log_pois = k[None, :] * log_lam[:, None] - lam[:, None] - special.gammaln(k + 1)[None, :]  # (nodes, cap-1)
    body = w @ np.exp(log_pois)  # (cap-1,)
    tail = w @ stats.poisson.sf(cap - 2, lam)  # P(K > cap-2) = P(R >= cap)
    return np.append(body, tail)


class PoissonLogNormalDepth(DepthSampler):
    """Huginn's capped Poisson log-normal depth prior (SPEC §5 ``pln``; LMDR eq. 5 and App. B.3).

    ξ ~ N(μ, σ²), K ~ Poisson(exp ξ), R = min(K + 1, cap), with μ solved (``scipy.optimize.brentq``) so
    that E[min(R, cap)] = ``mean`` exactly under ``pmf()``.

    Attributes:
        mu: the recalibrated location μ of ξ (nats of log-rate).

    Raises:
        ValueError: naming ``depth.cap`` (cap < 2), ``depth.sigma`` (σ <= 0) or
            ``depth.mean`` (mean outside (1, cap)).
    """

    name = "pln"

    def __init__(self, mean: float, sigma: float, cap: int):
        if cap < 2:
            raise ValueError(f"depth.cap: pln needs cap >= 2, got {cap}")
        if not sigma > 0:
            raise ValueError(f"depth.sigma: must be > 0, got {sigma}")
        if not 1 < mean < cap:
            raise ValueError(f"depth.mean: pln needs 1 < mean < depth.cap={cap}, got {mean}")
        self.mean, self.sigma, self.cap = float(mean), float(sigma), int(cap)
        self.mu = self._solve_mu()
        self._pmf = pln_pmf(self.mu, self.sigma, self.cap)

    def _capped_mean(self, mu: float) -> float:
        return float(np.arange(1, self.cap + 1) @ pln_pmf(mu, self.sigma, self.cap))

    def _solve_mu(self) -> float:
        # E[min(R, cap)] rises monotonically in μ from 1 (μ → −∞) to cap (μ → +∞).
        lo, hi = -40.0, np.log(self.cap) + 10.0 + 10.0 * self.sigma
        f = lambda mu: self._capped_mean(mu) - self.mean  # noqa: E731
        if f(lo) > 0 or f(hi) < 0:
            raise ValueError(f"depth.mean: cannot reach capped mean {self.mean} with "
                             f"σ={self.sigma}, cap={self.cap}")
        return float(optimize.brentq(f, lo, hi, xtol=1e-14, rtol=1e-14, maxiter=500))

    def pmf(self) -> np.ndarray:
        """P(R = r) for r = 1..cap, float64 array of shape (cap,)."""
        return self._pmf.copy()

    def sample(self, seed, step, micro=0):
        rng = _rng(seed, step, micro, "depth")
        xi = rng.normal(self.mu, self.sigma)
        return int(min(rng.poisson(np.exp(xi)) + 1, self.cap))

    @property
    def max_depth(self):
        return self.cap


# Reward arms u = ω(CE) of the learned prior (SPEC §5; LMDR App. B.3 "Alternative prior signals").
# CE in nats per token; log_ce floors CE at 1e-12 as the paper does.
REWARDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg_ce": lambda ce: -ce,
    "log_ce": lambda ce: -torch.log(ce.clamp_min(1e-12)),
    "exp_ce": lambda ce: -torch.exp(ce),
    "inv_ppl": lambda ce: torch.exp(-ce),
}


class LearnedDepthPrior(DepthSampler):
    """The learned depth prior (SPEC §5 ``learned``; LMDR §4.1 eq. 6, App. B.3).

    A categorical p_φ over depths 1..R_max with float64 logits φ, initialized to log p_PLN of
    ``PoissonLogNormalDepth(budget_mean, sigma, r_max)`` (or to ``init``, normalized), trained by its own Adam
    (betas (0.9, 0.999), no weight decay) on

        J(φ) = −Ê_n[sg(A_n) log p_φ(r_n)] − λ_H H(p_φ) + λ_m (E_p[R] − R̄)²,

    with Ê_n the token-weighted mean over the step's microbatches n (weights N_n / Σ N, LMDR App. B.3),
    u_n = ω(CE_n) the reward arm of the microbatch's token-weighted mean CE, and A_n = u_n − b.

    Our choices (not fixed by the paper): the baseline b is one scalar (not per depth), an exponential
    moving average of the step's token-weighted mean reward with decay ``baseline_decay`` = 0.9,
    initialized to the first step's mean reward; A_n uses b from *before* the current step is folded in.
    The first ``warmup`` updates only move b (and s); the logits and the Adam state stay untouched.

    Advantage scale (``scale=True``; LMDR App. B.3, "A_i = s_{n−1}(u_i − û_{n−1})"): A_n is multiplied by
    s = max(std(CE), 1e-12) / max(std(u), 1e-12), the ratio of the CE and reward standard deviations over
    the microbatches of the *previous* ``scale_window`` updates (the paper: the previous update), so a
    reward arm moves the prior at the rate raw CE would. s starts at 1. Our choices: the stds are
    token-weighted (weights N_n / Σ N, as Ê_n) population stds; a window W > 1 pools the last W updates'
    microbatches (with one microbatch per update a single update's stds are 0 and s stays 1). For
    ``neg_ce`` s is exactly 1.

    Protocol per optimizer step: ``sample`` once per microbatch, ``observe`` once per microbatch after
    its forward, then ``update`` once. Between updates the logits are frozen, so draws stay a pure
    function of (seed, step, micro) given the logits.

    Args:
        budget_mean: R̄ (depth.mean), also the PLN initialization's capped mean.
        sigma: σ of the PLN initialization (depth.sigma).
        r_max: R_max (depth.cap).
        lr, entropy_weight, budget_weight, warmup, reward: depth.lr, entropy (λ_H), budget (λ_m),
            warmup, reward.
        scale, scale_window: depth.scale, scale_window (the advantage scale s above).
        init: depth.init, the initial weights over 1..R_max (normalized); None or [] = the PLN.

    Raises:
        ValueError: bad arguments, naming the depth.* field.
    """

    name = "learned"

    def __init__(self, budget_mean: float, sigma: float, r_max: int, *, lr: float = 1e-3,
                 entropy_weight: float = 0.01, budget_weight: float = 1.0, warmup: int = 32,
                 reward: str = "neg_ce", baseline_decay: float = 0.9, scale: bool = False, scale_window: int = 1,
                 init: list[float] | None = None):
        if reward not in REWARDS:
            raise ValueError(f"depth.reward: unknown {reward!r}; known: {', '.join(REWARDS)}")
        if not lr > 0:
            raise ValueError(f"depth.lr: must be > 0, got {lr}")
        if entropy_weight < 0 or budget_weight < 0:
            raise ValueError(f"depth.entropy/budget: must be >= 0, got "
                             f"{entropy_weight}/{budget_weight}")
        if warmup < 0:
            raise ValueError(f"depth.warmup: must be >= 0, got {warmup}")
        if not 0 <= baseline_decay < 1:
            raise ValueError(f"baseline_decay: must be in [0, 1), got {baseline_decay}")
        if scale_window < 1:
            raise ValueError(f"depth.scale_window: must be >= 1, got {scale_window}")
        pln = PoissonLogNormalDepth(budget_mean, sigma, r_max).pmf()  # validates mean/σ/cap
        if init:
            w = np.asarray(init, dtype=np.float64)
            if w.shape != (r_max,) or not (np.isfinite(w) & (w > 0)).all():
                raise ValueError(f"depth.init: need {r_max} finite weights > 0, got {list(init)}")
        init = w / w.sum() if init else pln
        self.r_max, self.budget_mean = int(r_max), float(budget_mean)
        self.entropy_weight, self.budget_weight = float(entropy_weight), float(budget_weight)
        self.warmup, self.reward, self.baseline_decay = int(warmup), reward, float(baseline_decay)
        self.logits = torch.nn.Parameter(torch.from_numpy(np.log(init)))  # (R_max,) float64
        self.optimizer = torch.optim.Adam([self.logits], lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.baseline: float | None = None
        self.updates = 0
        self.scale, self.scale_window = bool(scale), int(scale_window)
        self.advantage_scale = 1.0  # s, from the previous updates (1 until there are any)
        self._scale_history: list[list[list[float]]] = []  # per update: [CE (M), reward (M), tokens (M)]
        self._obs: list[tuple[int, float, int]] = []  # (depth, mean CE in nats, tokens) per microbatch
        self._depths = torch.arange(1, self.r_max + 1, dtype=torch.float64)  # (R_max,)
        self._refresh()

    def _refresh(self) -> None:
        # Cache p_φ as numpy: it changes only in update/load_state_dict, and sample() runs per microbatch.
        with torch.no_grad():
            self._probs = torch.softmax(self.logits, 0).numpy().copy()

    # --- the distribution -------------------------------------------------------------------------

    def probs(self) -> np.ndarray:
        """p_φ(r) for r = 1..R_max, float64 array of shape (R_max,)."""
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
        return _draw_categorical(self._probs, _rng(seed, step, micro, "depth"))

    @property
    def max_depth(self):
        return self.r_max

    # --- learning ---------------------------------------------------------------------------------

    def observe(self, depth: int, ce: float, n_tokens: int) -> None:
        """Record one microbatch: its depth, token-weighted mean CE (nats/token) and token count.

        Raises:
            ValueError: depth outside 1..R_max or n_tokens < 1.
        """
        if not 1 <= depth <= self.r_max:
            raise ValueError(f"learned prior: depth {depth} outside 1..{self.r_max}")
        if n_tokens < 1:
            raise ValueError(f"learned prior: n_tokens must be >= 1, got {n_tokens}")
        self._obs.append((int(depth), float(ce), int(n_tokens)))

    def update(self, reduce=None):
        """Fold the observations since the last update into one step of J; clears them.

        Distributed use: every rank observes the same number of microbatches in the same order with the
        same depths (depths come from (seed, step, micro)). ``reduce`` maps a 1-D float64 tensor to its
        sum over ranks (e.g. an all-reduce); it is applied to the per-microbatch statistics
        [N_n·CE_n (M), N_n (M), r_n (M), 1] so that every rank sees the *global* microbatch n (its
        token-weighted mean CE over all ranks and its total tokens) before the nonlinear reward is
        applied, and all ranks take the identical step. The summed depths and rank count check that
        the ranks agreed on the depths.

        Returns:
            {} when nothing was observed; else {"loss": J before the step, "reward": token-weighted
            mean reward, "baseline": b after the step, "mean_depth": E_p[R], "entropy": H(p) in nats,
            "updates": count} with E_p[R] and H measured after the step.

        Raises:
            RuntimeError: the ranks disagreed on the microbatch depths.
        """
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
        """s = max(std(CE), 1e-12) / max(std(u), 1e-12) over the microbatches in the scale window
        (token-weighted population stds)."""
        ce, reward, ntok = (torch.tensor([v for upd in self._scale_history for v in upd[i]], dtype=torch.float64)
                            for i in range(3))
        w = ntok / ntok.sum()

        def std(x: torch.Tensor) -> float:
            return float((w @ (x - w @ x) ** 2).sqrt())

        return max(std(ce), 1e-12) / max(std(reward), 1e-12)

    # --- checkpointing ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Logits, Adam state, baseline, update count and the advantage scale s with its window
        (torch.save-able); pending observations are not saved — checkpoints are written between
        optimizer steps, when there are none."""
        return {"logits": self.logits.detach().clone(), "optimizer": self.optimizer.state_dict(),
                "baseline": self.baseline, "updates": self.updates, "advantage_scale": self.advantage_scale,
                "scale_history": [list(map(list, upd)) for upd in self._scale_history]}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output exactly.

        Raises:
            ValueError: the saved logits have a different R_max.
        """
        logits = torch.as_tensor(state["logits"], dtype=torch.float64)
        if logits.shape != self.logits.shape:
            raise ValueError(f"learned prior: checkpoint has R_max={logits.numel()}, config has "
                             f"depth.cap={self.r_max}")
        with torch.no_grad():
            self.logits.copy_(logits)
        self.optimizer.load_state_dict(state["optimizer"])
        self.baseline = state["baseline"]
        self.updates = int(state["updates"])
        self.advantage_scale = float(state.get("advantage_scale", 1.0))  # checkpoints before depth.scale: 1
        self._scale_history = [list(map(list, upd)) for upd in state.get("scale_history", [])]
        self._obs = []
        self._refresh()


SAMPLERS = {"fixed": FixedDepth, "uniform": UniformDepth, "pln": PoissonLogNormalDepth,
            "learned": LearnedDepthPrior}


def build_sampler(cfg: DepthConfig) -> DepthSampler:
    """The sampler of the ``depth`` section ``cfg`` (its class named by ``cfg.NAME``).

    Raises:
        ValueError: invalid sampler arguments (names the depth.* field).
    """
    if cfg.NAME == "fixed":
        return FixedDepth(cfg.depth)
    if cfg.NAME == "uniform":
        return UniformDepth(cfg.lo, cfg.hi)
    if cfg.NAME == "pln":
        return PoissonLogNormalDepth(cfg.mean, cfg.sigma, cfg.cap)
    return LearnedDepthPrior(cfg.mean, cfg.sigma, cfg.cap, lr=cfg.lr, entropy_weight=cfg.entropy,
                             budget_weight=cfg.budget, warmup=cfg.warmup, reward=cfg.reward, scale=cfg.scale,
                             scale_window=cfg.scale_window, init=cfg.init)
