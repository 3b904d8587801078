"""Model tests: every registered rule against an explicitly unrolled reference, shapes, gradients,
causality, the forcing bias of each rule family (exactly zero for SCSE, the masked SC-Cond family and
the subtractive controls in eval mode), core calls per step vs the FLOP proxy, and multi-depth readout
vs separate runs."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.analysis.flops import BODY_CALLS_PER_STEP, body_applications
from looplm.config import RULE_NAMES, RULE_OPTIONS
from looplm.diagnostics.forcing import forcing_profile
from looplm.model import RULES, LoopLM, build_model
from looplm.model.layers import sinusoidal_step_embedding
from looplm.model.cursor import Readout

from helpers import D, L, V, VARIANTS, make, tiny, tokens


def test_registry_matches_config_literal():
    assert set(RULES) == set(RULE_NAMES)
    with pytest.raises(Exception, match="allowed"):
        tiny(rule="nope")


def test_spectral_damping_starts_at_its_init():
    """σ(ρ) at initialization is ``model.scale_control.init`` (ρ = logit(init))."""
    model = build_model(tiny(rule="plain", scale_control=dict(kind="spectral_damping", init=0.6)))
    # ρ is stored in float32: σ(ρ) is 0.6 to a few float32 ulps
    torch.testing.assert_close(torch.sigmoid(model.damping_raw).item(), 0.6, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shapes_and_states(name):
    model = make(name)
    x = tokens()
    out = model(x, [1, 3], x, readout=Readout(states=True))
    assert out.logits.shape == (3, L, V)
    assert set(out.logits_by_depth) == {1, 3} and set(out.nll_by_depth) == {1, 3}
    assert len(out.states) == 4 and all(s.shape == (3, L, D) for s in out.states)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradients_reach_every_trainable_parameter(name):
    model = make(name)
    x = tokens()
    model(x, depth=3, targets=x).loss.backward()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{pname} got no gradient"
            assert float(p.grad.abs().sum()) > 0, f"{pname} has an all-zero gradient"
        else:
            assert p.grad is None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causality(name):
    model = make(name)
    x = tokens(b=1)
    j = 7
    x2 = x.clone()
    x2[0, j] = (x[0, j] + 1) % V
    a = model(x, depth=4).logits
    b = model(x2, depth=4).logits
    diff_before = (a[:, :j] - b[:, :j]).abs().max().item()
    diff_after = (a[:, j:] - b[:, j:]).abs().max().item()
    print(f"{name}: max |Δlogits| before j={diff_before:.2e}, at/after j={diff_after:.2e}")
    assert diff_before == 0.0
    assert diff_after > 0.0


def _reference_hidden(model: LoopLM, x: torch.Tensor, T: int) -> torch.Tensor:
    """Independent unroll written from SPEC §2 with the blocks' own forward: G(z) = Core(z) − z."""
    cfg = model.cfg

    def rms(z, eps=cfg.norm_eps):
        return z / torch.sqrt(z.pow(2).mean(dim=-1, keepdim=True) + eps)

    def post_ln_block(blk, z, alpha, qkv_inj=None):  # SPEC §3, written out
        z1 = rms(alpha * z + blk.attn(z, qkv_inj)) * blk.norm1.weight
        return rms(alpha * z1 + blk.mlp(z1)) * blk.norm2.weight

    alpha = (2 * cfg.n_core * cfg.residual_depth) ** cfg.resolved_residual_p if cfg.residual != "pre_ln" else None

    def full(blk, z, qkv_inj=None):
        return post_ln_block(blk, z, alpha, qkv_inj) if alpha is not None else z + blk(z, qkv_inj)

    e = model.tok_emb(x) * cfg.embed_scale
    if cfg.position.NAME == "learned":
        e = e + model.pos_emb(torch.arange(x.shape[1]))
    if cfg.input_norm:
        e = rms(e) * model.in_norm.weight
    for blk in model.prelude:
        e = full(blk, e)

    def core_full(z, qkv=None):
        for j, blk in enumerate(model.core.blocks):
            z = full(blk, z, None if qkv is None else qkv[j])
        return z

    def G(z):
        return core_full(z) - z

    def lin(z, module):
        return z @ module.weight.T + (module.bias if module.bias is not None else 0.0)

    def between(h):  # SPEC §4 scale controls
        kind = cfg.scale_control.NAME
        if kind == "inter_loop_norm":
            return rms(h) * model.loop_norm.weight
        if kind == "spectral_damping":
            return torch.sigmoid(model.damping_raw) * h
        if kind == "final_norm":
            return rms(h) * model.norm_f.weight
        return h

    o = cfg.options
    s = getattr(o, "step_scale", 1.0)
    r = model.rule
    if cfg.rule == "plain":
        h = e
        for _ in range(T):
            h = between(core_full(h))
        return h
    if cfg.rule in ("huginn_linear", "parcae_decay", "parcae", "orthoinj", "deq_qkv"):
        g = torch.Generator().manual_seed(o.state_init_seed)
        if o.state_init == "truncated_normal":
            table = torch.nn.init.trunc_normal_(torch.empty(cfg.seq_len, cfg.d_model), 0.0, 1.0, -3.0, 3.0, generator=g)
        else:
            table = torch.randn(cfg.seq_len, cfg.d_model, generator=g)
        noise = o.state_init_std * table[: x.shape[1]].expand_as(e)
        h = {"zeros": torch.zeros_like(e), "embedding": e, "gaussian": noise, "truncated_normal": noise}[o.state_init]
        if cfg.rule != "huginn_linear" and cfg.rule != "deq_qkv":
            delta = torch.log1p(torch.exp(r.delta_raw))
            lam = torch.exp(-delta * torch.exp(r.alpha_raw))
        for _ in range(T):
            qkv = None
            if cfg.rule == "huginn_linear":
                z = torch.cat([h, e], -1) @ r.adapter.weight.T + (r.adapter.bias if o.adapter_bias else 0.0)
            elif cfg.rule == "parcae_decay":
                z = lam * h + delta * lin(rms(e), r.in_proj)
            elif cfg.rule == "parcae":
                z = lam * h + delta * lin(e, r.in_proj)
            elif cfg.rule == "orthoinj":
                q = delta * lin(e, r.in_proj)
                v = lam * h
                z = v - q * (q * v).sum(-1, keepdim=True) / (q.pow(2).sum(-1, keepdim=True) + 1e-6) + q
            else:
                z, qkv = h, [lin(e, w) for w in r.qkv_proj]
            h = core_full(z, qkv)
            if cfg.rule == "huginn_linear" and o.step_norm:
                h = rms(h)
            h = between(h)
        return h
    if cfg.rule in ("looped", "norm_reset"):
        h = e
        for t in range(T):
            h = h + s * G(h + e)
            if cfg.rule == "norm_reset" and (t + 1) % o.period == 0:
                h = h / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + cfg.norm_eps)  # parameter-free
            h = between(h)
        return h
    h = e + o.init_scale * lin(e, r.init_proj)
    learned_anchor = e + o.anchor_scale * lin(e, r.anchor_proj) if hasattr(r, "anchor_proj") else None
    if cfg.rule in ("adapter", "step_adapter", "step_film"):
        for t in range(T):
            z = h + r.alpha * lin(learned_anchor, r.in_proj)
            if cfg.rule == "step_adapter":
                z = z + o.step_tau * lin(sinusoidal_step_embedding(t, D), r.step_proj)
            if cfg.rule == "step_film":
                g, b = r.film[min(t, o.steps - 1), 0], r.film[min(t, o.steps - 1), 1]
                z = (1 + o.sigma * g) * z + o.sigma * b
            h = h + s * G(z)
        return h
    if cfg.rule == "additive_subtract":  # SCSE eq. 22
        anchor = learned_anchor
        delta = h - anchor
        src = r.alpha * lin(e, r.in_proj)
        for t in range(T):
            tau_t = 0.0
            if o.step_tau:
                tau_t = o.step_tau * lin(sinusoidal_step_embedding(t, D), r.step_proj)
            delta = delta + s * (G(anchor + delta + src + tau_t) - G(anchor + src + tau_t))
        return anchor + delta
    # SCSE family: scse, sc_cond, sc_subtract, scse_leak
    anchor = {"embedding": e, "init": h}.get(o.anchor, learned_anchor)
    kappa = o.kappa  # the learned κ still holds its init
    leak = getattr(o, "leak", 0.0)
    c = kappa * lin(anchor, r.cond_proj) if kappa else 0.0
    delta = h - anchor
    for _ in range(T):
        m = (delta.pow(2).sum(dim=(1, 2), keepdim=True) > o.eps).float() if o.mask else 1.0
        q = s * (G(delta + c) - G(c)) if cfg.rule == "sc_subtract" else s * G(delta + c)
        delta = (1 - leak) * delta + m * q
    return anchor + delta


