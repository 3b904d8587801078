"""The loop exists once (issue 10): every consumer runs :meth:`LoopLM.step`, checked over the product
rule × scale_control × readout × {no cache, per_visit, terminal} against a hand-unrolled reference
loop, the early-exit runner against its offline accounting, cached decoding against recompute, and
the diagnostics against the realized step of a model with a scale control."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from looplm.config import RULE_NAMES, ModelConfig
from looplm.diagnostics.forcing import forcing_profile
from looplm.diagnostics.gain import gain_profile, random_directions
from looplm.eval.exits import build_exit_criterion, halting_depths, run, trace
from looplm.eval.generate import generate
from looplm.model import LoopLM, build_model
from looplm.model.kvcache import KVCache
from looplm.model.cursor import Gradient, Readout

from helpers import hooked_visits, terminal_reference

RULES = sorted(RULE_NAMES)
SCALE = ("none", "inter_loop_norm", "spectral_damping")
READOUT = ("rmsnorm", "raw", "final_only_norm")
V, SEQ = 61, 12
PRODUCT = [(r, s, o) for r in RULES for s in SCALE for o in READOUT]


def _ids(v):
    return v if isinstance(v, str) else None


def model_for(rule: str, scale: str, readout: str) -> LoopLM:
    """A tiny model with a prelude and a coda (so every KV path is used), gains perturbed so that the
    between-loop norm and the readout norm are not the identity's neighbours."""
    torch.manual_seed(0)
    cfg = ModelConfig(rule=rule, scale_control=dict(kind=scale), readout=readout, vocab_size=V, d_model=24, n_heads=2,
                      d_ff=48, seq_len=SEQ, dropout=0.0, init_std=0.1, n_prelude=1, n_coda=1)
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):  # RMSNorm gains
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def tokens(b: int = 2, n: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def reference_states(model: LoopLM, x: torch.Tensor, T: int) -> list[torch.Tensor]:
    """h_0 … h_T written out by hand from the rule's update and the SPEC §4 scale controls (an
    independent unroll: it calls neither ``LoopLM.step`` nor ``forward``)."""
    rule, scale = model.rule, model.cfg.scale_control.NAME
    state, ctx = rule.start(model.embed(x))

    def core(z, qkv_inject=None, *, call=0):
        return model.core(z, qkv_inject)

    hs = [rule.hidden(state, ctx)]
    for t in range(T):
        state = rule.step(core, state, t, ctx)
        if scale != "none":
            h = rule.hidden(state, ctx)
            h = model.loop_norm(h) if scale == "inter_loop_norm" else torch.sigmoid(model.damping_raw) * h
            state = rule.to_state(h, ctx)
        hs.append(rule.hidden(state, ctx))
    return hs


@torch.no_grad()
@pytest.mark.parametrize("rule,scale,readout", PRODUCT, ids=_ids)
def test_forward_equals_reference_loop(rule, scale, readout):
    model = model_for(rule, scale, readout)
    x = tokens()
    depths = [0, 1, 3, 5]
    out = model(x, depths, readout=Readout(states=True))
    ref = reference_states(model, x, depths[-1])
    for T, (h, r) in enumerate(zip(out.states, ref)):
        assert torch.equal(h, r), (T, (h - r).abs().max())  # exact: same ops, same shapes
    for T in depths:  # final_only_norm: the final norm from the largest requested depth on
        assert torch.equal(out.logits_by_depth[T], model.readout(ref[T], final=T >= depths[-1]))  # exact: same readout


@torch.no_grad()
@pytest.mark.parametrize("rule,scale,readout", PRODUCT, ids=_ids)
@pytest.mark.parametrize("criterion", ["hidden_update", "margin"])
def test_early_exit_equals_offline_accounting(rule, scale, readout, criterion):
    """The runner (halted rows leave the batch) gives the depths and NLL of the trace (one forward)."""
    model = model_for(rule, scale, readout)
    x, y = tokens(9, seed=2), tokens(9, seed=3)
    batches = [(x[i:i + 4], y[i:i + 4], torch.ones(len(x[i:i + 4]), SEQ, dtype=torch.bool)) for i in (0, 4, 8)]
    C = 5
    crit = build_exit_criterion(criterion, 0.0)
    tr = trace(model, batches, crit, C)
    v = np.unique(tr.scores[:, : C - 1])
    crit.tau = float(np.median((v[:-1] + v[1:]) / 2)) if len(v) > 1 else float(v[0])  # a τ between observed values
    ref = halting_depths(tr.scores, crit.tau, crit.direction)
    res = run(model, batches, crit, C)
    np.testing.assert_array_equal(res.depth, ref)
    np.testing.assert_allclose(res.nll, tr.nll[np.arange(len(ref)), ref - 1], rtol=1e-5, atol=1e-5)
    assert res.row_steps == ref.sum()


def _greedy_recompute(model: LoopLM, prompt: list[int], n: int, R: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]), depth=R).logits[0, -1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
@pytest.mark.parametrize("rule,scale,readout", PRODUCT, ids=_ids)
@pytest.mark.parametrize("mode", ["per_visit", "terminal"])
def test_cached_decoding_equals_recompute(rule, scale, readout, mode):
    """per_visit: chunked cached logits equal the full forward (≤ 1e-5) and cached greedy decoding
    equals recomputing the whole prefix; terminal: cached logits equal an explicit attention over the
    prefix's terminal K/V (≤ 1e-5)."""
    model = model_for(rule, scale, readout)
    R = 3
    model.final_depth = R  # one final_only_norm threshold for every path
    x = tokens()
    n = 7
    cache = KVCache(mode)
    model.read(model.loop(x[:, :n], cache=cache), R)
    got = torch.cat([model.read(model.loop(x[:, j:j + 1], cache=cache), R).logits for j in range(n, SEQ)], dim=1)
    if mode == "per_visit":
        full = model(x, depth=R).logits[:, n:]
        assert (got - full).abs().max() <= 1e-5
        prompt = x[0, :4].tolist()
        assert generate(model, [prompt], 5, R).tokens[0] == _greedy_recompute(model, prompt, 5, R)
    else:
        cache = KVCache("terminal")
        model.read(model.loop(x[:, :n], cache=cache), R)
        got = model.read(model.loop(x[:, n:n + 1], cache=cache), R).logits
        ref = terminal_reference(model, hooked_visits(model, x[:, :n], R), x[:, n:n + 1], n, R)
        assert (got - ref).abs().max() <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("scale", ["inter_loop_norm", "spectral_damping"])
@pytest.mark.parametrize("rule", ["scse", "adapter", "looped"])
def test_diagnostics_measure_the_realized_step(rule, scale):
    """Forcing bias b_t = T_t(0) and the random-direction gain are computed through the model's
    realized step, scale control included: equal to the hand-unrolled map, and different from the
    rule's bare update (which the model never runs). (Under a between-loop norm or damping even
    SCSE's realized bias is not zero: the control rescales h = h* + Δ, not Δ.)"""
    model = model_for(rule, scale, "rmsnorm").double()
    x = tokens()
    e = model.embed(x)
    state0, ctx = model.rule.start(e)

    def core(z, qkv_inject=None, *, call=0):
        return model.core(z, qkv_inject)

    def realized(state, t):
        h = model.rule.hidden(model.rule.step(core, state, t, ctx), ctx)
        h = model.loop_norm(h) if scale == "inter_loop_norm" else torch.sigmoid(model.damping_raw) * h
        return model.rule.to_state(h, ctx)

    zero = model.rule.to_state(ctx.anchor, ctx)
    b = model.rule.hidden(realized(zero, 0), ctx) - ctx.anchor
    b_bare = model.rule.hidden(model.rule.step(core, zero, 0, ctx), ctx) - ctx.anchor
    rec = forcing_profile(model, x, steps=[0])[0]
    assert rec["bias_energy"] == pytest.approx(float(b.pow(2).mean()), rel=1e-9)
    assert float((b - b_bare).abs().max()) > 1e-6
    # gain at t = 0 of the realized map, by hand (same directions as gain_profile draws)
    eps = 1e-4
    dirs = random_directions(state0.shape, 2, seed=0, dtype=state0.dtype)
    h0 = model.rule.hidden(state0, ctx)
    base = model.rule.hidden(realized(state0, 0), ctx)
    hand = np.mean([float(((model.rule.hidden(realized(model.rule.to_state(h0 + eps * v, ctx), 0), ctx) - base)
                           .flatten(1).norm(dim=1) / eps).mean()) for v in dirs])
    got = gain_profile(model, x, steps=[0], eps=eps, n_directions=2, seed=0)[0]["gain"]
    assert got == pytest.approx(hand, rel=1e-9)


@torch.no_grad()
def test_adaptive_runner_applies_the_scale_control():
    """The bug that motivated one step: the early-exit run once skipped ``inter_loop_norm``; now its
    states at every depth equal the forward's (the runner's halted rows read out at those states)."""
    model = model_for("scse", "inter_loop_norm", "rmsnorm")
    x = tokens(3)
    states = model(x, 4, readout=Readout(states=True)).states
    seen = {}

    def on_exit(rows, k, h, logits):
        seen[k] = h

    from looplm.eval.exits import exit_loop
    crit = build_exit_criterion("hidden_update", -float("inf"))
    exit_loop(model.loop(x), crit, 4, on_exit=on_exit)
    assert torch.equal(seen[4], states[4])  # exact: same computation


def test_scopes_are_reentrant_and_thread_safe():
    """No global scope stack: two generations in threads (and one nested inside another's forward
    hooks) give the tokens they give alone."""
    model = model_for("looped", "none", "rmsnorm")
    prompts = [[[3, 4, 5]], [[7, 1, 2, 9]]]
    alone = [generate(model, p, 6, 3, cache_mode="per_visit").tokens for p in prompts]
    results = [None, None]

    def work(i):
        for _ in range(3):
            results[i] = generate(model, prompts[i], 6, 3, cache_mode="per_visit").tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
    # nested: a cached forward of another sequence runs inside a prelude hook of this one
    inner, busy = [], []

    def nested_call(*_):
        if not busy:
            busy.append(1)
            inner.append(generate(model, prompts[1], 2, 3).tokens[0])

    hook = model.prelude[0].register_forward_hook(nested_call)
    try:
        nested = generate(model, prompts[0], 6, 3).tokens
    finally:
        hook.remove()
    assert nested == alone[0] and inner == [alone[1][0][:2]]


@torch.no_grad()
@pytest.mark.parametrize("rule", ["scse", "looped", "huginn_linear"])
def test_early_exit_with_scale_clamp_equals_offline_accounting(rule):
    """The evaluation-time scale clamp reaches the runner too: the same depths and NLL as the trace of
    ``forward(scale_clamp=True)``, and other states than the unclamped run (barely, for huginn_linear,
    whose exit norm already fixes the RMS)."""
    model = model_for(rule, "none", "rmsnorm")
    x, y = tokens(8, seed=4), tokens(8, seed=5)
    batches = [(x[i:i + 4], y[i:i + 4], torch.ones(4, SEQ, dtype=torch.bool)) for i in (0, 4)]
    crit = build_exit_criterion("hidden_update", 0.0)
    tr = trace(model, batches, crit, 5, scale_clamp=True)
    assert np.abs(tr.nll - trace(model, batches, crit, 5).nll).max() > 0  # the clamp really acts
    v = np.unique(tr.scores[:, :4])
    crit.tau = float(np.median((v[:-1] + v[1:]) / 2))
    ref = halting_depths(tr.scores, crit.tau, "below")
    res = run(model, batches, crit, 5, scale_clamp=True)
    np.testing.assert_array_equal(res.depth, ref)
    np.testing.assert_allclose(res.nll, tr.nll[np.arange(len(ref)), ref - 1], rtol=1e-5, atol=1e-5)


def _gated_model() -> LoopLM:
    torch.manual_seed(0)
    cfg = ModelConfig(rule="looped", exit_gate=True, vocab_size=V, d_model=24, n_heads=2, d_ff=48, seq_len=SEQ,
                      dropout=0.0, init_std=0.1)
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.exit_gate.weight.normal_(0.0, 1.0)
    return model


@torch.no_grad()
def test_exit_gate_criterion_reads_the_learned_gate():
    """λ_k = σ(gate(h_k)), mean over a sequence's tokens, fires at ≥ τ: by hand from the forward's exit
    logits, and the runner equals the trace; a model without a gate is refused."""
    model = _gated_model()
    x, y = tokens(6, seed=6), tokens(6, seed=7)
    out = model(x, depth=[1, 2, 3, 4], targets=y)
    hand = torch.stack([torch.sigmoid(out.exit_logits_by_depth[k]).mean(1) for k in (1, 2, 3, 4)], 1)
    batches = [(x, y, torch.ones_like(y, dtype=torch.bool))]
    crit = build_exit_criterion("exit_gate")
    tr = trace(model, batches, crit, 4)
    np.testing.assert_allclose(tr.scores, hand.double().numpy(), rtol=1e-6)
    crit.tau = float(np.median(tr.scores[:, :3]))
    ref = halting_depths(tr.scores, crit.tau, "above")
    assert len(set(ref.tolist())) > 1
    res = run(model, batches, crit, 4)
    np.testing.assert_array_equal(res.depth, ref)
    with pytest.raises(ValueError, match="exit gate"):
        run(model_for("looped", "none", "rmsnorm"), batches, crit, 4)


@pytest.mark.parametrize("criterion", ["hidden_update", "relative", "kl", "entropy", "margin", "exit_gate", "exit_cdf"])
def test_every_criterion_in_every_place(criterion, tiny_data):
    """One registry: each criterion runs in adaptive depth (target mean depth), halting (PPL tolerance)
    and cached generation."""
    from looplm.eval.adaptive import adaptive_depth
    from looplm.eval.halting import halting_eval

    model = _gated_model() if criterion in ("exit_gate", "exit_cdf") else model_for("scse", "none", "rmsnorm")
    stream = np.random.default_rng(0).integers(0, V, 8 * SEQ + 1)
    res = adaptive_depth(model, stream, stream, targets=[2], ceiling=4, batch_size=4, progress=False,
                         criterion=criterion)
    assert res["criterion"] == criterion and 1 <= res["targets"]["2"]["test_mean_depth"] <= 4
    assert res["targets"]["2"]["early_exit"]["depth_agreement"] == 1.0
    xw = torch.from_numpy(stream[:8 * SEQ].reshape(8, SEQ))
    yw = torch.from_numpy(stream[1:8 * SEQ + 1].reshape(8, SEQ))
    h = halting_eval(model, (xw, yw), (xw, yw), 4, batch_size=4, repeats=1, progress=False, criterion=criterion)
    assert h["criterion"] == criterion and h["timed"]["dynamic"]["ppl"] > 0
    g = generate(model, [[1, 2, 3]], 4, 2, max_depth=4, exit_criterion=build_exit_criterion(criterion))
    assert len(g.tokens[0]) == 4 and all(1 <= d <= 4 for d in g.depths[0])


# --------------------------------------------------------------------------- Loop.resume (LMDR §3.2, §5.5)
@pytest.mark.parametrize("rule", RULES)
def test_resume_equals_the_uninterrupted_loop(rule):
    """Resuming at depth T0 from the hidden state h_T0 an uninterrupted forward visited gives that
    forward's states and logits at every later depth (every rule, so every to_state/hidden pair)."""
    model = model_for(rule, "inter_loop_norm", "rmsnorm")
    x = tokens()
    with torch.no_grad():
        full = model(x, [3, 5], readout=Readout(states=True))
        resumed = model.read(model.loop(x).resume(3, full.states[3]), [3, 5], readout=Readout(states=True))
    assert len(resumed.states) == 3  # h_3, h_4, h_5
    for a, b in zip(resumed.states, full.states[3:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for T in (3, 5):
        torch.testing.assert_close(resumed.logits_by_depth[T], full.logits_by_depth[T], rtol=1e-5, atol=1e-5)


def test_resume_a_detached_endpoint_is_the_endpoint_gradient():
    """For a rule whose loop state is h (the Huginn family), resuming at R from sg(h_R) and taking the
    endpoint-b gradient equals ``gradient="endpoint"`` run from the start: the reuse estimator of LMDR
    §3.2 (the saved endpoint state replaces the no-grad replay)."""
    model = model_for("looped", "none", "rmsnorm").train()
    x, y = tokens(), tokens(seed=1)
    R, b = 4, 2

    def grads(h_R=None):
        model.zero_grad()
        loop = model.loop(x) if h_R is None else model.loop(x).resume(R, h_R)
        model.read(loop, R, y, gradient=Gradient("endpoint", b)).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    replay = grads()
    with torch.no_grad():
        h_R = model(x, R, readout=Readout(states=True)).states[R]
    reuse = grads(h_R.detach())
    assert replay.keys() == reuse.keys()
    for n in replay:
        torch.testing.assert_close(reuse[n], replay[n], rtol=1e-5, atol=1e-6, msg=n)


def test_resume_refuses_bad_input():
    model = model_for("looped", "none", "rmsnorm")
    x = tokens()
    h = torch.zeros(*x.shape, model.cfg.d_model)
    with pytest.raises(ValueError, match="depth: need one or more loop depths >= t0 = 2"):
        model.read(model.loop(x).resume(2, h), [1, 4])
    with pytest.raises(ValueError, match="resume: the state must have shape"):
        model.read(model.loop(x).resume(2, h[:, :-1]), 4)
    with pytest.raises(ValueError, match="resume: scale_clamp"):
        model.read(model.loop(x, scale_clamp=True).resume(2, h), 4)
    unshared = build_model(ModelConfig(architecture="unshared", vocab_size=V, d_model=24, n_heads=2, d_ff=48,
                                       seq_len=SEQ, n_layers=2))
    with pytest.raises(ValueError, match="resume: the unshared reference"):
        unshared.read(unshared.loop(x).resume(1, h), 2)
