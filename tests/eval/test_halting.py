"""Logit-margin halting (SPEC §6): the halting rule against hand-computed loops, τ calibration against
a brute-force sweep, the dynamic-batching run against the cached per-loop forward (every rule and
readout), and the checkpoint report end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from looplm.config import ModelConfig
from looplm.eval import exits
from looplm.eval.exits import build_exit_criterion, calibrate, halting_depths, split_batches
from looplm.eval.halting import evaluate_halting_checkpoint, fixed_depth_run, make_windows
from looplm.eval.perplexity import evaluate_depths
from looplm.model import RULES, LoopLM, build_model

K_MAX = 4


def test_halting_depths_above_first_loop_at_or_above_tau():
    m = np.array([[0.1, 0.5, 0.9, 2.0],
                  [0.7, 0.1, 0.1, 0.1],
                  [0.1, 0.1, 0.1, 9.0],      # only the last loop is large: K either way
                  [0.3, 0.2, 0.6, 0.0],
                  [np.nan, 0.8, 0.1, 0.1]])  # NaN never halts
    assert halting_depths(m, 0.5, "above").tolist() == [2, 1, 4, 3, 2]
    assert halting_depths(m, 0.3, "above").tolist() == [2, 1, 4, 1, 2]  # ≥, not >
    assert halting_depths(m, 0.0, "above").tolist() == [1, 1, 1, 1, 2]
    assert halting_depths(m, math.inf, "above").tolist() == [4, 4, 4, 4, 4]
    assert halting_depths(m[:, :1], 0.0, "above").tolist() == [1] * 5  # K = 1: the ceiling is loop 1


def _brute_force_tau(margins, nll_sum, n_tok, tolerance):
    """Reference: try every τ in ascending order with halting_depths, keep the first within budget."""
    K = margins.shape[1]
    ppl_max = math.exp(nll_sum[:, K - 1].sum() / n_tok.sum())
    for tau in sorted(set(margins[:, : K - 1].ravel().tolist())) + [math.inf]:
        loops = halting_depths(margins, tau, "above")
        ppl = math.exp(nll_sum[np.arange(len(loops)), loops - 1].sum() / n_tok.sum())
        if ppl <= (1 + tolerance) * ppl_max:
            return tau, loops, ppl
    raise AssertionError("unreachable: tau = inf always qualifies")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tolerance", [0.0, 0.01, 0.05])
def test_calibrate_tolerance_matches_brute_force(seed, tolerance):
    rng = np.random.default_rng(seed)
    N, K = 37, 5
    n_tok = rng.integers(5, 40, size=N)
    # margins grow with depth (with noise and ties), NLL falls with depth but not for every sequence
    margins = np.round(rng.gamma(2.0, 0.5, size=(N, K)) * np.linspace(0.5, 1.5, K), 1)
    per_tok = 3.0 + rng.normal(0, 0.3, size=(N, 1)) - np.linspace(0, 0.2, K) + rng.normal(0, 0.05, size=(N, K))
    nll_sum = per_tok * n_tok[:, None]
    cal = calibrate(margins, "above", tolerance=tolerance, nll=nll_sum, tokens=n_tok)
    tau, loops, ppl = _brute_force_tau(margins, nll_sum, n_tok, tolerance)
    print(f"tau {cal.tau} (ref {tau}), mean loops {cal.mean_depth:.3f}, ppl {cal.ppl:.5f} / {cal.ppl_max:.5f}")
    assert cal.tau == tau
    np.testing.assert_array_equal(cal.depths, loops)
    assert cal.ppl == pytest.approx(ppl, rel=1e-12)
    assert cal.ppl <= (1 + tolerance) * cal.ppl_max
    assert cal.mean_depth == loops.mean()
    # every candidate's sweep entry matches the per-τ reference too
    for t, p, ml in zip(cal.taus, cal.ppl_by_tau, cal.mean_depth_by_tau):
        lp = halting_depths(margins, t, "above")
        assert ml == lp.mean()
        assert p == pytest.approx(math.exp(nll_sum[np.arange(N), lp - 1].sum() / n_tok.sum()), rel=1e-12)


def test_calibrate_tolerance_hand_built():
    # two sequences, 3 loops, 10 tokens each; K=3 NLL total 40 → ppl_max = e^2
    margins = np.array([[1.0, 2.0, 3.0],
                        [0.5, 4.0, 5.0]])
    nll_sum = np.array([[20.0, 20.0, 20.0],     # sequence 0 gains nothing from depth
                        [30.0, 20.1, 20.0]])    # sequence 1 needs loop 2
    n_tok = np.array([10, 10])
    cal = calibrate(margins, "above", tolerance=0.01, nll=nll_sum, tokens=n_tok)
    # τ=0.5: both at loop 1 → 50/20, too high; τ=1: seq 0 at 1, seq 1 at 2 → 40.1/20 nats, PPL × e^0.005 ≤ 1.01
    assert cal.tau == 1.0 and cal.depths.tolist() == [1, 2]
    assert cal.ppl == pytest.approx(math.exp(40.1 / 20))
    no_slack = calibrate(margins, "above", tolerance=0.0, nll=nll_sum, tokens=n_tok)
    assert no_slack.tau == math.inf  # no slack: only τ = ∞ is exact
    with pytest.raises(ValueError, match="tolerance"):
        calibrate(margins, "above", tolerance=-0.1, nll=nll_sum, tokens=n_tok)
    with pytest.raises(ValueError, match="shape|need"):
        calibrate(margins, "above", tolerance=0.01, nll=nll_sum[:, :2], tokens=n_tok)


def _tiny_model(rule: str, **kw) -> LoopLM:
    torch.manual_seed(0)
    cfg = ModelConfig(rule=rule, vocab_size=64, d_model=32, n_heads=2, d_ff=64, seq_len=16, dropout=0.0,
                      init_std=0.1, **kw)
    return build_model(cfg).eval()


def _cases():
    cases = [(rule, {}) for rule in sorted(RULES)]
    cases += [("plain", {"readout": r}) for r in ("raw", "final_only_norm")]
    return cases


@pytest.mark.parametrize("rule,kw", _cases(), ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{a}={b}" for a, b in v.items()) or "default")
def test_dynamic_batching_equals_cached_per_loop_nll(rule, kw):
    """Second code path: the step-by-step run with halted rows leaving the batch gives the same
    margins, halting loops and per-sequence NLL as one cached depth=[1..K] forward."""
    model = _tiny_model(rule, **kw)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (23, 16), generator=g)
    y = torch.randint(0, 64, (23, 16), generator=g)
    batches = split_batches(x, y, 5, "cpu")  # uneven last batch
    tr = exits.trace(model, batches, build_exit_criterion("margin", 0.0), K_MAX)
    margins, nll_sum, n_tok = tr.scores, tr.nll, tr.tokens
    assert margins.shape == nll_sum.shape == (23, K_MAX) and (n_tok == 16).all()
    # τ halfway between two observed margins (no ties under float rounding), the one spreading the
    # halting loops most, so rows leave the batch at several loops and the rest continue
    v = np.unique(margins[:, : K_MAX - 1])
    spread = [(len(np.unique(d)), -np.bincount(d).max(), t)
              for t in (v[:-1] + v[1:]) / 2 for d in [halting_depths(margins, t, "above")]]
    tau = float(max(spread)[2])
    ref_loops = halting_depths(margins, tau, "above")
    run = exits.run(model, batches, build_exit_criterion("margin", tau), K_MAX)
    print(rule, kw, "loops", np.bincount(run.depth, minlength=K_MAX + 1)[1:].tolist(),
          "max |Δnll|", np.abs(run.nll - nll_sum[np.arange(23), run.depth - 1]).max())
    assert len(np.unique(ref_loops)) > 1  # the check covers halted and continuing rows
    np.testing.assert_array_equal(run.depth, ref_loops)
    np.testing.assert_allclose(run.nll, nll_sum[np.arange(23), run.depth - 1], rtol=0, atol=1e-5 * 16)
    seen = ~np.isnan(run.scores)
    assert seen.sum() == sum(min(k, K_MAX - 1) for k in run.depth)  # margins at loops 1..halt (< K)
    np.testing.assert_allclose(run.scores[seen], margins[seen], rtol=0, atol=1e-5)
    assert run.row_steps == run.depth.sum()
    # τ = ∞: everything at K, equal to the cached K column and to the fixed-depth forward
    full = exits.run(model, batches, build_exit_criterion("margin", math.inf), K_MAX)
    nll_fixed, _ = fixed_depth_run(model, batches, K_MAX)
    assert (full.depth == K_MAX).all() and full.row_steps == 23 * K_MAX
    np.testing.assert_allclose(full.nll, nll_sum[:, -1], rtol=0, atol=1e-5 * 16)
    np.testing.assert_allclose(full.nll, nll_fixed, rtol=0, atol=1e-5 * 16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_cfg, tiny_data):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("halting") / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


def test_halting_checkpoint_report(checkpoint, tmp_path):
    out = tmp_path / "halting"
    res = evaluate_halting_checkpoint(checkpoint, out, n_calib=160, n_timed=48, batch_size=16, repeats=2,
                                      split_timed="valid", progress=False)
    print(res["markdown"])
    on_disk = json.loads((out / "halting.json").read_text())
    assert on_disk["calibration"] == res["calibration"]
    assert (out / "halting.md").read_text().startswith("## Logit-margin halting")
    assert (out / "halting_frontier.png").stat().st_size > 1000
    K = res["k_max"]
    assert K == 4  # the training depth of tiny_cfg (uniform 1..4)
    cal, tm = res["calibration"], res["timed"]
    for key in ("tau", "halts_early", "mean_loops", "ppl_dynamic", "ppl_kmax", "ppl_by_k", "loop_counts"):
        assert key in cal
    for key in ("seconds", "tokens_per_s", "ppl", "mean_loops"):
        assert key in tm["dynamic"] and key in tm["static"]
    assert res["repeats"] == 2 and cal["sequences"] == 160 and cal["tokens"] == 160 * 32
    assert res["first_timed_window"] == 160 and tm["sequences"] == 48  # disjoint slice of the same split
    assert cal["ppl_dynamic"] <= 1.01 * cal["ppl_kmax"]
    assert cal["ppl_kmax"] == pytest.approx(cal["ppl_by_k"][str(K)])
    assert 1 <= cal["mean_loops"] <= K and 1 <= tm["dynamic"]["mean_loops"] <= K
    assert sum(tm["dynamic"]["loop_counts"].values()) == 48
    assert tm["speedup"] == pytest.approx(tm["static"]["seconds"] / tm["dynamic"]["seconds"])
    assert [p["k"] for p in res["frontier"]] == list(range(1, K + 1))
    assert tm["static"]["ppl"] == res["frontier"][-1]["ppl"]
    # the fixed-K frontier PPL and the calibration PPL by K agree with the multi-depth evaluator
    from looplm.data.paths import resolve_cache_dir, resolve_data_root
    from looplm.data.tokens import load_tokens
    from looplm.eval.runner import load_tokenizer_for
    from looplm.run.checkpoint import load_checkpoint

    model, cfg, _, ckpt = load_checkpoint(checkpoint)
    valid = load_tokens(cfg.data, "valid", load_tokenizer_for(ckpt), resolve_data_root(""), resolve_cache_dir(""))
    L = cfg.model.seq_len
    ref_cal = evaluate_depths(model, valid[: 160 * L + 1], range(1, K + 1), progress=False)
    ref_timed = evaluate_depths(model, valid[160 * L: 208 * L + 1], range(1, K + 1), progress=False)
    for k in range(1, K + 1):
        assert cal["ppl_by_k"][str(k)] == pytest.approx(ref_cal[k]["ppl"], rel=1e-5)
        assert res["frontier"][k - 1]["ppl"] == pytest.approx(ref_timed[k]["ppl"], rel=1e-5)
    # the timed dynamic PPL: the same halting rule applied to a cached trace of the timed windows
    model.eval()
    x, y = make_windows(valid, L, 160, 48)
    tr = exits.trace(model, split_batches(x, y, len(x), "cpu"), build_exit_criterion("margin", 0.0), K)
    margins, nll_sum, n_tok = tr.scores, tr.nll, tr.tokens
    tau = math.inf if cal["tau"] is None else cal["tau"]
    loops = halting_depths(margins, tau, "above")
    assert tm["dynamic"]["mean_loops"] == pytest.approx(loops.mean())
    assert tm["dynamic"]["ppl"] == pytest.approx(math.exp(nll_sum[np.arange(48), loops - 1].sum() / n_tok.sum()),
                                                 rel=1e-5)
    with pytest.raises(ValueError, match="full windows"):
        evaluate_halting_checkpoint(checkpoint, out, n_calib=10 ** 6, progress=False)