REFERENCE_VARIANTS = [name for name in VARIANTS if name not in ("unshared", "looped-prelude-coda")]


@pytest.mark.parametrize("name", REFERENCE_VARIANTS)
def test_rule_matches_unrolled_reference(name):
    model = make(name).eval()
    x = tokens()
    for T in (1, 2, 5):
        got = model(x, T, readout=Readout(states=True)).states[-1]
        ref = _reference_hidden(model, x, T)
        err = (got - ref).abs().max().item()
        print(f"{name} T={T}: max |h - h_ref| = {err:.2e}")
        assert err < 1e-5


def test_every_rule_has_a_reference_and_defaults():
    assert set(RULE_NAMES) <= set(REFERENCE_VARIANTS)
    assert set(RULE_OPTIONS) == set(RULE_NAMES) == set(BODY_CALLS_PER_STEP)
    assert tiny(rule="step_film").options.step_scale == 0.35
    assert tiny(rule="additive_subtract").options.step_scale == 0.5
    assert tiny(rule="norm_reset").options.step_scale == 1.0
    assert tiny(rule="sc_subtract", options=dict(step_scale=0.3)).options.step_scale == 0.3


@pytest.mark.parametrize("rule, field, value", [("step_film", "steps", 0), ("norm_reset", "period", 0),
                                                ("scse_leak", "leak", 1.0), ("step_film", "sigma", -0.1),
                                                ("additive_subtract", "step_tau", -1.0), ("scse", "step_scale", 0.0)])
