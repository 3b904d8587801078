"""Training objectives and gradient paths (SPEC §4–5): truncated BPTT against full BPTT and against an
explicit detach reference, TBPTT activation memory, per-loop / exit-weighted / norm-penalty losses
against direct computations, and exact resume with the learned depth prior and Huginn rules."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.config import LearnedDepthConfig, ModelConfig, TBPTTConfig, TrainConfig
from looplm.model import LoopLM, build_model
from looplm.train.losses import exit_distribution, training_loss
from looplm.train.trainer import train
from looplm.model.cursor import Gradient, Readout

V, L = 61, 10


def tiny(**kw) -> LoopLM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_heads=4, d_ff=64, seq_len=L, dropout=0.0)
    base.update(kw)
    return build_model(ModelConfig(**base)).eval()


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (3, L), generator=g)
    return x, torch.roll(x, -1, 1)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


HUGINN = dict(rule="parcae_decay", n_prelude=1, n_core=2, n_coda=1)


@pytest.mark.parametrize("kw", [dict(rule="scse"), dict(rule="looped"), HUGINN, dict(rule="huginn_linear")])
def test_tbptt_with_window_at_least_depth_equals_full_bptt(kw):
    x, y = batch()
    for b in (5, 7):
        m = tiny(**kw)
        m(x, depth=5, targets=y).loss.backward()
        full = grads(m)
        m.zero_grad()
        m(x, 5, y, gradient=Gradient("tbptt", b)).loss.backward()
        for n, g in grads(m).items():
            assert torch.equal(g, full[n]), n  # exact: b ≥ depth detaches nothing: the same graph


def _detach_reference_grads(m, x, y, T, b):
    """Gradients of an unroll written by hand that detaches the state before the last b steps."""
    m.zero_grad()
    state, ctx = m.start(m.embed(x))
    for t in range(T):
        if t == T - b:
            state = state.detach()
        state = m.step(state, t, ctx)
    logits = m.readout(m.hidden(state, ctx))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return grads(m)


def test_tbptt_matches_explicit_detach_reference_and_reaches_prelude():
    """b < T: gradients equal an unroll written by hand that detaches the state before the last b
    steps; the prelude and embedding still get gradient through the injection."""
    x, y = batch()
    T, b = 6, 2
    m = tiny(**HUGINN)
    m(x, T, y, gradient=Gradient("tbptt", b)).loss.backward()
    got = grads(m)
    ref = _detach_reference_grads(m, x, y, T, b)
    assert set(got) == set(ref)
    for n in ref:
        assert torch.allclose(got[n], ref[n], atol=1e-6, rtol=1e-5), n
    assert got["prelude.0.mlp.down.weight"].abs().sum() > 0 and got["tok_emb.weight"].abs().sum() > 0


@pytest.mark.parametrize("kw", [dict(rule="plain", n_prelude=1), dict(rule="scse"), dict(rule="plain", input_norm=True)])
def test_tbptt_gives_every_parameter_a_gradient_and_matches_detach_reference(kw):
    """b < T with rules whose initial state holds parameters the truncated steps do not reach (the
    prelude of ``plain``, SCSE's anchor projection): every trainable parameter gets a gradient (zero
    where only the detached steps used it, so DDP needs no unused-parameter search), and the values
    equal an explicit detach reference."""
    x, y = batch()
    T, b = 5, 2
    m = tiny(**kw)
    m(x, T, y, gradient=Gradient("tbptt", b)).loss.backward()
    got = grads(m)
    assert set(got) == {n for n, p in m.named_parameters() if p.requires_grad}
    ref = _detach_reference_grads(m, x, y, T, b)
    for n, g in got.items():
        assert torch.allclose(g, ref.get(n, torch.zeros_like(g)), atol=1e-6, rtol=1e-5), n


def _saved_activation_bytes(model, x, y, T, b):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # b = 0: full BPTT
        model(x, T, y, gradient=Gradient("tbptt" if b else "bptt", b)).loss.backward()
    return total


def test_tbptt_activation_memory_scales_with_window_not_depth():
    x, y = batch()
    m = tiny(rule="looped")
    full4, full16 = (_saved_activation_bytes(m, x, y, T, 0) for T in (4, 16))
    tb4, tb16 = (_saved_activation_bytes(m, x, y, T, 2) for T in (4, 16))
    assert full16 > 3 * full4  # full BPTT grows with T
    assert tb16 == tb4  # TBPTT saves the same activations whatever T


def test_per_loop_and_norm_penalty_losses_match_direct_computation():
    x, y = batch()
    m = tiny(rule="plain", readout="raw")
    tcfg = TrainConfig(supervision="per_loop", norm_penalty=0.3)
    res = training_loss(m, x, y, 3, tcfg)
    out = m(x, [1, 2, 3], y, readout=Readout(states=True))
    ce = [torch.nn.functional.cross_entropy(out.logits_by_depth[k].flatten(0, 1), y.flatten()) for k in (1, 2, 3)]
    pen = 0.3 * sum(h.pow(2).mean() for h in out.states[1:]) / 3
    assert torch.allclose(res.loss, sum(ce) / 3 + pen, atol=1e-6)
    assert res.ce == pytest.approx(float(ce[-1].detach()), rel=1e-6)


def test_exit_weighted_loss_matches_direct_computation():
    x, y = batch()
    m = tiny(rule="looped", exit_gate=True)
    tcfg = TrainConfig(supervision="exit_weighted", exit_entropy=0.05)
    res = training_loss(m, x, y, 3, tcfg)
    out = m(x, depth=[1, 2, 3], targets=y)
    lam = [torch.sigmoid(out.exit_logits_by_depth[k]) for k in (1, 2)]
    p = [lam[0], (1 - lam[0]) * lam[1], (1 - lam[0]) * (1 - lam[1])]
    assert torch.allclose(sum(p), torch.ones_like(p[0]))
    assert torch.allclose(exit_distribution([out.exit_logits_by_depth[k] for k in (1, 2, 3)]), torch.stack(p))
    ent = -sum(q * q.log() for q in p)
    ref = (sum(q * out.nll_by_depth[k + 1] for k, q in enumerate(p)) - 0.05 * ent).mean()
    assert torch.allclose(res.loss, ref, atol=1e-6)
    res.loss.backward()
    assert m.exit_gate.weight.grad.abs().sum() > 0


def _trace(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lmdr", [False, True])  # True: inv_ppl with the advantage scale s, wsd, 2 microbatches
def test_resume_is_exact_with_learned_prior_huginn_and_tbptt(tmp_path, tiny_cfg, tiny_data, lmdr):
    lmdr_prior = dict(reward="inv_ppl", scale=True, scale_window=2) if lmdr else {}
    lmdr_train = dict(grad_accum=2, batch_size=2) if lmdr else {}
    cfg = tiny_cfg.replace(
        model=tiny_cfg.model.replace(rule="huginn_linear", n_prelude=1, n_core=1, n_coda=1, dropout=0.0),
        depth=LearnedDepthConfig(cap=6, mean=3.0, warmup=1, lr=0.05, **lmdr_prior),
        optim=tiny_cfg.optim.replace(schedule="wsd") if lmdr else tiny_cfg.optim,
        train=tiny_cfg.train.replace(gradient=TBPTTConfig(steps=2), **lmdr_train))
    full = tmp_path / "full"
    train(cfg, full, progress=False, data=tiny_data)
    part = tmp_path / "part"
    train(cfg, part, progress=False, data=tiny_data, stop_after=3)
    train(cfg, part, progress=False, data=tiny_data, resume=True)
    a, b = _trace(full), _trace(part)
    assert len(a) == len(b) == 6
    for ra, rb in zip(a, b):
        assert ra["depths"] == rb["depths"]
        assert ra["loss"] == rb["loss"]
        assert ra["prior_mean_depth"] == rb["prior_mean_depth"]
        assert ra.get("prior_advantage_scale") == rb.get("prior_advantage_scale") and ra["lr"] == rb["lr"]
    assert a[-1]["prior_updates"] == 6 and a[-1]["prior_mean_depth"] != pytest.approx(3.0, abs=1e-9)
    if lmdr:  # s = 1 at the first update, then the CE/reward std ratio (≈ e^CE ≫ 1 for exp(−CE))
        assert a[0]["prior_advantage_scale"] == 1.0 and a[-1]["prior_advantage_scale"] > 10


def test_scale_clamp_keeps_every_loop_at_the_loop_one_rms():
    x, _ = batch()
    m = tiny(rule="plain", readout="raw")
    with torch.no_grad():
        m.core.blocks[0].mlp.down.weight.mul_(50.0)  # make the hidden norm drift
        free = m(x, 4, readout=Readout(states=True)).states
        clamped = m.read(m.loop(x, scale_clamp=True), 4, readout=Readout(states=True)).states
    rms = [h.pow(2).mean(-1).sqrt() for h in clamped[1:]]
    for r in rms[1:]:
        assert torch.allclose(r, rms[0], rtol=1e-5)
    assert not torch.allclose(free[4].pow(2).mean(-1).sqrt(), rms[0], rtol=1e-2)
    assert torch.equal(clamped[1], free[1])  # exact: loop 1 is untouched
