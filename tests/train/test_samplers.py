"""Depth samplers (SPEC §5): capped Poisson log-normal and the learned depth prior (LMDR §4.1, App. B.3)."""

import copy
import io
import math

import numpy as np
import pytest
import torch

from looplm.config import (Config, ConfigError, DepthConfig, FixedDepthConfig, LearnedDepthConfig, PLNDepthConfig,
                           apply_overrides)
from looplm.train.samplers import (REWARDS, SAMPLERS, FixedDepth, LearnedDepthPrior, PoissonLogNormalDepth,
                                   UniformDepth, build_sampler)

CAP = 64
DEPTHS = np.arange(1, CAP + 1)


def learned(mean: float = 5.0, cap: int = CAP, **kw) -> LearnedDepthPrior:
    """The learned prior of ``depth.sampler=learned`` with σ = 0.5 and the other depth.* fields ``kw``."""
    return LearnedDepthPrior(LearnedDepthConfig(mean=mean, sigma=0.5, cap=cap, **kw))


@pytest.fixture(scope="module")
def pln():
    return PoissonLogNormalDepth(PLNDepthConfig(mean=5.0, sigma=0.5, cap=CAP))


# --- Poisson log-normal -------------------------------------------------------------------------------


def test_pln_capped_mean_hits_target(pln):
    pmf = pln.pmf()
    assert pmf.shape == (CAP,) and (pmf > 0).all()
    assert abs(pmf.sum() - 1) < 1e-12
    assert abs(DEPTHS @ pmf - 5.0) < 1e-6  # analytic E[min(R, 64)]
    draws = np.array([pln.sample(0, step) for step in range(100_000)])
    assert draws.min() >= 1 and draws.max() <= CAP
    print(f"PLN-5: mu={pln.mu:.6f}, Monte-Carlo capped mean {draws.mean():.4f} (target 5)")
    assert abs(draws.mean() - 5.0) < 0.02 * 5.0


def test_pln_pmf_matches_direct_numpy_monte_carlo(pln):
    # Independent of the sampler: draw ξ, K, R directly with numpy at the recalibrated μ.
    n = 1_000_000
    rng = np.random.default_rng(1234)
    k = rng.poisson(np.exp(rng.normal(pln.mu, 0.5, n)))
    hist = np.bincount(np.minimum(k + 1, CAP), minlength=CAP + 1)[1:] / n
    pmf = pln.pmf()
    tol = 5 * np.sqrt(pmf * (1 - pmf) / n) + 1e-5  # 5 binomial standard errors per bin
    print(f"max |hist - pmf| = {np.abs(hist - pmf).max():.2e}, mean = {np.abs(hist - pmf).mean():.2e}")
    assert (np.abs(hist - pmf) < tol).all()


def test_pln_draws_are_a_function_of_seed_step_micro(pln):
    draws = [pln.sample(0, step, micro) for step in range(500) for micro in range(2)]
    assert draws == [pln.sample(0, step, micro) for step in range(500) for micro in range(2)]
    assert draws[0::2] != draws[1::2]  # micro matters
    assert len(set(draws[0::2])) > 5  # steps differ
    assert draws != [pln.sample(1, step, micro) for step in range(500) for micro in range(2)]


@pytest.mark.parametrize("kwargs, field", [
    (dict(mean=1.0, sigma=0.5, cap=64), "depth.mean"),
    (dict(mean=64.0, sigma=0.5, cap=64), "depth.mean"),
    (dict(mean=5.0, sigma=0.0, cap=64), "depth.sigma"),
    (dict(mean=1.5, sigma=0.5, cap=1), "depth.cap"),
])
def test_pln_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoissonLogNormalDepth(PLNDepthConfig(**kwargs))


# --- registry -------------------------------------------------------------------------------------------


def test_registry_matches_config_and_builds_every_sampler():
    assert list(SAMPLERS) == list(DepthConfig.VARIANTS)
    expected = {"fixed": (FixedDepth, 8), "uniform": (UniformDepth, 8), "pln": (PoissonLogNormalDepth, CAP),
                "learned": (LearnedDepthPrior, CAP)}
    for name, (cls, max_depth) in expected.items():
        cfg = DepthConfig.VARIANTS[name]()
        s = build_sampler(cfg)
        assert type(s) is cls and cfg.max_depth() == max_depth
        assert 1 <= s.sample(0, 0) <= max_depth
    fixed = FixedDepth(FixedDepthConfig(depth=3))  # the trainer calls the learning hooks on any sampler
    fixed.observe(3, 2.0, 10)
    assert fixed.update() == {} and fixed.state_dict() == {}