def test_options_are_validated(rule, field, value):
    with pytest.raises(Exception, match=f"model.options.{field}"):
        tiny(rule=rule, options={field: value})


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_core_calls_per_step_match_flop_proxy(rule):
    """c_body of the FLOP proxy (SPEC §9) equals the core applications the rule really makes."""
    model = make(rule).eval()
    calls = 0

    def count(module, args):
        nonlocal calls
        calls += 1

    model.core.register_forward_pre_hook(count)
    model(tokens(), depth=4)
    assert calls == BODY_CALLS_PER_STEP[rule] * 4 == body_applications(model.cfg, 4)


def test_looped_prelude_coda_matches_reference():
    model = make("looped-prelude-coda").eval()
    x = tokens()
    h = _reference_hidden(model, x, 3)
    for blk in model.coda:
        h = h + blk(h)
    ref = model.lm_head(model.norm_f(h))
    assert torch.allclose(model(x, depth=3).logits, ref, atol=1e-5)


def test_unshared_runs_min_depth_blocks():
    model = make("unshared").eval()
    x = tokens()
    h = model.tok_emb(x) + model.pos_emb(torch.arange(L))
    outs = {}
    for i, blk in enumerate(model.layers):
        h = h + blk(h)
        outs[i + 1] = model.lm_head(model.norm_f(h))
    got = model(x, depth=[1, 3, 8]).logits_by_depth
    assert torch.allclose(got[1], outs[1], atol=1e-6)
    assert torch.allclose(got[3], outs[3], atol=1e-6)
    assert torch.equal(got[8], got[3])  # exact: active depth saturates at n_layers: the same computation


