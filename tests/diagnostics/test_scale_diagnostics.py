"""Scale, visit-alignment and token-convergence diagnostics (SPEC §6–7), each against a reference:
hand-computed κ̂ and convergence depths, autograd's ``.grad`` and an independent per-visit gradient
(a zero perturbation added to each visit's weights), finite differences of the readout loss, direct
torch statistics, scipy's Spearman, and ``looplm diagnose`` end to end on a tiny trained checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from looplm.config import ModelConfig
from looplm.diagnostics.alignment import core_sublayers, visit_alignment, visit_gradients
from looplm.diagnostics.convergence import ConvergenceAccumulator, convergence_depths, relative_changes
from looplm.diagnostics.scale import ScaleAccumulator
from looplm.model import LoopLM, build_model
from looplm.model.cursor import NLL, Readout

V, D, L = 64, 32, 16


def tiny(**kw) -> LoopLM:
    torch.manual_seed(0)
    base = dict(rule="looped", vocab_size=V, d_model=D, n_heads=2, d_ff=64, seq_len=L, dropout=0.0)
    base.update(kw)
    return build_model(ModelConfig(**base)).double().eval()


def batch(seed: int = 1, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (b, L), generator=g)
    targets = torch.randint(0, V, (b, L), generator=g)
    targets[0, :3] = -100
    return idx, targets


def scale_diagnostic(model: LoopLM, batches, loops: int) -> dict:
    """:meth:`ScaleAccumulator.result` over (idx, targets) batches for k = 0 … ``loops``."""
    acc = ScaleAccumulator(loops)
    for idx, targets in batches:
        with torch.no_grad():
            acc.add(model, model(idx, loops + 1, readout=Readout(logits=False, states=True)).states, targets)
    return acc.result()


# ---------------------------------------------------------------------------- visit alignment
def kappa_hat(visit_grads: list[torch.Tensor]) -> float:
    """The reference κ̂ = ‖Σ_r G_r‖² / Σ_r ‖G_r‖² of R visit-wise gradients (DeepLoop eq. 12)."""
    gs = [g.detach().double().flatten() for g in visit_grads]
    return float(torch.stack(gs).sum(0).pow(2).sum()) / sum(float(g.pow(2).sum()) for g in gs)


def test_kappa_hat_on_constructed_gradients():
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for R in (1, 3, 6):
        assert kappa_hat([g.clone() for _ in range(R)]) == pytest.approx(R, rel=1e-12)  # aligned: R
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    assert kappa_hat([3.0 * q[:, r] for r in range(5)]) == pytest.approx(1.0, rel=1e-12)  # orthogonal: 1
    # mixed, by hand: Σ = (2, 3), ‖Σ‖² = 13; Σ‖G_r‖² = 1 + 2 + 4 = 7
    mixed = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 2.0])]
    assert kappa_hat(mixed) == pytest.approx(13 / 7, rel=1e-12)
    assert kappa_hat([torch.tensor([1.0, 2.0]), torch.tensor([-1.0, -2.0])]) == 0.0  # cancelling visits


def _reference_visit_grads(model: LoopLM, idx, targets, depth: int) -> dict[str, list[torch.Tensor]]:
    """Independent per-visit gradients: every call of a core Linear adds F.linear(x, δ_r) with its own
    zero δ_r, so ∂L/∂δ_r is exactly the weight gradient contributed by visit r."""
    subs = core_sublayers(model)
    deltas: dict[str, list[torch.Tensor]] = {n: [] for mods in subs.values() for n in mods}
    handles = []
    for mods in subs.values():
        for name, mod in mods.items():
            def hook(module, args, output, name=name):
                delta = torch.zeros_like(module.weight, requires_grad=True)
                deltas[name].append(delta)
                return output + F.linear(args[0], delta)
            handles.append(mod.register_forward_hook(hook))
    try:
        loss = model(idx, depth, targets, readout=NLL).loss  # the loss path visit_alignment uses
        flat = [d for ds in deltas.values() for d in ds]
        grads = dict(zip(map(id, flat), torch.autograd.grad(loss, flat)))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for sub, mods in subs.items():
        visits = len(deltas[next(iter(mods))])
        out[sub] = [torch.cat([grads[id(deltas[n][r])].flatten() for n in mods]) for r in range(visits)]
    return out


@pytest.mark.parametrize("rule,calls", [("looped", 1), ("sc_subtract", 2)])
def test_visit_gradients_sum_to_autograd_and_kappa_matches_reference(rule, calls):
    model, (idx, targets), R = tiny(rule=rule, n_core=2), batch(), 3
    stats = visit_gradients(model, idx, targets, R)
    model.zero_grad()
    model(idx, depth=R, targets=targets).loss.backward()
    res = visit_alignment(model, idx, targets, R)
    ref = _reference_visit_grads(model, idx, targets, R)
    assert [p["name"] for p in res["per_sublayer"]] == [f"core.blocks.{i}.{s}" for i in (0, 1) for s in ("attn", "mlp")]
    for sub, s in stats.items():
        assert s["visits"] == calls * R and len(ref[sub]) == calls * R
        assert sorted(m.rsplit(".", 1)[1] for m in s["sum"]) == (["proj", "qkv"] if sub.endswith("attn")
                                                                  else ["down", "gate_up"])
        for name, total in s["sum"].items():
            grad = dict(model.named_parameters())[name + ".weight"].grad
            err = (total - grad).abs().max() / grad.abs().max()
            print(rule, name, f"max rel diff {float(err):.2e}")
            assert err < 1e-5
    for p in res["per_sublayer"]:
        want = kappa_hat(ref[p["name"]])
        print(rule, p["name"], p["kappa"], want)
        assert p["kappa"] == pytest.approx(want, rel=1e-9)
        assert p["visit_grad_norm"] == pytest.approx([float(g.norm()) for g in ref[p["name"]]], rel=1e-9)
    assert res["kappa_hat"] == max(p["kappa"] for p in res["per_sublayer"]) and res["depth"] == R


def test_visit_alignment_per_loop_loss_and_errors():
    model, (idx, targets) = tiny(), batch()
    res = visit_alignment(model, idx, targets, 4, loss="per_loop")
    assert res["loss"] == "per_loop" and all(p["visits"] == 4 for p in res["per_sublayer"])
    assert all(0.0 <= p["kappa"] <= 4.0 for p in res["per_sublayer"])
    with pytest.raises(ValueError, match="loss"):
        visit_alignment(model, idx, targets, 2, loss="exit")
    with pytest.raises(ValueError, match="unshared"):
        visit_alignment(tiny(architecture="unshared", n_layers=2), idx, targets, 2)


# ---------------------------------------------------------------------------- scale
def _ce(model: LoopLM, h: torch.Tensor, targets: torch.Tensor, final: bool) -> float:
    logits = model.readout(h, final=final)
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100))


@torch.no_grad()
def test_scale_statistics_against_direct_computation():
    model, (idx, targets), K = tiny(rule="plain", readout="raw"), batch(), 4
    res = scale_diagnostic(model, [(idx, targets)], K)
    states = model(idx, K + 1, readout=Readout(states=True)).states
    assert [r["k"] for r in res["loops"]] == list(range(K + 1)) and res["tokens"] == idx.numel()
    for r in res["loops"]:
        H = states[r["k"]]
        rms = H.pow(2).mean(-1).sqrt().flatten()
        want = {"rms_mean": rms.mean(), "rms_p50": torch.quantile(rms, 0.5), "rms_p99": torch.quantile(rms, 0.99),
                "rms_max": rms.max()}
        for key, v in want.items():
            assert r[key] == pytest.approx(float(v), rel=1e-12), key
        u = H / H.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS
        a = ((u * (states[r["k"] + 1] - H)).sum(-1) / D).mean()
        assert r["radial_increment"] == pytest.approx(float(a), rel=1e-10)
        # radial derivative ∂L_k/∂log s by central finite differences of the readout loss
        eps, final = 1e-5, r["k"] == K
        up, down = _ce(model, math.exp(eps) * H, targets, final), _ce(model, math.exp(-eps) * H, targets, final)
        fd = (up - down) / (2 * eps)
        print(r["k"], r["radial_derivative"], fd, r["radial_grad_fraction"])
        assert r["radial_derivative"] == pytest.approx(fd, rel=1e-5, abs=1e-10)
        assert r["ce"] == pytest.approx(_ce(model, H, targets, final), rel=1e-12)
    assert res["g_K"] == res["loops"][-1]["radial_derivative"]


@torch.no_grad()
def test_scale_l2_norms_are_sqrt_d_times_rms():
    """L2 next to RMS (the readout-blind-spot paper's norms may be L2): by hand on a state whose tokens
    have known norms, then L2 = √d·RMS per statistic on a real unroll."""
    acc = ScaleAccumulator(1)
    model = tiny(rule="plain", readout="raw")
    H = torch.zeros(1, 2, D, dtype=next(model.parameters()).dtype)
    H[0, 0, 0], H[0, 1, :4] = 3.0, 2.0  # token norms: L2 3 and 4; RMS 3/√D and 4/√D
    acc.add(model, [H, H, H], torch.zeros(1, 2, dtype=torch.long))
    r = acc.result()
    k0 = r["loops"][0]
    assert r["d"] == D and k0["l2_mean"] == pytest.approx(3.5) and k0["l2_max"] == pytest.approx(4.0)
    assert k0["rms_mean"] == pytest.approx(3.5 / math.sqrt(D)) and r["final_l2_mean"] == pytest.approx(3.5)
    res = scale_diagnostic(model, [batch()], 3)
    for loop in res["loops"]:
        for stat in ("mean", "p50", "p99", "max"):
            assert loop[f"l2_{stat}"] == pytest.approx(math.sqrt(D) * loop[f"rms_{stat}"], rel=1e-10), stat


def test_rmsnorm_readout_hides_the_radial_gradient_and_raw_readout_shows_it():
    xs = [batch(1), batch(2)]
    norm = scale_diagnostic(tiny(rule="plain", readout="rmsnorm"), xs, 4)
    raw = scale_diagnostic(tiny(rule="plain", readout="raw"), xs, 4)
    hybrid = scale_diagnostic(tiny(rule="plain", readout="final_only_norm"), xs, 4)
    r_norm = [r["radial_grad_fraction"] for r in norm["loops"]]
    r_raw = [r["radial_grad_fraction"] for r in raw["loops"]]
    r_hyb = [r["radial_grad_fraction"] for r in hybrid["loops"]]
    print(r_norm, r_raw, r_hyb, norm["g_K"], raw["g_K"])
    assert max(r_norm) < 1e-6  # the normalizer-epsilon effect only
    assert min(r_raw) > 1e-3
    assert min(r_hyb[:-1]) > 1e-3 and r_hyb[-1] < 1e-6  # raw intermediate exits, normalized final one


# ---------------------------------------------------------------------------- token convergence
def test_convergence_depths_on_hand_built_states():
    # one example, d = 1, four tokens; values over r = 0 … 3
    traj = torch.tensor([[1.0, 1.5, 1.5, 1.5],   # ρ = 0.5, 0, 0    → converged from 2
                         [1.0, 1.0, 1.0, 1.0],   # ρ = 0, 0, 0      → 1
                         [1.0, 1.0, 1.1, 1.1],   # ρ = 0, 0.1, 0    → 3
                         [1.0, 1.0, 1.0, 2.0]],  # ρ = 0, 0, 1      → never: R + 1 = 4
                        dtype=torch.float64)
    states = [traj[:, r].view(1, 4, 1) for r in range(4)]
    rho = relative_changes(states)
    want_rho = torch.tensor([[0.5, 0, 0, 0], [0, 0, 0.1 / 1.0, 0], [0, 0, 0, 1.0]], dtype=torch.float64)
    assert torch.allclose(rho[:, 0], want_rho, atol=1e-7)
    assert convergence_depths(rho).tolist() == [[2, 1, 3, 4]]
    assert convergence_depths(rho, tau=0.2).tolist() == [[2, 1, 1, 4]]
    acc = ConvergenceAccumulator(0.02)
    acc.add(states)
    res = acc.result()
    print(res)
    assert res["depth_hist"] == [1, 1, 1, 1] and res["depth_mean"] == 2.5 and res["depth_median"] == 2.5
    assert res["never_fraction"] == 0.25 and res["tokens"] == 4
    assert res["rho_mean"] == pytest.approx([0.125, 0.025, 0.25])
    assert res["spearman"] == pytest.approx(0.8)  # ranks (2,1,3,4) vs (1,2,3,4): 1 − 6·2/(4·15)
    # masking drops the never-converged token
    acc = ConvergenceAccumulator(0.02)
    acc.add(states, mask=torch.tensor([[True, True, True, False]]))
    assert acc.result()["depth_hist"] == [1, 1, 1, 0] and acc.result()["never_fraction"] == 0.0


def test_convergence_spearman_matches_scipy_on_constructed_depths():
    R, B = 6, 2
    g = torch.Generator().manual_seed(3)
    pos = torch.arange(L).expand(B, L)
    depth = (1 + pos * R // L + torch.randint(0, 2, (B, L), generator=g)).clamp(max=R + 1)  # (B, L) in 1 … R+1
    # token state doubles at every step r < its depth, then stays: the last change is at r = depth − 1
    states = [torch.ones(B, L, 3, dtype=torch.float64)]
    for r in range(1, R + 1):
        grow = (r < depth).to(torch.float64)[..., None]
        states.append(states[-1] * (1 + grow))
    res = ConvergenceAccumulator(0.02)
    res.add(states[:R + 1])
    out = res.result()
    assert convergence_depths(relative_changes(states)).tolist() == depth.tolist()
    ref = spearmanr(depth.flatten().numpy(), pos.flatten().numpy())
    print(out["spearman"], ref.statistic, out["spearman_p"], ref.pvalue)
    assert out["spearman"] == pytest.approx(float(ref.statistic), rel=1e-12)
    assert out["spearman_p"] == pytest.approx(float(ref.pvalue), rel=1e-9)
    assert out["depth_mean"] == pytest.approx(float(depth.double().mean()))
    assert out["rho_mean"][0] == pytest.approx(float((depth > 1).double().mean()))  # ρ = 1 when doubling


# ---------------------------------------------------------------------------- runner and CLI
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_cfg, tiny_data):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("scale-run")
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


def test_cli_diagnose_reports_scale_alignment_and_convergence(trained_run, tiny_cfg, tmp_path):
    from looplm.cli import main

    out = tmp_path / "diag" / "tiny.json"
    rc = main(["diagnose", "--checkpoint", str(trained_run), "--out", str(out), "--depth", "6",
               "--steps", "0,5", "--batches", "1", "--batch-size", "2", "--convergence-tau", "0.05", "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    K = tiny_cfg.depth.max_depth()  # the default loop count: the training depth
    sc, va, cv = data["scale"], data["visit_alignment"], data["convergence"]
    assert sc["K"] == K and [r["k"] for r in sc["loops"]] == list(range(K + 1))
    for r in sc["loops"]:
        assert 0 < r["rms_p50"] <= r["rms_p99"] <= r["rms_max"] and r["rms_mean"] > 0
        assert 0 <= r["radial_grad_fraction"] < 1e-6  # SCSE with the RMSNorm readout, no coda
    assert math.isfinite(sc["g_K"])
    assert va["depth"] == K and 1 <= va["kappa_hat"] <= K
    assert [p["visits"] for p in va["per_sublayer"]] == [K, K]
    assert cv["tau"] == 0.05 and cv["depth"] == 6 and len(cv["rho_mean"]) == 6
    assert sum(cv["depth_hist"]) == cv["tokens"] == 2 * tiny_cfg.model.seq_len
    assert "Visit alignment" in data["markdown"] and "Token convergence" in data["markdown"]
    assert (out.parent / "tiny_scale.png").stat().st_size > 0


def test_diagnose_checkpoint_scale_loops_override(trained_run):
    from looplm.diagnostics.runner import diagnose_checkpoint

    res = diagnose_checkpoint(trained_run, steps=(0,), depth=3, batches=1, batch_size=1, scale_loops=2,
                              progress=False)
    assert res["scale"]["K"] == 2 and res["visit_alignment"]["depth"] == 2 and res["convergence"]["depth"] == 3
    with pytest.raises(ValueError, match="scale_loops"):
        diagnose_checkpoint(trained_run, steps=(0,), depth=3, batches=1, batch_size=1, scale_loops=0, progress=False)


# ------------------------------------------------------------------ state norms in the perplexity eval
@pytest.mark.parametrize("rule", ["looped", "scse"])
def test_evaluate_depths_state_rms_is_the_mean_token_rms_of_the_read_state(rule):
    """``evaluate_depths(state_rms=True)`` (the trainer logs it at every validation) against per-depth
    forwards with the states returned and a float64 NumPy aggregation over the scored tokens only."""
    import numpy as np

    from looplm.data.tokens import eval_windows
    from looplm.eval.perplexity import evaluate_depths

    model = tiny(rule=rule, readout="raw").float()
    tokens = np.random.default_rng(3).integers(0, V, size=5 * L + 7)  # the last window is partly masked
    res = evaluate_depths(model, tokens, [1, 3], batch_size=2, progress=False, state_rms=True)
    plain = evaluate_depths(model, tokens, [1, 3], batch_size=2, progress=False)
    for T in (1, 3):
        rms = []
        with torch.no_grad():
            for x, _, mask in eval_windows(tokens, L, 2):
                h = model(x, T, readout=Readout(states=True)).states[T].numpy().astype(np.float64)
                rms.append(np.sqrt((h ** 2).mean(-1))[mask.numpy()])
        rms = np.concatenate(rms)
        assert res[T]["tokens"] == rms.size == 5 * L + 6
        assert res[T]["state_rms"] == pytest.approx(rms.mean(), rel=1e-6)
        assert res[T]["state_rms_max"] == pytest.approx(rms.max(), rel=1e-6)
        assert res[T]["nll"] == plain[T]["nll"] and "state_rms" not in plain[T]
