"""Residual parameterizations (SPEC §3, DeepNet / DeepLoop): α and β against the papers' formulas, the
DeepLoop identities, the initialized standard deviations, the Post-LN block against a hand-written
one, the plain rule's input RMSNorm, and configuration errors."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.config import Config, ConfigError, FixedDepthConfig, ModelConfig, PLNDepthConfig, UniformDepthConfig
from looplm.model import build_model
from looplm.model.cursor import Readout


def cfg(**kw) -> ModelConfig:
    base = dict(rule="plain", vocab_size=64, d_model=256, n_heads=4, d_ff=512, seq_len=8, dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("K, R", [(1, 1), (2, 3), (4, 5), (12, 4)])
@pytest.mark.parametrize("residual, p", [("deepnorm", 0.25), ("deeploop", 0.5), ("post_ln", 0.0)])
def test_alpha_beta_match_the_formulas(K, R, residual, p):
    alpha, beta = cfg(n_core=K, residual=residual, residual_depth=R).residual_alpha_beta
    N = K * R
    assert alpha == pytest.approx((2 * N) ** p, rel=1e-12)
    assert beta == pytest.approx((8 * N) ** (-p), rel=1e-12)


@pytest.mark.parametrize("K, R", [(1, 3), (2, 3), (4, 5), (8, 4)])
def test_deeploop_identities(K, R):
    """β/α = 1/(4N) and M·R·(β/α)² = 1/(8K) with M = 2N sublayer visits (DeepLoop, SPEC §3)."""
    alpha, beta = cfg(n_core=K, residual="deeploop", residual_depth=R).residual_alpha_beta
    N = K * R
    assert beta / alpha == pytest.approx(1 / (4 * N), rel=1e-12)
    assert (2 * N) * R * (beta / alpha) ** 2 == pytest.approx(1 / (8 * K), rel=1e-12)


def test_explicit_exponent_and_pre_ln():
    alpha, beta = cfg(residual="post_ln", residual_p=0.4, residual_depth=3, n_core=2).residual_alpha_beta
    assert (alpha, beta) == pytest.approx((12 ** 0.4, 48 ** -0.4))
    assert cfg().residual_alpha_beta == (1.0, 1.0)


def test_residual_depth_follows_the_training_sampler():
    """residual_depth = 0: the model builder takes R of N = K·R from the depth sampler's maximum; the config
    keeps 0 (no section rewrites another); an explicit R wins."""
    from looplm.model import build_model

    for depth, R in [(FixedDepthConfig(depth=3), 3), (UniformDepthConfig(hi=6), 6), (PLNDepthConfig(cap=32), 32)]:
        c = Config(model=cfg(residual="deeploop"), depth=depth)
        assert c.model.residual_depth == 0 and build_model(c).cfg.residual_depth == R
    c = Config(model=cfg(residual="deeploop", residual_depth=7))
    assert build_model(c).cfg.residual_depth == 7


def test_initialized_standard_deviations():
    """β scales the value, output and MLP matrices once; q and k keep init_std (SPEC §3)."""
    torch.manual_seed(0)
    c = cfg(residual="deeploop", residual_depth=3, n_core=2)
    _, beta = c.residual_alpha_beta
    m = build_model(c)
    d, s = c.d_model, c.init_std
    for blk in m.core.blocks:
        w = blk.attn.qkv.weight
        assert w[:d].std().item() == pytest.approx(s, rel=0.03)  # q
        assert w[d:2 * d].std().item() == pytest.approx(s, rel=0.03)  # k
        assert w[2 * d:].std().item() == pytest.approx(s * beta, rel=0.03)  # v
        f = c.d_ff
        for w in (blk.attn.proj.weight, blk.mlp.gate_up.weight[:f], blk.mlp.gate_up.weight[f:], blk.mlp.down.weight):
            assert w.std().item() == pytest.approx(s * beta, rel=0.03)  # gate, up (fused) and down
    assert m.tok_emb.weight.std().item() == pytest.approx(s, rel=0.03)
    # pre-LN keeps GPT-2's 1/sqrt(2·blocks) on the output projections and no β
    torch.manual_seed(0)
    pre = build_model(cfg(n_core=2))
    blk = pre.core.blocks[0]
    assert blk.attn.qkv.weight[2 * d:].std().item() == pytest.approx(s, rel=0.03)
    assert blk.attn.proj.weight.std().item() == pytest.approx(s / math.sqrt(4), rel=0.03)


def test_post_ln_block_matches_hand_written_formula():
    torch.manual_seed(0)
    c = cfg(residual="deepnorm", residual_depth=2, d_model=32, n_heads=2, d_ff=64)
    m = build_model(c).eval()
    alpha, _ = c.residual_alpha_beta
    blk = m.core.blocks[0]
    x = torch.randn(2, 8, 32)

    def rms(z):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + c.norm_eps)

    x1 = rms(alpha * x + blk.attn(x)) * blk.norm1.weight
    x2 = rms(alpha * x1 + blk.mlp(x1)) * blk.norm2.weight
    assert torch.allclose(x + blk(x), x2, atol=1e-6)
    assert torch.equal(blk(torch.zeros_like(x)), torch.zeros_like(x))  # exact: still zero-preserving


def test_plain_rule_with_input_norm_normalizes_the_embedding():
    torch.manual_seed(0)
    m = build_model(cfg(input_norm=True, d_model=32, n_heads=2, d_ff=64)).eval()
    x = torch.randint(0, 64, (2, 8))
    e = m.embed(x)
    assert torch.allclose(e.pow(2).mean(-1), torch.ones(2, 8), atol=5e-3)  # eps = 1e-6 vs mean(e²) ≈ 8e-4
    out = m(x, 0, readout=Readout(states=True))
    assert torch.equal(out.states[0], e)  # exact: h_0 = e, no op


def test_bad_residual_config_names_the_field():
    with pytest.raises(ConfigError, match="model.residual"):
        ModelConfig(residual="sandwich")
    with pytest.raises(ConfigError, match="model.residual_p"):
        ModelConfig(residual="post_ln", residual_p=3.0)
    with pytest.raises(ConfigError, match="model.residual_depth"):
        build_model(cfg(residual="deeploop"))  # no R: built without a training config
    with pytest.raises(ConfigError, match="model.residual"):
        ModelConfig(architecture="unshared", residual="deeploop")
