"""Mechanism diagnostics (SPEC §7): exact zeros for SCSE, analytic values for a hand-built affine step
T_t(Δ) = A·Δ + b, zero dose response without an injection, and `looplm diagnose` end to end on a
checkpoint trained for a few steps."""

from __future__ import annotations

import json
import math

import pytest
import torch

from looplm.config import ModelConfig
from looplm.diagnostics.gain import random_directions
from looplm.diagnostics.runner import diagnose_model
from looplm.model import LoopContext, LoopLM, build_model, RecurrenceRule

V, D, L = 97, 16, 8


def tiny(**kw) -> LoopLM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=D, n_heads=2, d_ff=32, seq_len=L, dropout=0.1)
    base.update(kw)
    return build_model(ModelConfig(**base))


def batches(n: int = 2, b: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (b, L), generator=g) for _ in range(n)]


class AffineRule(RecurrenceRule):
    """T_t(Δ; e) = A·Δ + g·b per token (g the injection gain), anchor h* = e, Δ_0 = c."""

    name = "affine-test"  # deliberately not registered

    def __init__(self, cfg: ModelConfig, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        super().__init__(cfg)
        self.register_buffer("A", A)
        self.register_buffer("b", b)
        self.register_buffer("c", c)

    def start(self, e):
        return e + self.c, LoopContext(anchor=e, injection=self.b.expand_as(e))

    def step(self, core, state, t, ctx, *, mask=True):
        return ctx.anchor + (state - ctx.anchor) @ self.A.T + ctx.injection


def affine_model(A: torch.Tensor) -> tuple[LoopLM, torch.Tensor, torch.Tensor]:
    model = tiny(rule="looped")
    g = torch.Generator().manual_seed(3)
    b, c = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    model.rule = AffineRule(model.cfg, A, b, c)
    return model, b, c


def random_orthogonal(seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def test_scse_forcing_ratio_is_exactly_zero_and_dose_response_vanishes():
    res = diagnose_model(tiny(rule="scse"), batches(), steps=(0, 5), depth=6)
    for r in res["forcing"]:
        print(r)
        assert r["ratio"] == 0.0 and r["bias_max_abs"] == 0.0 and r["raw_bias_max_abs"] == 0.0
        assert r["anchor_energy"] > 0  # non-collapse: the ordinary trajectory stays off the anchor
    assert all(g["gain"] > 0 for g in res["gain"])
    assert res["rollout"]["bias0_rms"] == 0.0
    assert all(r["delta_rms"] == 0.0 and r["cosine"] is None for r in res["rollout"]["records"])
    for r in res["dose_response"]["records"]:
        assert r["displacement_rms"] == 0.0 and r["relative_to_push"] is None


@pytest.mark.parametrize("rule", ["scse", "scse-nomask"])
def test_injection_free_rule_has_zero_dose_response(rule):
    model = tiny(rule="scse", options=dict(mask=rule == "scse"))
    res = diagnose_model(model, batches(1), steps=(0,), depth=5)
    assert all(max(r["displacement_rms_by_t"]) == 0.0 for r in res["dose_response"]["records"])


def test_additive_rule_has_forcing_and_dose_response():
    res = diagnose_model(tiny(rule="looped"), batches(1), steps=(0, 3), depth=4)
    assert all(r["ratio"] > 0 and r["bias_energy"] > 0 for r in res["forcing"])
    dose = {r["gain"]: r for r in res["dose_response"]["records"]}
    print(dose)
    assert dose[0.0]["displacement_rms"] == 0.0
    assert 0 < dose[0.5]["displacement_rms"] < dose[1.0]["displacement_rms"] < dose[2.0]["displacement_rms"]
    assert dose[1.0]["cosine_to_unit_gain"] == pytest.approx(1.0)


def _expected_affine(A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, steps, B: int):
    """Forcing records of T(Δ) = AΔ + b with Δ_0 = c (broadcast over (B, L, d)), in float64."""
    delta, out = c.clone(), {}
    for t in range(max(steps) + 1):
        nxt = A @ delta + b
        if t in steps:
            motion = nxt - delta
            out[t] = {"bias_energy": float(b.pow(2).mean()), "ratio": float(b.pow(2).mean() / motion.pow(2).mean()),
                      "anchor_energy": float(delta.pow(2).mean())}
        delta = nxt
    return out


def test_affine_step_gives_analytic_bias_ratio_and_gain():
    g = torch.Generator().manual_seed(5)
    A = 0.6 * random_orthogonal(4) + 0.2 * torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    model, b, c = affine_model(A)
    xs = batches(1)
    steps = (0, 2, 6)
    res = diagnose_model(model, xs, steps=steps, depth=8, seed=11)
    want = _expected_affine(A, b, c, steps, B=xs[0].shape[0])
    dirs = random_directions((xs[0].shape[0], L, D), 4, seed=11)
    want_gain = float(torch.stack([(v @ A.T).flatten(1).norm(dim=1) for v in dirs]).mean())  # mean ‖A v‖_F
    for rec, grec in zip(res["forcing"], res["gain"]):
        t = rec["t"]
        print(t, rec, grec, want[t], want_gain)
        assert rec["bias_energy"] == pytest.approx(want[t]["bias_energy"], rel=1e-12)
        assert rec["raw_bias_energy"] == rec["bias_energy"]
        assert rec["ratio"] == pytest.approx(want[t]["ratio"], rel=1e-10)
        assert rec["anchor_energy"] == pytest.approx(want[t]["anchor_energy"], rel=1e-10)
        assert grec["gain"] == pytest.approx(want_gain, rel=1e-9)


def test_affine_orthogonal_step_gain_and_dose_are_exact():
    """gain(0.8·Q) = 0.8 for every direction; the dose response of an affine map is linear in the gain."""
    model, b, _ = affine_model(0.8 * random_orthogonal(7))
    res = diagnose_model(model, batches(2), steps=(0, 3), depth=5)
    assert all(r["gain"] == pytest.approx(0.8, rel=1e-10) for r in res["gain"])
    dose = {r["gain"]: r for r in res["dose_response"]["records"]}
    for gain in (0.5, 1.0, 2.0):
        assert dose[gain]["relative_to_push"] == pytest.approx(gain, rel=1e-10)
        assert dose[gain]["cosine_to_unit_gain"] == pytest.approx(1.0, abs=1e-12)
    # Δ_1 from the anchor is exactly b_0, so the forcing-ray cosine starts at 1
    assert res["rollout"]["records"][1]["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert res["rollout"]["bias0_rms"] == pytest.approx(float(b.pow(2).mean().sqrt()), rel=1e-12)


def test_diagnose_model_argument_errors():
    with pytest.raises(ValueError, match="steps"):
        diagnose_model(tiny(rule="scse"), batches(1), steps=(0, 47), depth=8)
    with pytest.raises(ValueError, match="unshared"):
        diagnose_model(tiny(architecture="unshared", n_layers=2), batches(1), steps=(0,), depth=2)
    with pytest.raises(ValueError, match="dtype"):
        diagnose_model(tiny(rule="scse"), batches(1), steps=(0,), depth=2, dtype="float16")


def test_diagnose_does_not_touch_the_model():
    model = tiny(rule="adapter").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diagnose_model(model, batches(1), steps=(0,), depth=2)
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # exact: untouched weights


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_cfg, tiny_data):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("diag-run")
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


@pytest.mark.slow
def test_diagnose_checkpoint_end_to_end(trained_run, tmp_path):
    from looplm.diagnostics.runner import diagnose_checkpoint

    res = diagnose_checkpoint(trained_run, steps=(0, 5), depth=6, batches=2, batch_size=2, out_dir=tmp_path,
                              progress=False)
    json.dumps(res, allow_nan=False)  # strict JSON: undefined cosines are null, never NaN
    assert res["rule"] == "scse" and res["split"] == "valid" and res["batches"] == 2
    assert [r["t"] for r in res["forcing"]] == [0, 5] and [r["t"] for r in res["gain"]] == [0, 5]
    for r in res["forcing"]:
        assert set(r) >= {"t", "bias_energy", "raw_bias_energy", "ratio", "anchor_energy"}
        assert r["ratio"] == 0.0  # trained SCSE keeps exact anchor invariance
    assert len(res["rollout"]["records"]) == 7 and len(res["dose_response"]["records"]) == 4
    assert "R_5" in res["markdown"] and "gain t=0" in res["markdown"]
    for key in ("markdown", "forcing_ratio_plot", "rollout_plot"):
        path = tmp_path / res["files"][key].split("/")[-1]
        assert path.is_file() and path.stat().st_size > 0
    assert res["files"]["forcing_ratio_plot"].endswith(".png") and res["files"]["rollout_plot"].endswith(".png")


def test_cli_diagnose_writes_json_and_plots(trained_run, tmp_path, capsys):
    from looplm.cli import main

    out = tmp_path / "diag" / "tiny.json"
    rc = main(["diagnose", "--checkpoint", str(trained_run), "--out", str(out), "--depth", "4",
               "--batches", "1", "--batch-size", "2", "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["t"] for r in data["forcing"]] == [0, 3] and [r["t"] for r in data["gain"]] == [0, 3]
    assert all("gain" in r for r in data["gain"])
    for name in ("tiny.md", "tiny_forcing_ratio.png", "tiny_rollouts.png"):
        assert (out.parent / name).is_file()
    assert "Anchor-response forcing-bias diagnostic" in capsys.readouterr().out


def test_cli_diagnose_rejects_steps_beyond_depth(trained_run, capsys):
    from looplm.cli import main

    rc = main(["diagnose", "--checkpoint", str(trained_run), "--depth", "4", "--steps", "0,9", "--quiet"])
    assert rc == 2
    assert "steps" in capsys.readouterr().err
