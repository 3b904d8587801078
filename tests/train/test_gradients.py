"""Gradient estimators of the unroll (SPEC §5; LMDR §3.1, appendix A.2): endpoint (Neumann-b) gradients
against the analytic truncated Neumann series on an exactly contractive linear recurrence, against a
hand-unrolled detach-at-the-endpoint loop of a tiny LoopLM, and against TBPTT-b at depth T + b; the
multi-depth readouts; the gradient-cosine diagnostic. (The config section ``train.gradient``:
``test_config_cli.py::test_gradient_is_one_value_mapping_onto_the_cursor_estimator``; b ≥ T TBPTT = full
BPTT: ``test_objectives.py::test_tbptt_with_window_at_least_depth_equals_full_bptt``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm.config import Config, EndpointConfig, FixedDepthConfig, ModelConfig, TrainConfig
from looplm.model import DepthLM, LoopContext, build_model
from looplm.train.losses import training_loss
from looplm.model.cursor import Gradient, Readout

V, L = 61, 10
HUGINN = dict(rule="parcae_decay", n_prelude=1, n_core=2, n_coda=1)


def tiny(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_heads=4, d_ff=64, seq_len=L, dropout=0.0)
    base.update(kw)
    return build_model(ModelConfig(**base)).eval()


def batch(seed=1, b=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (b, L), generator=g)
    return x, torch.roll(x, -1, 1)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------ an exactly contractive toy
class LinearToyLM(DepthLM):
    """Test-only looped model with the linear recurrence z ← A z + W e (no attention), z^0 = 0: its
    state Jacobian is J = A everywhere, its fixed point z* = (I − A)⁻¹ W e per token."""

    shared = True

    def __init__(self, cfg: ModelConfig, A: torch.Tensor):
        super().__init__(cfg)
        d = cfg.d_model
        self.A = torch.nn.Parameter(A.clone())
        self.W = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.exit_gate = None
        self._finish_init()
        with torch.no_grad():
            self.A.copy_(A)

    def n_physical_blocks(self):
        return 1

    def start(self, e, positions=None, *, scope=None, valid=None):
        return torch.zeros_like(e), LoopContext(anchor=None, injection=e, scope=scope)

    def step(self, state, t, ctx, *, clamp_rms=None):
        return state @ self.A.T + ctx.injection @ self.W.T


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ (the forward's cross-entropy runs in float32, so float64 agreement is ~1e-7)."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def toy(d=8, kappa=0.5):
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    s = torch.linspace(kappa, 0.1, d, dtype=torch.float64)
    A = (q * s) @ torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].T  # ‖A‖₂ = kappa
    cfg = ModelConfig(rule="looped", vocab_size=V, d_model=d, n_heads=1, d_ff=8, seq_len=L, dropout=0.0,
                      tie_embeddings=False)
    return LinearToyLM(cfg, A.float()).double().eval()


@pytest.mark.parametrize("b", [1, 2, 5])
def test_endpoint_on_contractive_linear_recurrence_equals_truncated_neumann_series(b):
    """Neumann-b from the (numerically exact) fixed point: ∂ℓ/∂A = Σ_tokens v_b z*ᵀ and ∂ℓ/∂W =
    Σ_tokens v_b eᵀ with v_b = Σ_{k<b} (Aᵀ)^k g, g = ∂ℓ/∂z at z* (G_b = c + B*ᵀ Σ_{k<b} (J*ᵀ)^k g)."""
    m, (x, y) = toy(), batch()
    R = 80  # 0.5^80 ≈ 1e-24: z^R is the fixed point to float64 precision
    m.zero_grad()
    out = m(x, R, y, gradient=Gradient("endpoint", b))
    out.loss.backward()
    assert set(out.nll_by_depth) == {R + b}
    with torch.no_grad():
        e = m.embed(x)  # (B, L, d)
        A, W = m.A, m.W
        eye = torch.eye(A.shape[0], dtype=A.dtype)
        z_star = e @ W.T @ torch.linalg.inv(eye - A).T  # (I − A)⁻¹ W e per token
    z = z_star.clone().requires_grad_(True)
    loss = F.cross_entropy(m.readout(z).flatten(0, 1), y.flatten())
    g, = torch.autograd.grad(loss, z)  # (B, L, d)
    v, term = torch.zeros_like(g), g
    for _ in range(b):
        v, term = v + term, term @ A  # (Aᵀ)^k g per token, as rows: g Aᵏ
    assert rel_err(m.A.grad, torch.einsum("bli,blj->ij", v, z_star)) < 1e-6
    assert rel_err(m.W.grad, torch.einsum("bli,blj->ij", v, e)) < 1e-6
    # the tail bound of A.2: ‖G_imp − G_b‖ ≤ ‖B*‖ ‖g‖ κ^b / (1 − κ) shrinks geometrically; b → ∞ is the
    # implicit gradient (I − Aᵀ)⁻¹ g, which full BPTT at this depth also reaches
    v_imp = g @ torch.linalg.inv(eye - A)
    m.zero_grad()
    m(x, depth=R, targets=y).loss.backward()
    assert rel_err(m.A.grad, torch.einsum("bli,blj->ij", v_imp, z_star)) < 1e-6
    err = (torch.einsum("bli,blj->ij", v_imp - v, z_star)).norm() / m.A.grad.norm()
    assert err <= 0.5 ** b / (1 - 0.5) * 10  # loose: the constant ‖B*‖‖g‖/‖G‖ is O(1) here


# ------------------------------------------------------------------ a tiny LoopLM, by hand
def _endpoint_reference_grads(m, x, y, T, b):
    """An unroll written by hand: T steps without autograd, detach z^T, b steps with autograd."""
    m.zero_grad()
    state, ctx = m.start(m.embed(x))
    with torch.no_grad():
        for t in range(T):
            state = m.step(state, t, ctx)
    state = state.detach()
    for t in range(T, T + b):
        state = m.step(state, t, ctx)
    logits = m.readout(m.hidden(state, ctx))
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return grads(m)


@pytest.mark.parametrize("kw", [HUGINN, dict(rule="scse"), dict(rule="plain", n_prelude=1)])
def test_endpoint_matches_hand_unrolled_detach_at_endpoint_and_every_parameter_gets_a_gradient(kw):
    """forward(gradient="endpoint") = autograd of the explicit detach-at-the-endpoint loop; every
    trainable parameter gets a gradient (zero where only the detached prefix used it: the exact-zero
    term, so DDP needs no unused-parameter search)."""
    x, y = batch()
    T, b = 4, 2
    m = tiny(**kw)
    m(x, T, y, gradient=Gradient("endpoint", b)).loss.backward()
    got = grads(m)
    assert set(got) == {n for n, p in m.named_parameters() if p.requires_grad}
    ref = _endpoint_reference_grads(m, x, y, T, b)
    for n, g in got.items():
        assert torch.allclose(g, ref.get(n, torch.zeros_like(g)), atol=1e-6, rtol=1e-5), n
    if kw is HUGINN:  # the injection carries the gradient to the prelude and the embeddings
        assert got["prelude.0.mlp.down.weight"].abs().sum() > 0 and got["tok_emb.weight"].abs().sum() > 0


def test_endpoint_at_depth_T_is_tbptt_at_depth_T_plus_b():
    """In a forward pass, endpoint-b at T and TBPTT-b at T + b are the same computation (the estimators
    differ in where they start relative to the depth R that is called the endpoint, LMDR §3.1)."""
    x, y = batch()
    m = tiny(**HUGINN)
    a = m(x, 3, y, gradient=Gradient("endpoint", 2))
    a.loss.backward()
    ga = grads(m)
    m.zero_grad()
    c = m(x, 5, y, gradient=Gradient("tbptt", 2))
    c.loss.backward()
    assert torch.equal(a.loss, c.loss)  # exact: same computation
    for n, g in grads(m).items():
        assert torch.equal(g, ga[n]), n  # exact: same computation
    with torch.no_grad():  # the values do not depend on autograd
        # exact: same kernels
        assert torch.equal(m(x, 3, y, gradient=Gradient("endpoint", 2)).loss, a.loss)


def test_endpoint_multi_depth_readouts_and_depth_zero():
    """The largest requested depth T is read at T + b (with gradient); the smaller ones on the way, at
    the visited states (their values equal full BPTT's); states hold h_0 … h_{T+b}."""
    x, y = batch()
    m = tiny(rule="looped")
    out = m(x, [1, 2, 3], y, gradient=Gradient("endpoint", 2), readout=Readout(states=True))
    ref = m(x, depth=[1, 2, 5], targets=y)
    assert set(out.nll_by_depth) == {1, 2, 5} and len(out.states) == 6
    for k in (1, 2, 5):
        assert torch.equal(out.nll_by_depth[k], ref.nll_by_depth[k])  # exact: same forward (detach keeps values)
    # depth 0: the endpoint is the initial state, detached
    m.zero_grad()
    m(x, 0, y, gradient=Gradient("endpoint", 1)).loss.backward()
    ref = _endpoint_reference_grads(m, x, y, 0, 1)
    for n, g in grads(m).items():
        assert torch.allclose(g, ref.get(n, torch.zeros_like(g)), atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize("sup", ["terminal", "per_loop"])
def test_training_loss_with_endpoint_gradient(sup):
    x, y = batch()
    m = tiny(rule="looped")
    tcfg = TrainConfig(gradient=EndpointConfig(steps=2), supervision=sup, norm_penalty=0.1)
    res = training_loss(m, x, y, 3, tcfg)
    out = m(x, [1, 2, 5], y, readout=Readout(states=True))
    keys = [3 + 2] if sup == "terminal" else [1, 2, 5]
    ce = [F.cross_entropy(out.logits_by_depth[k].flatten(0, 1), y.flatten()) for k in keys]
    pen = 0.1 * sum(out.states[k].pow(2).mean() for k in [1, 2, 5]) / 3
    assert torch.allclose(res.loss, sum(ce) / len(ce) + pen, atol=1e-6)
    assert res.ce == pytest.approx(float(ce[-1].detach()), rel=1e-6)


def test_bad_estimators_are_refused():
    x, _ = batch()
    for kw, match in [(dict(kind="neumann"), "allowed"), (dict(kind="endpoint"), "needs b >= 1"),
                      (dict(steps=2), "kind bptt does not read it")]:
        with pytest.raises(ValueError, match=match):
            Gradient(**kw)
    with pytest.raises(ValueError, match="no recurrence to truncate"):
        build_model(ModelConfig(architecture="unshared", vocab_size=V, d_model=32, n_heads=4, d_ff=64,
                                seq_len=L))(x, 2, gradient=Gradient("endpoint", 1))


# ------------------------------------------------------------------ the cosine diagnostic
def test_gradient_cosines_limits_and_groups():
    """TBPTT-b with b ≥ R is full BPTT (cosine 1, norm ratio 1); every group is reported; the
    estimators differ from full BPTT below R."""
    from looplm.diagnostics.gradients import gradient_cosines

    m = tiny(**HUGINN)
    res = gradient_cosines(m, [batch(1), batch(2)], depth=3, steps=(1, 3))
    assert res["groups"] == ["embeddings/readout", "prelude", "core", "rule", "coda"]
    rows = {(r["estimator"], r["b"]): r for r in res["rows"]}
    assert rows[("tbptt", 3)]["overall"]["cos"] == pytest.approx(1.0, abs=1e-6)
    assert rows[("tbptt", 3)]["overall"]["norm_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert rows[("tbptt", 1)]["overall"]["cos"] < 1 - 1e-4 and rows[("endpoint", 1)]["overall"]["cos"] < 1 - 1e-4
    assert rows[("tbptt", 1)]["coda"]["cos"] > 0.99  # the coda sees the same readout state's loss
    assert "| endpoint | 3 |" in res["markdown"]


def test_train_with_endpoint_gradient_then_gradcheck_cli(tmp_path, tiny_cfg, tiny_data, capsys):
    """``train.gradient.kind=endpoint`` trains (exact zero keeps every parameter in the graph) and
    ``looplm gradcheck`` reports the table and writes JSON + Markdown."""
    import json

    from looplm.cli import main
    from looplm.train.trainer import train

    cfg = tiny_cfg.replace(
        model=tiny_cfg.model.replace(rule="huginn_linear", n_prelude=1, n_coda=1, dropout=0.0),
        depth=FixedDepthConfig(depth=2),
        train=tiny_cfg.train.replace(steps=2, gradient=EndpointConfig(steps=2), ckpt_every=2, eval_every=2))
    run = tmp_path / "run"
    summary = train(cfg, run, progress=False, data=tiny_data)
    assert summary["val_loss"] is not None
    saved = Config.from_json((run / "config.json").read_text())
    assert saved.train.gradient == EndpointConfig(steps=2)
    out = tmp_path / "g.json"
    assert main(["gradcheck", "--checkpoint", str(run), "--steps", "1,2", "--batches", "1", "--batch-size", "2",
                 "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["depth"] == 2 and [(r["estimator"], r["b"]) for r in res["rows"]] == [
        ("tbptt", 1), ("endpoint", 1), ("tbptt", 2), ("endpoint", 2)]
    assert out.with_suffix(".md").read_text().startswith("`tiny`")
    assert "| tbptt | 2 | 1.0000" in capsys.readouterr().out
