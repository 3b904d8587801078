"""Adaptive depth (hidden-update rule, SPEC §6): stop rule and calibration against hand-computed and
brute-force references, the full trace against LoopLM.forward, real early exit against the offline
accounting for every recurrence rule, and the checkpoint report end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from looplm.config import ModelConfig
from looplm.eval.adaptive import adaptive_depth_checkpoint
from looplm.eval.exits import build_exit_criterion, calibrate, halting_depths, run, trace
from looplm.eval.perplexity import evaluate_depths, token_batches
from looplm.model import RULES, LoopLM, build_model
from looplm.model.cursor import Readout

CEIL = 6


def test_halting_depths_below_hand_computed():
    u = np.array([[0.5, 0.2, 0.05, 0.01],
                  [0.1, 0.3, 0.3, 0.3],
                  [0.9, 0.9, 0.9, 0.05],   # only the last step is small: the ceiling either way
                  [0.0, 0.0, 0.0, 0.0]])
    assert halting_depths(u, 0.15, "below").tolist() == [3, 1, 4, 1]
    assert halting_depths(u, 0.06, "below").tolist() == [3, 4, 4, 1]
    assert halting_depths(u, 0.0, "below").tolist() == [4, 4, 4, 4]  # u < 0 never holds
    assert halting_depths(u, 1.0, "below").tolist() == [1, 1, 1, 1]


def test_calibration_is_the_closest_attainable_mean_depth():
    rng = np.random.default_rng(0)
    u = np.exp(rng.normal(-2.0, 1.0, size=(37, 10))) * np.linspace(1.0, 0.2, 10)  # decaying updates
    # brute force over every distinct mean depth τ can give
    taus = np.concatenate([[0.0], np.unique(u) * (1 + 1e-9), [10.0]])
    attainable = np.unique([halting_depths(u, t, "below").mean() for t in taus])
    for target in (1, 2.5, 4, 7, 10):
        cal = calibrate(u, "below", target_depth=target)
        tau, depth = cal.tau, cal.mean_depth
        assert depth == halting_depths(u, tau, "below").mean()
        best = attainable[np.argmin(np.abs(attainable - target))]
        print(target, tau, depth, best)
        assert abs(depth - target) == pytest.approx(abs(best - target))
    assert calibrate(u, "below", target_depth=10).mean_depth == 10.0  # target = ceiling: every example at the ceiling
    with pytest.raises(ValueError, match="outside"):
        calibrate(u, "below", target_depth=11)


def _model(rule: str, vocab: int, **kw) -> LoopLM:
    torch.manual_seed(0)
    arch = "unshared" if rule == "unshared" else "shared"
    cfg = ModelConfig(architecture=arch, rule="scse" if arch == "unshared" else rule, vocab_size=vocab,
                      d_model=32, n_heads=2, d_ff=64, seq_len=32, dropout=0.0, init_std=0.1, **kw)
    return build_model(cfg).eval()


@torch.no_grad()
def test_trace_matches_forward_states_and_nll(tiny_data):
    """u_t from LoopLM.forward's returned states, NLL from its nll_by_depth: one window at a time."""
    model = _model("scse", tiny_data.vocab_size, n_prelude=1, n_coda=1)
    tokens = np.asarray(tiny_data.valid[:300])
    batches = list(token_batches(tokens, model.cfg.seq_len, 4))
    tr = trace(model, batches, build_exit_criterion("hidden_update", 0.0), CEIL)
    L = model.cfg.seq_len
    assert tr.scores.shape == tr.nll.shape == (math.ceil(299 / L), CEIL)
    for b in range(len(tr.tokens)):
        w = torch.from_numpy(tokens[b * L: (b + 1) * L + 1].astype(np.int64))
        x, y = w[:-1][None], w[1:][None]
        n = y.shape[1]
        out = model(x[:, :n], list(range(1, CEIL + 1)), y, readout=Readout(logits=False, states=True))
        for t in range(CEIL):
            h, h1 = out.states[t][0, :n], out.states[t + 1][0, :n]
            u = ((h1 - h).norm(dim=-1) / (h.norm(dim=-1) + 1e-8)).max()
            assert tr.scores[b, t] == pytest.approx(float(u), rel=1e-5)
            assert tr.nll[b, t] == pytest.approx(float(out.nll_by_depth[t + 1].sum()), rel=1e-5)
        assert tr.tokens[b] == n
    assert tr.scores.std() > 0


