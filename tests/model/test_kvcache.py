"""KV caches (SPEC §6): per_visit incremental decoding against the full forward for every variant,
left-padded batches against unpadded sequences, terminal-bank counts and bytes, terminal == per_visit
at depth 1, terminal KV sharing against an explicit attention over hooked terminal K/V, and the
continuation protocol (``looplm eval kv-sharing``) end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from looplm.analysis.flops import BODY_CALLS_PER_STEP
from looplm.eval.kvsharing import continuation_mask, kv_sharing_eval
from looplm.model import LoopLM
from looplm.model.kvcache import KVCache

from helpers import VARIANTS, L, hooked_visits, make, terminal_reference, tokens

SHARED = [name for name in VARIANTS if name != "unshared"]
DEPTHS = (1, 3, 5)


def _incremental(model: LoopLM, x: torch.Tensor, depth: int, prompt: int, mode: str = "per_visit") -> torch.Tensor:
    """Prefill x[:, :prompt], then one token at a time; the logits of every position (B, L, V)."""
    cache = KVCache(mode)
    outs = [model.read(model.loop(x[:, :prompt], cache=cache), depth).logits]
    for j in range(prompt, x.shape[1]):
        outs.append(model.read(model.loop(x[:, j:j + 1], cache=cache), depth).logits)
    return torch.cat(outs, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("name", SHARED)
def test_per_visit_incremental_equals_full_forward(name):
    model = make(name)
    model.final_depth = DEPTHS[-1]  # final_only_norm: one threshold for both paths (LoopLM.forward)
    x = tokens(b=2)
    full = model(x, depth=list(DEPTHS)).logits_by_depth
    worst = 0.0
    for R in DEPTHS:
        for prompt in (1, 4, L - 1):
            err = (_incremental(model, x, R, prompt) - full[R]).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, f"{name} R={R} prompt={prompt}: max |Δlogits| {err:.2e}"
    print(f"{name}: max |Δlogits| {worst:.2e}")


@torch.no_grad()
@pytest.mark.parametrize("name", SHARED)
def test_left_padded_batch_equals_unpadded_sequences(name):
    """A left-padded batch, prefilled then decoded with a cache, equals each sequence alone."""
    model = make(name)
    x = tokens(b=3)
    lengths = [L, 7, 3]
    pad = torch.zeros_like(x)
    mask = torch.zeros_like(x)
    for i, n in enumerate(lengths):
        pad[i, L - n:], mask[i, L - n:] = x[i, :n], 1
    R, split = 3, L - 2  # prefill the first L−2 columns (padding included), then 2 single tokens
    cache = KVCache("per_visit")
    batched = [model.read(model.loop(pad[:, :split], cache=cache, attention_mask=mask[:, :split]), R).logits]
    for j in range(split, L):
        batched.append(model.read(model.loop(pad[:, j:j + 1], cache=cache), R).logits)
    batched = torch.cat(batched, dim=1)  # (3, L, V)
    # uncached masked forward of the whole padded batch
    masked = model.read(model.loop(pad, attention_mask=mask), R).logits
    for i, n in enumerate(lengths):
        ref = model(x[i:i + 1, :n], depth=R).logits[0]  # (n, V)
        err = max((batched[i, L - n:] - ref).abs().max().item(), (masked[i, L - n:] - ref).abs().max().item())
        print(f"{name} row {i} (len {n}): max |Δlogits| {err:.2e}")
        assert err < 1e-4


def _core_visits_per_step(model: LoopLM) -> int:
    return BODY_CALLS_PER_STEP.get(model.cfg.rule, 1)


@torch.no_grad()
@pytest.mark.parametrize("name", ["looped", "scse", "sc_subtract", "huginn_linear-huginn", "deq_qkv-huginn",
                                  "looped-prelude-coda"])
def test_terminal_bank_count_and_bytes(name):
    model = make(name)
    cfg = model.cfg
    x = tokens(b=2)
    R, n = 5, 6
    caches = {mode: KVCache(mode) for mode in ("per_visit", "terminal")}
    for c in caches.values():
        model.read(model.loop(x[:, :n], cache=c), R)
    pv, term = caches["per_visit"], caches["terminal"]
    calls = _core_visits_per_step(model)
    physical = cfg.n_prelude + cfg.n_core * calls + cfg.n_coda  # terminal: one bank per core call of a step
    per_visit = cfg.n_prelude + cfg.n_coda + cfg.n_core * R * calls
    assert term.n_banks() == physical
    assert pv.n_banks() == per_visit
    bank_bytes = 2 * 2 * n * cfg.d_model * 4  # K and V, B=2, (H · head_dim) = d, float32
    assert term.nbytes() == physical * bank_bytes
    assert pv.nbytes() / term.nbytes() == pytest.approx(per_visit / physical)
    assert pv.length == term.length == n and pv.n_valid.tolist() == [n, n]
    print(f"{name}: banks per_visit {pv.n_banks()} vs terminal {term.n_banks()}, "
          f"bytes {pv.nbytes()} vs {term.nbytes()}")


ONE_CALL = list(SHARED)  # terminal keeps one bank per core call of a step, so two-call rules qualify too


@torch.no_grad()
@pytest.mark.parametrize("name", ONE_CALL)
def test_terminal_equals_per_visit_at_depth_one(name):
    """At R = 1 every visit is the terminal one, so the two layouts decode identically (rules with two
    core calls per step keep one terminal bank per call, so they qualify too)."""
    model = make(name)
    x = tokens(b=2)
    a = _incremental(model, x, 1, 4, "per_visit")
    b = _incremental(model, x, 1, 4, "terminal")
    assert torch.equal(a, b)  # exact: at R = 1 the two layouts run the same computation


def test_unknown_cache_mode_and_unshared():
    with pytest.raises(ValueError, match="allowed"):
        KVCache("nope")
    with pytest.raises(ValueError, match="shared"):
        make("unshared").loop(tokens(b=1), cache=KVCache())
    model = make("scse")
    with pytest.raises(ValueError, match="depth"):
        model.read(model.loop(tokens(b=1), cache=KVCache()), 0)


# --- an independent reference for terminal sharing -------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("name", ["looped", "huginn_linear-huginn", "orthoinj-huginn", "adapter"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_terminal_sharing_matches_explicit_reference(name, chunk):
    model = make(name)
    x = tokens(b=2)
    R, n = 4, 6
    cache = KVCache("terminal")
    model.read(model.loop(x[:, :n], cache=cache), R)
    got = model.read(model.loop(x[:, n:n + chunk], cache=cache), R).logits
    visits = hooked_visits(model, x[:, :n], R)
    kv = {lid: calls[-1] for lid, calls in visits.items()}
    for lid, (k, v) in kv.items():  # the terminal banks are the last visit's K/V
        assert torch.allclose(cache.banks[(lid, 0)][0][:, :, :n], k, atol=1e-6)
        assert torch.allclose(cache.banks[(lid, 0)][1][:, :, :n], v, atol=1e-6)
    ref = terminal_reference(model, visits, x[:, n:n + chunk], n, R)
    full = model(x[:, :n + chunk], depth=R).logits[:, n:]
    err = (got - ref).abs().max().item()
    gap = (got - full).abs().max().item()
    print(f"{name} chunk={chunk}: |terminal − reference| {err:.2e}; |terminal − full forward| {gap:.2e}")
    assert err < 1e-5
    assert gap > 1e-4  # sharing really changes the computation at R > 1


# --- the continuation protocol ---------------------------------------------------------------------


@torch.no_grad()
def test_kv_sharing_eval_matches_hand_protocol():
    torch.manual_seed(0)
    model = make("huginn_linear-huginn")
    g = np.random.default_rng(0)
    stream = g.integers(0, 97, size=3 * L + 5)  # three full windows and a partial one (dropped)
    res = kv_sharing_eval(model, stream, [1, 3], batch_size=2, progress=False)
    P = L // 2
    for R in (1, 3):
        full = term = 0.0
        for w in range(3):
            x = torch.from_numpy(stream[w * L: (w + 1) * L + 1].astype(np.int64))[None]
            xi, y = x[:, :-1], x[:, 1:]
            full += float(model(xi, depth=R, targets=y).nll_by_depth[R][:, P:].sum())
            cache = KVCache("terminal")
            model.read(model.loop(xi[:, :P], cache=cache), R)
            term += float(model.read(model.loop(xi[:, P:], cache=cache), R, y[:, P:]).nll_by_depth[R].sum())
        r = res[R]
        n = 3 * (L - P)
        assert r["tokens"] == n and r["sequences"] == 3 and r["prefix_tokens"] == P
        assert r["ppl_full"] == pytest.approx(math.exp(full / n), rel=1e-6)
        assert r["ppl_terminal"] == pytest.approx(math.exp(term / n), rel=1e-6)
        assert r["ppl_per_visit"] == pytest.approx(r["ppl_full"], rel=1e-5)
        assert r["sharing_penalty_pct"] == pytest.approx(100 * (r["ppl_terminal"] / r["ppl_full"] - 1))
        assert r["kv_banks_terminal"] == 4 and r["kv_banks_full"] == 2 + 2 * R
        assert r["kv_bytes_full"] / r["kv_bytes_terminal"] == pytest.approx((2 + 2 * R) / 4)
        assert r["kv_bytes_terminal"] == 4 * 2 * P * model.cfg.d_model * 4
    assert res[1]["sharing_penalty_pct"] == pytest.approx(0.0, abs=1e-4)
    assert abs(res[3]["sharing_penalty_pct"]) > 1e-3
    with pytest.raises(ValueError, match="full window"):
        kv_sharing_eval(model, stream[:L], [3], progress=False)
    with pytest.raises(ValueError, match="shared"):
        kv_sharing_eval(make("unshared"), stream, [3], progress=False)


@torch.no_grad()
def test_kv_sharing_doc_aware_scores_only_the_prompts_document():
    """LMDR's continuation scoring on a hand-built stream (L = 12, P = 6, <|endoftext|> = id 0): a target
    x_{j+1}, j ≥ P, counts iff no end-of-text lies in x_{P−1} … x_j."""
    assert L == 12
    P, EOT = L // 2, 0
    stream = np.random.default_rng(1).integers(1, 97, size=3 * L + 1)  # no EOT except where placed
    stream[3] = EOT  # window 0: a document begins inside the prompt, runs to the end: all 6 targets count
    stream[L + 8] = EOT  # window 1: targets x_7, x_8 (= EOT, closing the document) count; x_9 … x_12 do not
    stream[2 * L + 5] = EOT  # window 2: the prompt's last token ends its document: nothing counts
    want = [[True] * 6, [True, True, False, False, False, False], [False] * 6]
    windows = torch.from_numpy(np.stack([stream[w * L: w * L + L] for w in range(3)]).astype(np.int64))
    assert continuation_mask(windows, P, EOT).tolist() == want
    assert continuation_mask(windows, P, None).all()

    model = make("huginn_linear-huginn")
    res = kv_sharing_eval(model, stream, [1, 3], batch_size=2, progress=False, eot_id=EOT)
    for R in (1, 3):
        full = term = 0.0
        for w in range(3):
            x = torch.from_numpy(stream[w * L: (w + 1) * L + 1].astype(np.int64))[None]
            xi, y = x[:, :-1], x[:, 1:]
            keep = torch.tensor(want[w], dtype=torch.float64)
            full += float((model(xi, depth=R, targets=y).nll_by_depth[R][0, P:].double() * keep).sum())
            cache = KVCache("terminal")
            model.read(model.loop(xi[:, :P], cache=cache), R)
            term += float((model.read(model.loop(xi[:, P:], cache=cache), R, y[:, P:]).nll_by_depth[R][0].double()
                           * keep).sum())
        assert res[R]["tokens"] == 8 and res[R]["sequences"] == 3
        assert res[R]["ppl_full"] == pytest.approx(math.exp(full / 8), rel=1e-6)
        assert res[R]["ppl_terminal"] == pytest.approx(math.exp(term / 8), rel=1e-6)
        assert res[R]["ppl_per_visit"] == pytest.approx(res[R]["ppl_full"], rel=1e-5)
    with pytest.raises(ValueError, match="no second-half target continues"):
        kv_sharing_eval(model, stream[2 * L:], [1], progress=False, eot_id=EOT)


@torch.no_grad()
def test_kv_sharing_eval_final_only_norm_full_equals_per_visit():
    """The full forward and the cached continuations use one final_only_norm threshold, so the
    per_visit continuation reproduces the full PPL at every depth (not only the largest)."""
    model = make("looped-final_only_norm")
    stream = np.random.default_rng(0).integers(0, 97, size=2 * L + 1)
    res = kv_sharing_eval(model, stream, [1, 3], batch_size=2, progress=False)
    for R in (1, 3):
        assert res[R]["ppl_per_visit"] == pytest.approx(res[R]["ppl_full"], rel=1e-5), R
    assert not model.training


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_cfg, tiny_data):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("kvsharing") / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


def test_cli_eval_kv_sharing(checkpoint, tmp_path, capsys):
    from looplm.cli import main

    out = tmp_path / "kv.json"
    rc = main(["eval", "kv-sharing", "--checkpoint", str(checkpoint), "--depths", "1,4",
               "--max-tokens", "300", "--batch-size", "4", "--out", str(out), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["depths"]) == {"1", "4"}
    for key in ("ppl_full", "ppl_terminal", "sharing_penalty_pct", "kv_bytes_full", "kv_bytes_terminal"):
        assert key in res["depths"]["4"]
    assert res["depths"]["1"]["sharing_penalty_pct"] == pytest.approx(0.0, abs=1e-4)
    assert res["depths"]["4"]["kv_bytes_full"] == 4 * res["depths"]["4"]["kv_bytes_terminal"]  # K=1 core block
    assert res["depths"]["4"]["sequences"] == 300 // 32
    assert "sharing penalty" in out.with_suffix(".md").read_text()
    assert "PPL terminal" in capsys.readouterr().out


def test_loaded_checkpoint_sets_the_final_only_norm_threshold(checkpoint):
    from looplm.run.checkpoint import load_checkpoint

    model, cfg, _, _ = load_checkpoint(checkpoint)
    assert model.final_depth == cfg.depth.nominal_depth()


@torch.no_grad()
@pytest.mark.parametrize("name", ["looped-prelude-coda", "huginn_linear-huginn"])
def test_multi_depth_prefill_commits_only_the_last_readouts_coda(name):
    """Reading out at several depths while filling a cache must leave the same cache as one depth: the
    intermediate readouts' coda attention reads the cache but is not recorded."""
    model = make(name)
    x = tokens(b=2)
    a, b = KVCache("per_visit"), KVCache("per_visit")
    out_multi = model.read(model.loop(x[:, :5], cache=a), [1, 4])
    model.read(model.loop(x[:, :5], cache=b), 4)
    assert set(a.banks) == set(b.banks)
    for key in a.banks:
        assert torch.equal(a.banks[key][0], b.banks[key][0])  # exact: same computation
    nxt = model.read(model.loop(x[:, 5:7], cache=a), [2, 4]).logits_by_depth
    full = model(x[:, :7], depth=[2, 4]).logits_by_depth
    # the last depth is exact; an intermediate readout's coda sees the prefix's last-depth coda K/V
    assert torch.allclose(nxt[4], full[4][:, 5:], atol=1e-5)
    assert torch.allclose(out_multi.logits_by_depth[1], model(x[:, :5], depth=1).logits, atol=1e-5)