@pytest.mark.parametrize("anchor", ["learned", "embedding", "frozen_random"])
def test_scse_forcing_bias_is_exactly_zero(anchor):
    model = make("scse" if anchor == "learned" else f"scse-{anchor}")
    recs = forcing_profile(model, tokens(), steps=[0, 3, 7])
    for r in recs:
        print(anchor, r)
        assert r["bias_max_abs"] == 0.0 and r["raw_bias_max_abs"] == 0.0
        assert r["ratio"] == 0.0
        assert r["anchor_energy"] > 0


@pytest.mark.parametrize("rule", ["looped", "adapter", "step_adapter", "step_film", "norm_reset"])
def test_additive_rules_have_nonzero_forcing_bias(rule):
    recs = forcing_profile(make(rule), tokens(), steps=[0, 3, 7])
    for r in recs:
        print(rule, r)
        assert r["bias_energy"] > 1e-8 and r["raw_bias_energy"] == r["bias_energy"]
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0


@pytest.mark.parametrize("name", ["sc_subtract", "sc_subtract-nomask", "additive_subtract",
                                  "additive_subtract-step"])
def test_subtractive_controls_have_exactly_zero_forcing_bias_in_eval(name):
    """The two core calls cancel bit for bit at Δ = 0 with dropout off: b_t = b̃_t = 0 (SCSE eq. 22)."""
    recs = forcing_profile(make(name), tokens(), steps=[0, 3, 7])
    for r in recs:
        print(name, r)
        assert r["bias_max_abs"] == 0.0 and r["raw_bias_max_abs"] == 0.0 and r["ratio"] == 0.0
        assert r["anchor_energy"] > 0


@pytest.mark.parametrize("name", ["sc_subtract", "additive_subtract"])
def test_subtractive_controls_do_not_cancel_under_training_dropout(name):
    """Independent dropout draws in the two calls (the paper's training map) leave b_t ≠ 0."""
    torch.manual_seed(0)
    model = build_model(tiny(**VARIANTS[name], **{"dropout": 0.1})).train()
    state, ctx = model.start(model.embed(tokens()))
    b = model.hidden(model.step(model.to_state(ctx.anchor, ctx), 0, ctx, mask=False), ctx) - ctx.anchor
    assert b.abs().max() > 0


@pytest.mark.parametrize("name", ["sc_cond", "sc_cond-embedding", "scse_leak"])
def test_masked_source_conditioned_rules_zero_realized_nonzero_raw_bias(name):
    """Masked SC-Cond / leak diagnostic: realized b_t = 0 exactly, raw b̃_t = s·G(κ·W_c h*) ≠ 0."""
    recs = forcing_profile(make(name), tokens(), steps=[0, 3, 7])
    for r in recs:
        print(name, r)
        assert r["bias_max_abs"] == 0.0 and r["ratio"] == 0.0
        assert r["raw_bias_energy"] > 1e-10


@pytest.mark.parametrize("name", ["sc_cond-nomask", "scse_leak-nomask"])
def test_unmasked_sc_cond_has_nonzero_forcing_bias(name):
    recs = forcing_profile(make(name), tokens(), steps=[0, 3, 7])
    for r in recs:
        print(name, r)
        assert r["raw_bias_energy"] > 1e-10 and r["bias_energy"] == r["raw_bias_energy"]
        assert r["ratio"] > 0


def test_scse_unmasked_zero_core_still_zero_raw_response():
    """The zero-preserving core alone gives b̃_t = 0 (no mask involved)."""
    recs = forcing_profile(make("scse-nomask"), tokens(), steps=[0, 5])
    assert all(r["raw_bias_max_abs"] == 0.0 for r in recs)