@pytest.mark.parametrize("rule", sorted(RULES) + ["unshared"])
def test_early_exit_equals_offline_accounting(rule, tiny_data):
    model = _model(rule, tiny_data.vocab_size, **({"n_layers": 4} if rule == "unshared" else {}))
    tokens = np.asarray(tiny_data.valid[:800])
    batches = list(token_batches(tokens, model.cfg.seq_len, 8))
    tr = trace(model, batches, build_exit_criterion("hidden_update", 0.0), CEIL)
    for target in (CEIL / 2, CEIL / 2 + 0.5, CEIL / 2 + 1, CEIL / 2 - 0.5):  # the first that splits examples
        # (rules started from h_0 = 0 halt in lockstep early)
        tau = calibrate(tr.scores, "below", target_depth=target).tau
        offline = halting_depths(tr.scores, tau, "below")
        if len(set(offline.tolist())) > 1:
            break
    ee = run(model, batches, build_exit_criterion("hidden_update", tau), CEIL)
    print(rule, "tau", tau, "depths", np.bincount(offline, minlength=CEIL + 1)[1:],
          "max |Δnll|", np.abs(ee.nll - tr.nll[np.arange(len(offline)), offline - 1]).max())
    assert len(set(offline.tolist())) > 1  # the rule really halts examples at different depths
    assert ee.depth.tolist() == offline.tolist()
    np.testing.assert_allclose(ee.nll, tr.nll[np.arange(len(offline)), offline - 1], rtol=1e-5)
    assert ee.tokens.tolist() == tr.tokens.tolist()
    assert ee.row_steps == offline.sum()  # halted rows really left the batch
    full = run(model, batches, build_exit_criterion("hidden_update", -math.inf), CEIL)
    assert (full.depth == CEIL).all() and full.row_steps == CEIL * len(offline)
    np.testing.assert_allclose(full.nll, tr.nll[:, -1], rtol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_cfg, tiny_data):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("adaptive") / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


def test_adaptive_depth_checkpoint_report(checkpoint):
    res = adaptive_depth_checkpoint(checkpoint, targets=(2, 3, 4), ceiling=4, max_tokens=1500, batch_size=8,
                                    progress=False)
    json.dumps(res)
    print(res["markdown"])
    assert res["examples"] == {"valid": math.ceil(1500 / 32), "test": math.ceil(1500 / 32)}
    assert res["tokens"] == {"valid": 1500, "test": 1500}
    # static columns agree with the multi-depth perplexity evaluator (an independent code path)
    from looplm.data.paths import resolve_cache_dir, resolve_data_root
    from looplm.data.tokens import load_tokens
    from looplm.eval.runner import load_tokenizer_for
    from looplm.run.checkpoint import load_checkpoint

    model, cfg, _, ckpt = load_checkpoint(checkpoint)
    test = load_tokens(cfg.data, "test", load_tokenizer_for(ckpt), resolve_data_root(""), resolve_cache_dir(""))
    ref = evaluate_depths(model, test, [1, 4], max_tokens=1500, progress=False)
    for T in (1, 4):
        assert res["static"][str(T)]["test_ppl"] == pytest.approx(ref[T]["ppl"], rel=1e-5)
    for t in ("2", "3"):
        e = res["targets"][t]
        assert abs(e["valid_mean_depth"] - int(t)) < 0.5
        assert 1 <= e["test_mean_depth"] <= 4
        assert sum(e["test_depth_counts"].values()) == res["examples"]["test"]
        ee = e["early_exit"]
        assert ee["depth_agreement"] == 1.0 and ee["max_abs_nll_diff"] < 1e-3
        assert ee["test_ppl"] == pytest.approx(e["test_ppl"], rel=1e-5)
        assert ee["row_steps"] < ee["full_row_steps"] and ee["speedup"] > 0
    # the target at the ceiling keeps every example there: the static ceiling PPL
    top = res["targets"]["4"]
    assert top["valid_mean_depth"] == top["test_mean_depth"] == 4.0
    assert top["test_ppl"] == pytest.approx(res["static"]["4"]["test_ppl"])
    assert "| Static T=4 | Adaptive 2 | Adaptive 3 | Adaptive 4 |" in res["markdown"].replace(
        "| model (test PPL) ", "")
    with pytest.raises(ValueError, match="outside"):
        adaptive_depth_checkpoint(checkpoint, targets=(5,), ceiling=4, max_tokens=100, progress=False)