# --- learned depth prior --------------------------------------------------------------------------------


def _train(prior, ce_of_depth, steps, *, first_step=0, micro=4, n_tokens=(1000, 600, 1400, 1000), reduce=None):
    """Simulated trainer loop: one draw + observe per microbatch, one update per step; returns the draws."""
    draws = []
    for step in range(first_step, first_step + steps):
        for m in range(micro):
            r = prior.sample(0, step, m)
            prior.observe(r, ce_of_depth(r), n_tokens[m])
            draws.append(r)
        prior.update(reduce)
    return draws


def test_learned_prior_starts_at_pln(pln):
    prior = learned()
    np.testing.assert_allclose(prior.probs(), pln.pmf(), rtol=1e-12, atol=0)
    assert abs(prior.mean_depth() - 5.0) < 1e-9 and prior.r_max == CAP
    assert prior.logits.dtype == torch.float64


def test_learned_prior_gradient_matches_closed_form():
    # ∂J/∂φ_r = −Σ_n w_n A_n (1[r = r_n] − p_r) + λ_H p_r (log p_r + H)
    #           + 2 λ_m (E_p[R] − R̄) p_r (r − E_p[R])
    # (softmax score function; LMDR App. B.3 gives ∂H/∂φ_r = −p_r (log p_r + H)).
    prior = learned(entropy=0.3, budget=2.0, warmup=1)
    prior.observe(4, 3.0, 100)
    prior.update()  # warm-up: baseline = −3.0
    p0 = prior.probs()
    obs = [(2, 2.5, 100), (7, 3.5, 300), (2, 2.0, 100)]
    for o in obs:
        prior.observe(*o)
    prior.update()
    w = np.array([n for _, _, n in obs], float) / 500
    adv = -np.array([ce for _, ce, _ in obs]) - (-3.0)
    onehot = np.eye(CAP)[[r - 1 for r, _, _ in obs]]
    H, mean = -(p0 * np.log(p0)).sum(), DEPTHS @ p0
    grad = (-(w * adv) @ (onehot - p0) + 0.3 * p0 * (np.log(p0) + H)
            + 2 * 2.0 * (mean - 5.0) * p0 * (DEPTHS - mean))
    got = prior.logits.grad.numpy()
    print(f"max |autograd - closed form| = {np.abs(got - grad).max():.2e}")
    np.testing.assert_allclose(got, grad, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("slope", [0.0, 0.05])  # flat CE, and CE falling 0.05 nats per extra loop step
def test_budget_keeps_mean_depth_near_target(slope):
    prior = learned(budget=1.0)
    _train(prior, lambda r: 3.0 - slope * r, 300)
    print(f"slope {slope}: E_p[R] after 300 updates = {prior.mean_depth():.4f} (R̄ = 5)")
    assert prior.updates == 300
    assert abs(prior.mean_depth() - 5.0) < 1.0


def test_strong_reward_pulls_prior_toward_rewarded_depth():
    prior = learned(budget=0.0, lr=1e-2)
    before = prior.probs()[9]
    _train(prior, lambda r: 2.0 if r == 10 else 4.0, 300)
    after = prior.probs()
    print(f"p(10): {before:.4f} -> {after[9]:.4f}")
    assert after[9] > 3 * before and after.argmax() == 9


def test_warmup_sets_baseline_without_moving_logits():
    prior = learned(warmup=3, reward="log_ce")
    logits0 = prior.logits.detach().clone()
    mean_ce = [2.0, 4.0, 3.0]  # token-weighted mean CE of each step's two microbatches
    for ce in mean_ce:
        prior.observe(1, ce - 1.0, 100)
        prior.observe(2, ce + 0.5, 200)
        assert prior.update()["updates"] >= 1
    # Reward is per microbatch (log_ce: −log CE), then token-weighted.
    rewards = [(-np.log(ce - 1.0) - 2 * np.log(ce + 0.5)) / 3 for ce in mean_ce]
    b = rewards[0]
    for u in rewards:
        b = 0.9 * b + 0.1 * u
    assert torch.equal(prior.logits.detach(), logits0)  # exact: no update yet
    assert prior.baseline == pytest.approx(b, rel=1e-12)
    prior.observe(3, 1.0, 100)
    prior.update()  # first real update
    assert not torch.equal(prior.logits.detach(), logits0)


def test_reward_arms():
    ce = torch.tensor([2.0], dtype=torch.float64)
    got = {k: float(f(ce)) for k, f in REWARDS.items()}
    assert got == pytest.approx({"neg_ce": -2.0, "log_ce": -np.log(2.0), "exp_ce": -np.exp(2.0),
                                 "inv_ppl": np.exp(-2.0)}, rel=1e-15)


def _wstd(x, n):
    """Token-weighted population std, by hand."""
    w = [k / sum(n) for k in n]
    m = sum(wi * xi for wi, xi in zip(w, x))
    return math.sqrt(sum(wi * (xi - m) ** 2 for wi, xi in zip(w, x)))


def test_advantage_scale_by_hand():
    """inv_ppl with s (LMDR App. B.3): update n uses s_{n−1} = std(CE)/std(u) of update n−1's microbatches
    (token-weighted), s_0 = 1; the prior loss of update 2 is −Σ w_n s_1 (u_n − b_1) log p(r_n)."""
    prior = learned(entropy=0.0, budget=0.0, warmup=0, reward="inv_ppl", scale=True)
    obs1 = [(2, 2.0, 100), (6, 3.0, 300)]
    for o in obs1:
        prior.observe(*o)
    m1 = prior.update()
    assert m1["advantage_scale"] == 1.0  # s starts at one
    ce1, n1 = [c for _, c, _ in obs1], [n for _, _, n in obs1]
    u1 = [math.exp(-c) for c in ce1]
    s1 = _wstd(ce1, n1) / _wstd(u1, n1)
    assert prior.advantage_scale == pytest.approx(s1, rel=1e-12)
    # two microbatches: s = |ΔCE|/|Δu| = 1/(e^−2 − e^−3) ≈ 11.69, the reward's slope in CE units
    assert s1 == pytest.approx(1 / (math.exp(-2) - math.exp(-3)), rel=1e-12)
    b1 = sum(n * u for n, u in zip(n1, u1)) / sum(n1)  # b_0 = mean u_1, then 0.9·b_0 + 0.1·mean u_1
    logp = torch.log_softmax(prior.logits.detach(), 0).numpy()
    obs2 = [(3, 2.5, 200), (9, 4.0, 200)]
    for o in obs2:
        prior.observe(*o)
    m2 = prior.update()
    want = -sum(0.5 * s1 * (math.exp(-c) - b1) * logp[r - 1] for r, c, _ in obs2)
    assert m2["advantage_scale"] == pytest.approx(s1, rel=1e-12)
    assert m2["loss"] == pytest.approx(want, rel=1e-10)
    # window 2 pools both updates' microbatches
    ce12, n12 = ce1 + [2.5, 4.0], n1 + [200, 200]
    wide = learned(reward="inv_ppl", scale=True, scale_window=2)
    for obs in (obs1, obs2):
        for o in obs:
            wide.observe(*o)
        wide.update()
    assert wide.advantage_scale == pytest.approx(_wstd(ce12, n12) / _wstd([math.exp(-c) for c in ce12], n12),
                                                 rel=1e-12)


def test_advantage_scale_is_one_for_neg_ce_and_single_microbatches():
    """neg_ce: std(CE) = std(−CE), so s = 1 exactly and the run is identical to the unscaled one; one
    microbatch per update (window 1): both stds are 0, floored at 1e-12, s = 1."""
    a = learned(warmup=2, lr=1e-2, scale=True)
    b = learned(warmup=2, lr=1e-2)
    assert _train(a, lambda r: 3.0 - 0.05 * r, 10) == _train(b, lambda r: 3.0 - 0.05 * r, 10)
    assert a.advantage_scale == 1.0 and torch.equal(a.logits.detach(), b.logits.detach())  # exact: same updates
    one = learned(reward="inv_ppl", scale=True)
    _train(one, lambda r: 3.0 - 0.05 * r, 5, micro=1)
    assert one.advantage_scale == 1.0


def test_advantage_scale_resumes_exactly():
    cfg = dict(warmup=2, lr=1e-2, reward="inv_ppl", scale=True, scale_window=3)
    a = learned(**cfg)
    _train(a, lambda r: 3.0 + 0.1 * abs(r - 7), 6)
    b = learned(**cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert _train(a, lambda r: 3.0 + 0.1 * abs(r - 7), 6, first_step=6) == \
        _train(b, lambda r: 3.0 + 0.1 * abs(r - 7), 6, first_step=6)
    # exact: same updates
    assert a.advantage_scale == b.advantage_scale != 1.0 and torch.equal(a.logits.detach(), b.logits.detach())
    t = LearnedDepthConfig(reward="inv_ppl", scale=True, scale_window=4)
    built = build_sampler(t)
    assert built.scale and built.scale_window == 4 and built.reward == "inv_ppl"
    with pytest.raises(ConfigError, match="depth.scale_window: must be >= 1"):
        LearnedDepthConfig(scale_window=0)


def test_state_dict_round_trip_resumes_exactly():
    def ce(r):
        return 3.0 + 0.1 * abs(r - 7)

    cfg = dict(warmup=5, lr=1e-2)
    a = learned(**cfg)
    _train(a, ce, 20)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # as the checkpoint writes train_state.pt
    buf.seek(0)
    b = learned(**cfg)
    b.load_state_dict(torch.load(buf, weights_only=False))
    draws_a = _train(a, ce, 20, first_step=20)
    draws_b = _train(b, ce, 20, first_step=20)
    assert draws_a == draws_b
    assert torch.equal(a.logits.detach(), b.logits.detach()) and a.baseline == b.baseline  # exact: same updates
    assert a.updates == b.updates == 40
    with pytest.raises(ValueError, match="depth.cap"):
        learned(cap=32).load_state_dict(a.state_dict())


def test_reduce_hook_two_identical_ranks_equals_single_process():
    def ce(r):
        return 3.0 - 0.05 * r

    single = learned(warmup=2, lr=1e-2)
    ranks = copy.deepcopy(single)
    d1 = _train(single, ce, 10)
    d2 = _train(ranks, ce, 10, reduce=lambda t: 2 * t)  # fake all-reduce over 2 ranks with equal stats
    assert d1 == d2 and single.baseline == ranks.baseline
    assert torch.equal(single.logits.detach(), ranks.logits.detach())  # exact: ×2 then /2 is exact

    # A rank that drew a different depth for a microbatch is caught.
    ranks.observe(3, 3.0, 10)
    with pytest.raises(RuntimeError, match="different depths"):
        ranks.update(lambda t: t + torch.tensor([30.0, 10.0, 4.0, 1.0], dtype=torch.float64))


def test_learned_prior_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="depth.reward"):
        learned(reward="bogus")
    with pytest.raises(ValueError, match="depth.mean"):
        learned(70.0)
    with pytest.raises(ValueError, match="learned prior: depth"):
        learned().observe(65, 3.0, 10)


@pytest.mark.parametrize("cap,mean", [(64, 32.5), (10, 5.5)])
def test_uniform_control_prior_init(cap, mean):
    """LMDR App. B.3's uniform controls: U_{1:64} starts with mean 32.50, U_{1:10} with 5.50 (the paper's
    numbers); depth.init = cap ones through the config path. Exact up to float64 rounding of a 64-term sum."""
    cfg = apply_overrides(Config(), {"depth.sampler": "learned", "depth.cap": str(cap), "depth.init": ",".join(["1"] * cap)})
    prior = build_sampler(cfg.depth)
    np.testing.assert_allclose(prior.probs(), np.full(cap, 1.0 / cap), rtol=1e-12)
    assert prior.mean_depth() == pytest.approx(mean, rel=1e-12)


def test_prior_init_weights_normalized_and_frozen_through_warmup():
    """depth.init weights w give p = w / Σw; with depth.warmup >= the updates (the frozen-prior ablation) the
    logits never move. Same float64 computation on both sides up to the softmax's rounding."""
    w = np.arange(1.0, CAP + 1.0)
    prior = learned(init=list(w), warmup=3, lr=1.0)
    np.testing.assert_allclose(prior.probs(), w / w.sum(), rtol=1e-12)
    before = prior.logits.detach().clone()
    for step in range(3):
        prior.observe(prior.sample(0, step), 4.0 + step, 100)
        prior.update()
    assert torch.equal(prior.logits.detach(), before)


def test_prior_init_errors():
    with pytest.raises(ConfigError, match=r"depth\.init: needs depth\.cap=8 weights, got 3"):
        LearnedDepthConfig(mean=5.0, cap=8, init=[1, 1, 1])
    with pytest.raises(ConfigError, match=r"depth\.init: weights must be finite numbers > 0"):
        LearnedDepthConfig(mean=2.0, cap=3, init=[1, 0, 1])
    with pytest.raises(ConfigError, match=r"depth\.init: sampler pln does not read it \(a field of learned\)"):
        apply_overrides(Config(), {"depth.sampler": "pln", "depth.init": "1,1,1"})