def test_scse_init_anchor_keeps_deviation_zero_and_ppl_flat():
    torch.manual_seed(0)
    model = build_model(tiny(rule="scse", options=dict(anchor="init"))).eval()
    x = tokens()
    out = model(x, [0, 1, 8, 24], x, readout=Readout(states=True))
    for s in out.states:
        assert torch.equal(s, out.anchor)  # exact: Δ_t = 0 at every t
    nll = out.nll_by_depth
    # exact: the same state read out
    assert torch.equal(nll[1], nll[0]) and torch.equal(nll[24], nll[8]) and torch.equal(nll[8], nll[1])


def test_mask_is_per_example():
    """An example whose Δ_0 is zero stays put while its batch neighbour moves."""
    torch.manual_seed(0)
    model = build_model(tiny(rule="scse")).eval()
    e = torch.randn(2, L, D)
    state, ctx = model.start(e)
    state = state.clone()
    state[0] = 0.0
    nxt = model.step(state, 0, ctx)
    assert torch.equal(nxt[0], torch.zeros_like(nxt[0]))  # exact: 0 in, 0 out
    assert nxt[1].abs().max() > 0


@pytest.mark.parametrize("name", [*RULE_NAMES, "unshared"])
def test_multi_depth_equals_separate_runs(name):
    model = make(name).eval()
    x = tokens()
    depths = [1, 2, 4, 8, 12]
    multi = model(x, depth=depths, targets=x)
    worst = 0.0
    for T in depths:
        single = model(x, depth=T, targets=x)
        rel = ((multi.nll_by_depth[T] - single.nll_by_depth[T]).abs() / single.nll_by_depth[T].abs()).max().item()
        worst = max(worst, rel)
    print(f"{name}: max relative difference multi vs separate = {worst:.2e}")
    assert worst <= 1e-5


@pytest.mark.parametrize("final_depth", [4, None])
def test_final_only_norm_readout_does_not_depend_on_the_requested_depths(final_depth):
    """With ``final_depth`` set (argument or attribute), depth T reads out raw for T < final_depth and
    normalized from there, in a multi-depth forward and in a fixed-depth forward alike."""
    model = make("looped-final_only_norm")
    x = tokens()
    if final_depth is None:
        model.final_depth = 4  # what load_checkpoint sets from train.eval_depth
    multi = model(x, [1, 2, 4, 6], x, readout=Readout(states=True, final_depth=final_depth))
    for T in (1, 2, 4, 6):
        single = model(x, T, x, readout=Readout(final_depth=final_depth))
        assert torch.allclose(multi.logits_by_depth[T], single.logits, atol=1e-5, rtol=1e-5), T
        h = multi.states[T]
        for block in model.coda:
            h = h + block(h)
        ref = model.lm_head(model.norm_f(h) if T >= 4 else h)
        assert torch.allclose(single.logits, ref, atol=1e-5, rtol=1e-5), T


def test_unshared_multi_depth_with_attention_mask():
    model = make("unshared")
    x = tokens()
    mask = torch.ones_like(x)
    out = model.read(model.loop(x, attention_mask=mask), [1, 3], x)
    ref = model(x, depth=[1, 3], targets=x)
    for T in (1, 3):
        assert torch.allclose(out.nll_by_depth[T], ref.nll_by_depth[T], atol=1e-5), T


def test_depth_zero_and_bad_depth():
    model = make("scse")
    x = tokens()
    assert model(x, depth=0).logits.shape == (3, L, V)
    with pytest.raises(ValueError, match="depth"):
        model(x, depth=-1)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, L + 1, dtype=torch.long), depth=1)


def test_frozen_random_anchor_not_trained():
    model = make("scse-frozen_random")
    assert not model.rule.anchor_proj.weight.requires_grad
    assert model.num_params() == model.num_params(trainable_only=False) - D * D
