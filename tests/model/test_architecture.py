"""The architecture options that Huginn-0125 and Ouro need (issue 14 §1), each against an independent
reference: rotary embeddings against complex multiplication, grouped-query attention against an explicit
softmax over repeated key/value heads, the q/k bias, the sandwich and pre_post blocks against hand-written
sequences of ops, the embedding scale, the exit norm, the per-step final norm (Ouro's loop written out),
the truncated-normal initial state, Ouro's cumulative exit-probability rule against its formula, and
the configs (validation, the HF config). Cached decoding and left padding with these
options run in test_kvcache / test_generate / test_hf through the ``huginn-0125``, ``ouro`` and
``looped-rope-mqa`` variants of test_model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from looplm.config import (Config, ConfigError, ModelConfig, RopeConfig, SpectralDampingConfig, TrainConfig,
                           apply_overrides)
from looplm.eval.exits import ExitCDF, build_exit_criterion, exit_cdf_depths, halting_depths, run, trace
from looplm.eval.generate import adaptive_decode_step
from looplm.model import build_model
from looplm.model.kvcache import KVCache
from looplm.model.layers import Block, CausalSelfAttention, Rope
from looplm.train.losses import exit_distribution
from looplm.model.cursor import Readout

V, D, H, L = 61, 32, 4, 10
HD = D // H


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=D, n_heads=H, d_ff=48, seq_len=16, dropout=0.0, init_std=0.1)
    base.update(kw)
    return ModelConfig(**base)


def tokens(b: int = 2, n: int = L, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def perturb_gains(model: nn.Module, seed: int = 1) -> None:
    """RMSNorm gains and q/k biases away from their 1 / 0 init, so a missing or misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and (name.endswith("weight") or name.endswith("qk_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ---------------------------------------------------------------------------------------------- rotary


def complex_rotation(x: torch.Tensor, pos: torch.Tensor, theta: float, layout: str, factor: float = 1.0):
    """x (B, H, L, hd) rotated by the complex multiplication z·e^{i·p·ω_j}, ω_j = θ^(−2j/hd)/factor, in
    float64 (the angle p·ω_j rounded to float32 first, as both originals form it); pairs (j, j + hd/2)
    for ``half``, (2j, 2j + 1) for ``interleaved``."""
    hd = x.shape[-1]
    w = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd) / factor  # (hd/2,)
    angle = (pos.float()[:, None, :, None] * w.float()).double()  # (B, 1, L, hd/2)
    rot = torch.polar(torch.ones((), dtype=torch.float64), angle)  # complex128
    xd = x.double()
    if layout == "half":
        z = torch.complex(xd[..., : hd // 2], xd[..., hd // 2:]) * rot
        return torch.cat([z.real, z.imag], -1)
    z = torch.complex(xd[..., 0::2], xd[..., 1::2]) * rot
    return torch.stack([z.real, z.imag], -1).flatten(-2)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_rope_equals_complex_multiplication(layout, factor):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 0, 0, 40, 100]])
    rope = Rope(16, 50000.0, layout, factor)
    w = 50000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16) / factor
    assert torch.allclose(rope.inv_freq("cpu").double(), w, rtol=1e-6, atol=0)
    got = rope.rotate(x, *rope.cos_sin(pos))
    ref = complex_rotation(x, pos, 50000.0, layout, factor)
    err = (got.double() - ref).abs().max().item()
    print(f"{layout} factor {factor}: max |Δ| {err:.2e}")
    assert err < 1e-5 and got.dtype == x.dtype
    # the score of q at p and k at s depends only on p − s
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(p, s):
        qp = rope.rotate(q, *rope.cos_sin(torch.tensor([[p]])))
        return (qp * rope.rotate(k, *rope.cos_sin(torch.tensor([[s]])))).sum()

    assert torch.allclose(score(7, 3), score(107, 103), atol=1e-4)


def test_rope_table_dtype_rounds_cos_and_sin_only():
    """``model.position.table_dtype=bfloat16`` (Huginn-0125's stored table) rotates by the bf16-rounded cos and sin
    of the float32 angles, in float32: equal to a rotation by the rounded table, and within bf16 rounding of the
    exact one."""
    torch.manual_seed(0)
    x, pos = torch.randn(2, 3, 7, 16), torch.arange(7)[None].expand(2, -1) * 37
    exact, rounded = Rope(16, 50000.0, "interleaved"), Rope(16, 50000.0, "interleaved", table_dtype="bfloat16")
    cos, sin = exact.cos_sin(pos)
    rc, rs = rounded.cos_sin(pos)
    # exact: the same float32 table, rounded
    assert torch.equal(rc, cos.bfloat16().float()) and torch.equal(rs, sin.bfloat16().float())
    assert torch.equal(rounded.rotate(x, rc, rs), exact.rotate(x, cos.bfloat16().float(), sin.bfloat16().float()))
    err = (rounded.rotate(x, rc, rs) - exact.rotate(x, cos, sin)).abs().max().item()
    print(f"bf16 table vs float32 table: max |Δ| {err:.2e}")
    assert 0 < err < 2 ** -7 * x.abs().max().item()


@torch.no_grad()
def test_interleaved_layout_is_half_after_permuting_q_and_k_rows():
    """An interleaved-rope model equals a half-rope model whose q/k rows (and q/k bias) are permuted per
    head, (0, 2, 4, …, 1, 3, 5, …): the two layouts express the same models (an importer may use either)."""
    kw = dict(rule="plain", n_core=2, qk_bias=True, n_kv_heads=2)
    torch.manual_seed(0)
    inter = build_model(cfg(position=dict(kind="rope", layout="interleaved"), **kw)).eval()
    perturb_gains(inter)
    half = build_model(cfg(position=dict(kind="rope", layout="half"), **kw)).eval()
    perm = torch.cat([torch.arange(0, HD, 2), torch.arange(1, HD, 2)])
    q_rows = torch.cat([h * HD + perm for h in range(H)])
    k_rows = torch.cat([H * HD + h * HD + perm for h in range(2)])
    rows = torch.cat([q_rows, k_rows, torch.arange((H + 2) * HD, (H + 4) * HD)])
    sd = inter.state_dict()
    for key in sd:
        if key.endswith("attn.qkv.weight"):
            sd[key] = sd[key][rows]
        elif key.endswith("attn.qk_bias"):
            sd[key] = sd[key][rows[: (H + 2) * HD]]
    half.load_state_dict(sd)
    x = tokens()
    err = (half(x, depth=3).logits - inter(x, depth=3).logits).abs().max().item()
    print(f"interleaved vs permuted half: max |Δlogits| {err:.2e}")
    assert err < 1e-5


# ---------------------------------------------------------------------------------------------- attention


def explicit_attention(attn: CausalSelfAttention, x: torch.Tensor, positions: torch.Tensor | None = None):
    """The attention layer written out: Q/K/V rows of the fused matrix, the q/k bias, the rotation,
    every query head g·j … g·j + g − 1 reading key/value head j, a causal softmax in float64, the output
    projection."""
    B, T, _ = x.shape
    Hq, Hkv = attn.n_heads, attn.n_kv_heads
    W = attn.qkv.weight
    q = x @ W[: Hq * HD].T
    k = x @ W[Hq * HD: (Hq + Hkv) * HD].T
    v = x @ W[(Hq + Hkv) * HD:].T
    if attn.qk_bias is not None:
        q, k = q + attn.qk_bias[: Hq * HD], k + attn.qk_bias[Hq * HD:]
    q = q.view(B, T, Hq, HD).transpose(1, 2)
    k, v = (t.view(B, T, Hkv, HD).transpose(1, 2) for t in (k, v))
    if attn.rope is not None:
        pos = torch.arange(T)[None].expand(B, T) if positions is None else positions
        q = complex_rotation(q, pos, attn.rope.theta, attn.rope.layout, attn.rope.factor)
        k = complex_rotation(k, pos, attn.rope.theta, attn.rope.layout, attn.rope.factor)
    g = Hq // Hkv
    out = torch.empty(B, Hq, T, HD, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(Hq):
        s = q[:, h].double() @ k[:, h // g].double().transpose(-1, -2) / math.sqrt(HD)  # (B, T, T)
        out[:, h] = s.masked_fill(~causal, -math.inf).softmax(-1) @ v[:, h // g].double()
    return out.transpose(1, 2).reshape(B, T, D).float() @ attn.proj.weight.T


@torch.no_grad()
@pytest.mark.parametrize("n_kv, qk_bias, layout", [(4, False, None), (2, False, None), (1, True, None),
                                                    (2, True, "half"), (4, True, "interleaved")])
def test_attention_equals_explicit_softmax(n_kv, qk_bias, layout):
    torch.manual_seed(0)
    rope = Rope(HD, 10000.0, layout) if layout else None
    attn = CausalSelfAttention(D, H, 0.0, n_kv_heads=n_kv, qk_bias=qk_bias, rope=rope)
    assert attn.qkv.weight.shape == ((H + 2 * n_kv) * HD, D)
    if qk_bias:
        attn.qk_bias.normal_()
    x = torch.randn(2, L, D)
    err = (attn(x) - explicit_attention(attn, x)).abs().max().item()
    print(f"kv heads {n_kv}, qk_bias {qk_bias}, rope {layout}: max |Δ| {err:.2e}")
    assert err < 1e-5


@torch.no_grad()
def test_gqa_equals_mha_with_repeated_key_value_heads():
    """GQA with 2 key/value heads equals multi-head attention whose key/value rows repeat each group's
    head (HF's repeat_kv), at every position of a rotary model."""
    torch.manual_seed(0)
    rope = Rope(HD, 10000.0, "half")
    gqa = CausalSelfAttention(D, H, 0.0, n_kv_heads=2, rope=rope)
    mha = CausalSelfAttention(D, H, 0.0, rope=rope)
    W = gqa.qkv.weight
    k_rows = W[H * HD:(H + 2) * HD].view(2, HD, D).repeat_interleave(2, 0).reshape(H * HD, D)
    v_rows = W[(H + 2) * HD:].view(2, HD, D).repeat_interleave(2, 0).reshape(H * HD, D)
    mha.qkv.weight.copy_(torch.cat([W[:H * HD], k_rows, v_rows]))
    mha.proj.weight.copy_(gqa.proj.weight)
    x = torch.randn(3, L, D)
    assert torch.allclose(gqa(x), mha(x), atol=1e-6)


@torch.no_grad()
def test_kv_cache_holds_rotated_grouped_keys():
    """A GQA rope model's cache banks hold n_kv_heads heads of the rotated keys: bank (prelude layer 0,
    visit 0) equals the layer's keys rotated at positions 0 … L−1."""
    torch.manual_seed(0)
    model = build_model(cfg(rule="looped", n_prelude=1, n_kv_heads=2, position=dict(kind="rope"))).eval()
    x = tokens()
    cache = KVCache("per_visit")
    model.read(model.loop(x, cache=cache), 2)
    k_bank, _ = cache.banks[(0, 0)]
    assert k_bank.shape == (2, 2, L, HD)
    blk = model.prelude[0]
    e = model.tok_emb(x)
    k = (blk.norm1(e) @ blk.attn.qkv.weight[H * HD:(H + 2) * HD].T).view(2, L, 2, HD).transpose(1, 2)
    ref = complex_rotation(k, torch.arange(L)[None].expand(2, L), 10000.0, "half")
    assert torch.allclose(k_bank.double(), ref, atol=1e-5)


# ---------------------------------------------------------------------------------------------- blocks


def swiglu(mlp, x):
    gate, up = (x @ mlp.gate_up.weight.T).split(mlp.d_ff, -1)
    return (gate * torch.sigmoid(gate) * up) @ mlp.down.weight.T


@torch.no_grad()
@pytest.mark.parametrize("norm", ["pre", "sandwich", "pre_post"])
def test_blocks_equal_hand_written_ops(norm):
    """pre: x + A(N₁x), then + M(N₂·); sandwich (Ouro): x + N₁'(A(N₁x)), then + N₂'(M(N₂·)); pre_post
    (Huginn-0125): N₁'(x + A(N₁x)), then N₂'(· + M(N₂·))."""
    torch.manual_seed(0)
    blk = Block(D, H, 48, 0.0, 1e-6, norm=norm, rope=Rope(HD, 10000.0, "interleaved"))
    perturb_gains(blk)
    assert hasattr(blk, "post_attn_norm") == (norm != "pre")
    x = torch.randn(2, L, D)

    def attn(z):
        return explicit_attention(blk.attn, z)

    if norm == "pre":
        x1 = x + attn(rms(x, blk.norm1.weight))
        ref = x1 + swiglu(blk.mlp, rms(x1, blk.norm2.weight))
    elif norm == "sandwich":
        x1 = x + rms(attn(rms(x, blk.norm1.weight)), blk.post_attn_norm.weight)
        ref = x1 + rms(swiglu(blk.mlp, rms(x1, blk.norm2.weight)), blk.post_mlp_norm.weight)
    else:
        x1 = rms(x + attn(rms(x, blk.norm1.weight)), blk.post_attn_norm.weight)
        ref = rms(x1 + swiglu(blk.mlp, rms(x1, blk.norm2.weight)), blk.post_mlp_norm.weight)
    err = (x + blk(x) - ref).abs().max().item()
    print(f"{norm}: max |Δ| {err:.2e}")
    assert err < 1e-5
    assert torch.equal(blk(torch.zeros(1, 3, D)), torch.zeros(1, 3, D))  # exact: zero-preserving (0 in, 0 out)


def test_block_norm_keys_and_zero_preserving_core():
    """Sandwich and pre_post blocks add post_attn_norm / post_mlp_norm gains (ones); G(0) = 0 holds."""
    for norm in ("sandwich", "pre_post"):
        model = build_model(cfg(rule="scse", block_norm=norm, position=dict(kind="rope"), qk_bias=True))
        keys = set(model.state_dict())
        assert {"core.blocks.0.post_attn_norm.weight", "core.blocks.0.post_mlp_norm.weight",
                "core.blocks.0.attn.qk_bias"} <= keys
        assert torch.equal(model.core.blocks[0].post_mlp_norm.weight.detach(), torch.ones(D))  # exact: init
        assert torch.equal(model.core.blocks[0].attn.qk_bias.detach(), torch.zeros((H + H) * HD))  # exact: init
        assert torch.equal(model.core(torch.zeros(2, 5, D)), torch.zeros(2, 5, D))  # exact: 0 in, 0 out


# ---------------------------------------------------------------------------------------------- embedding and norms


@torch.no_grad()
def test_embedding_scale_and_position_signal():
    torch.manual_seed(0)
    x = tokens()
    for pe in ("rope", "none"):
        model = build_model(cfg(rule="plain", position=dict(kind=pe), embed_scale=3.0)).eval()
        assert model.pos_emb is None and "pos_emb.weight" not in model.state_dict()
        assert (model.core.blocks[0].attn.rope is not None) == (pe == "rope")
        assert torch.equal(model.embed(x), model.tok_emb(x) * 3.0)  # exact: same computation
    model = build_model(cfg(rule="plain", embed_scale=2.0)).eval()  # learned positions: scale the tokens only
    assert torch.equal(model.embed(x), model.tok_emb(x) * 2.0 + model.pos_emb(torch.arange(L)))  # exact: same ops
    # a run of one repeated token: without a position signal every position sees the same keys and
    # values, so every position has the same logits; learned positions tell them apart (rope cannot
    # here: it rotates q and k only, and every value is the same)
    same = torch.full((1, 8), 5)
    for pe in ("none", "learned"):
        torch.manual_seed(0)
        logits = build_model(cfg(rule="looped", position=dict(kind=pe), n_prelude=1)).eval()(same, depth=2).logits[0]
        assert torch.allclose(logits, logits[:1].expand_as(logits), atol=1e-5) == (pe == "none"), pe


@torch.no_grad()
@pytest.mark.parametrize("exit_norm", ["learned", "final"])
def test_exit_norm_before_the_coda_by_hand(exit_norm):
    """readout(h) = W_out·N_f(h' + Coda(h')), h' = N_exit(h); ``final`` uses norm_f's own gain (Huginn's
    ln_f, used twice) and adds no parameter."""
    torch.manual_seed(0)
    model = build_model(cfg(rule="looped", n_prelude=1, n_coda=1, exit_norm=exit_norm)).eval()
    perturb_gains(model)
    keys = set(model.state_dict())
    assert ("exit_norm.weight" in keys) == (exit_norm == "learned")
    w_exit = model.exit_norm.weight if exit_norm == "learned" else model.norm_f.weight
    h = torch.randn(2, L, D)
    h1 = rms(h, w_exit)
    h2 = h1 + model.coda[0](h1)
    ref = rms(h2, model.norm_f.weight) @ model.lm_head.weight.T
    assert torch.allclose(model.readout(h), ref, atol=1e-5)
    plain = build_model(cfg(rule="looped", n_prelude=1, n_coda=1)).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "exit_norm.weight"})
    assert not torch.allclose(plain.readout(h), ref, atol=1e-3)  # the exit norm really acts


def ouro_cfg(**kw) -> ModelConfig:
    base = dict(rule="plain", n_core=2, n_kv_heads=2, position=dict(kind="rope", theta=1e6),
                block_norm="sandwich", scale_control=dict(kind="final_norm"), readout="raw", exit_gate=True,
                tie_embeddings=False)
    base.update(kw)
    return cfg(**base)


def ouro_model(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(ouro_cfg()).eval()
    perturb_gains(model)
    with torch.no_grad():
        model.exit_gate.weight.normal_(0.0, 0.3)
    return model


@torch.no_grad()
def test_ouro_loop_by_hand():
    """Ouro's forward written out: h_0 = embed(x); after every pass of all layers h_t = N_f(layers(h_{t−1}))
    (the final norm, fed back); logits_t = W_out·h_t (no second norm); exit logit_t = gate(h_t)."""
    model = ouro_model()
    x = tokens()
    out = model(x, depth=[1, 2, 3, 4])
    h = model.tok_emb(x)
    for t in range(1, 5):
        for blk in model.core.blocks:
            h = h + blk(h)
        h = rms(h, model.norm_f.weight)
        assert torch.allclose(out.logits_by_depth[t], h @ model.lm_head.weight.T, atol=1e-5), t
        gate = (h @ model.exit_gate.weight.T + model.exit_gate.bias)[..., 0]
        assert torch.allclose(out.exit_logits_by_depth[t], gate, atol=1e-5), t
    assert "loop_norm.weight" not in model.state_dict()  # the final norm itself, no second gain


# ---------------------------------------------------------------------------------------------- initial state


@torch.no_grad()
def test_truncated_normal_initial_state():
    """state_init=truncated_normal: |h_0| ≤ 3σ, std σ·0.98658 (the std of N(0, 1) truncated at ±3); fixed
    per position in evaluation (the same table in a full forward and a cached token), fresh in training;
    ``state_init_seed = -1`` draws fresh noise in evaluation (as Huginn-0125)."""
    sigma = 0.6
    c = cfg(rule="huginn_linear", seq_len=64, d_model=256, n_heads=4, d_ff=64,
            options=dict(state_init="truncated_normal", state_init_std=sigma))
    model = build_model(c).eval()
    e = torch.zeros(2, 64, 256)
    h0 = model.rule.initial_state(e)
    assert h0.abs().max() <= 3 * sigma + 1e-6 and h0.abs().max() > 2.5 * sigma
    trunc_std = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))
    assert abs(h0.std().item() / (sigma * trunc_std) - 1) < 0.03
    assert torch.equal(h0, model.rule.initial_state(e))  # exact: evaluation reads the fixed table
    # exact: rows of the table
    assert torch.equal(model.rule.initial_state(e[:, :1], torch.tensor([[5], [9]]))[:, 0], h0[0, [5, 9]])
    model.train()
    a, b = model.rule.initial_state(e), model.rule.initial_state(e)
    assert not torch.equal(a, b) and a.abs().max() <= 3 * sigma + 1e-6
    fresh = build_model(c.replace(options=dict(state_init="truncated_normal", state_init_std=sigma,
                                               state_init_seed=-1))).eval()
    assert not torch.equal(fresh.rule.initial_state(e), fresh.rule.initial_state(e))


def test_huginn_linear_options():
    """adapter_bias=false: W_lin [h; e] without bias; step_norm=false: h_{r+1} = ζ + G(ζ) (Huginn-0125)."""
    torch.manual_seed(0)
    m = build_model(cfg(rule="huginn_linear", options=dict(adapter_bias=False, step_norm=False,
                                                           state_init="zeros"))).eval()
    assert m.rule.adapter.bias is None and m.rule.exit_norm is None
    assert "rule.adapter.bias" not in m.state_dict()
    x = tokens()
    with torch.no_grad():
        e = m.embed(x)
        z = torch.cat([torch.zeros_like(e), e], -1) @ m.rule.adapter.weight.T
        assert torch.allclose(m(x, 1, readout=Readout(states=True)).states[1], z + m.core(z), atol=1e-6)
    default = cfg(rule="huginn_linear").options
    assert default.adapter_bias and default.step_norm  # LMDR's huginn_linear, unchanged


# ---------------------------------------------------------------------------------------------- Ouro's exit rule


def ouro_threshold_rule(gates: list[torch.Tensor], threshold: float) -> torch.Tensor:
    """Ouro's OuroForCausalLM thresholded readout, written from its description: pdf p_i = λ_i·rem for
    i < T, p_T = rem; the exit step is the first i with cumsum(p)_i ≥ threshold, the last if none."""
    rem = torch.ones_like(gates[0])
    pdf = []
    for i, g in enumerate(gates):
        lam = torch.sigmoid(g)
        if i < len(gates) - 1:
            pdf.append(lam * rem)
            rem = rem * (1 - lam)
        else:
            pdf.append(rem)
    cdf = torch.cumsum(torch.stack(pdf, -1), -1)
    hit = cdf >= threshold
    steps = hit.float().argmax(-1)
    steps[~hit.any(-1)] = len(gates) - 1
    return steps + 1


def test_exit_cdf_equals_ouros_formula():
    g = torch.Generator().manual_seed(0)
    gates = [2.0 * torch.randn(3, 11, generator=g) for _ in range(4)]
    for tau in (0.0, 0.2, 0.5, 0.8, 0.95, 1.0):
        got = exit_cdf_depths(gates, tau)
        # exact: integer loops; every CDF is ≥ 1e-4 from τ
        assert torch.equal(got, ouro_threshold_rule(gates, tau)), tau
    assert len(set(exit_cdf_depths(gates, 0.5).flatten().tolist())) > 2
    # the carried statistic is the CDF of the exit distribution of train.supervision=exit_weighted
    cdf = torch.cumsum(exit_distribution(gates), 0)
    crit, carry = ExitCDF(0.5), None
    for k in range(3):
        s, carry = crit.carry_score(None, None, gate=gates[k], carry=carry)
        assert torch.allclose(s, cdf[k], atol=1e-6)
    with pytest.raises(ValueError, match="at least one"):
        exit_cdf_depths([], 0.5)


@torch.no_grad()
def test_exit_cdf_runner_equals_trace_and_hand_statistic():
    """The sequence statistic is the mean over tokens of Ouro's CDF_k (by hand from the forward's exit
    logits); the runner (halted rows leave) equals the offline accounting."""
    model = ouro_model()
    x, y = tokens(6, seed=6), tokens(6, seed=7)
    out = model(x, depth=[1, 2, 3, 4], targets=y)
    lam = [torch.sigmoid(out.exit_logits_by_depth[k]) for k in (1, 2, 3, 4)]
    surv, cdf = torch.ones_like(lam[0]), []
    for lk in lam:
        cdf.append(1 - surv * (1 - lk))
        surv = surv * (1 - lk)
    hand = torch.stack([c.mean(1) for c in cdf], 1).double().numpy()
    batches = [(x[:3], y[:3], torch.ones(3, L, dtype=torch.bool)), (x[3:], y[3:], torch.ones(3, L, dtype=torch.bool))]
    crit = build_exit_criterion("exit_cdf")
    assert crit.tau == 0.5 and crit.direction == "above"
    tr = trace(model, batches, crit, 4)
    assert abs(tr.scores - hand).max() < 1e-5
    crit.tau = float(np.median(tr.scores[:, :3]))
    ref = halting_depths(tr.scores, crit.tau, "above")
    assert len(set(ref.tolist())) > 1
    res = run(model, batches, crit, 4)
    assert res.depth.tolist() == ref.tolist()
    assert abs(res.nll - tr.nll[range(len(ref)), ref - 1]).max() < 1e-4


@torch.no_grad()
def test_exit_cdf_in_decoding_is_ouros_per_token_rule():
    """Cached decoding with exit_cdf: each new token's exit loop is Ouro's rule on that token's exit
    logits from a fixed-depth forward through the same prefix (the token's loops up to its exit are the
    same computation)."""
    model = ouro_model()
    prompts = tokens(4, n=6, seed=3)
    nxt = tokens(4, n=1, seed=4)
    C = 4
    ref_cache, cache = KVCache("per_visit"), KVCache("per_visit")
    model.read(model.loop(prompts, cache=ref_cache), C)
    model.read(model.loop(prompts, cache=cache), C)
    fixed = model.read(model.loop(nxt, cache=ref_cache), list(range(1, C + 1)))
    gates = [fixed.exit_logits_by_depth[k][:, -1] for k in range(1, C + 1)]
    cdf2 = 1 - (1 - torch.sigmoid(gates[0])) * (1 - torch.sigmoid(gates[1]))
    tau = float(cdf2.median())  # a threshold that splits the rows
    want = exit_cdf_depths(gates, tau)
    _, depth = adaptive_decode_step(model, nxt, cache, C, ExitCDF(tau))
    print("exit loops", depth.tolist(), "want", want.tolist())
    assert depth.tolist() == want.tolist() and len(set(want.tolist())) > 1


# ---------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("kw, field", [
    (dict(n_kv_heads=3), "model.n_kv_heads"),
    (dict(n_kv_heads=-1), "model.n_kv_heads"),
    (dict(position=dict(kind="learned", theta=50000.0)), "model.position.theta: kind learned does not read it"),
    (dict(position=dict(kind="none", layout="interleaved")), "model.position.layout: kind none does not read it"),
    (dict(position=dict(kind="rope", table_dtype="float16")), "model.position.table_dtype"),
    (dict(position=dict(kind="rope", scaling_factor=2.0)), "model.position.scaling_factor"),
    (dict(position=dict(kind="rope", scaling="linear", scaling_factor=0.0)), "model.position.scaling_factor"),
    (dict(position=dict(kind="rope", theta=1.0)), "model.position.theta"),
    (dict(position=dict(kind="rope"), d_model=36, n_heads=4), "model.position.kind"),
    (dict(position=dict(kind="alibi")), "model.position.kind"),
    (dict(position="rope"), "model.position: must be a position config"),
    (dict(scale_control=dict(kind="none", init=0.5)), "model.scale_control.init: kind none does not read it"),
    (dict(scale_control=dict(kind="spectral_damping", init=1.0)), "model.scale_control.init"),
    (dict(scale_control=dict(kind="clip")), "model.scale_control.kind"),
    (dict(block_norm="sandwich", residual="deepnorm", residual_depth=2), "model.block_norm"),
    (dict(block_norm="post"), "model.block_norm"),
    (dict(embed_scale=0.0), "model.embed_scale"),
    (dict(exit_norm="shared"), "model.exit_norm"),
    (dict(architecture="unshared", scale_control=dict(kind="final_norm")), "model.scale_control.kind"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        cfg(**kw)


def test_unknown_names_list_the_allowed_ones():
    with pytest.raises(ConfigError, match="allowed: 'learned', 'rope', 'none'"):
        cfg(position=dict(kind="alibi"))
    with pytest.raises(ConfigError, match="truncated_normal"):
        cfg(rule="huginn_linear", options=dict(state_init="trunc"))


def test_position_and_scale_control_overrides():
    """``model.position.FIELD`` / ``model.scale_control.FIELD``: the kind is written first in config.json, a later
    override keeps the kind and the other fields, and a field the kind does not read names the kind's fields."""
    base = Config(model=cfg())
    new = apply_overrides(base, {"model.position.kind": "rope", "model.position.theta": "50000",
                                 "model.scale_control.kind": "spectral_damping", "model.scale_control.init": "0.5"})
    assert new.model.position == RopeConfig(theta=50000.0)
    assert new.model.scale_control == SpectralDampingConfig(init=0.5)
    d = new.to_dict()["model"]
    assert d["position"] == {"kind": "rope", "theta": 50000.0, "layout": "half", "scaling": "none",
                             "scaling_factor": 1.0, "table_dtype": "float32"}
    assert d["scale_control"] == {"kind": "spectral_damping", "init": 0.5}
    assert Config.from_json(new.to_json()) == new
    again = apply_overrides(new, {"model.position.layout": "interleaved"})
    assert again.model.position == RopeConfig(theta=50000.0, layout="interleaved")
    assert again.model.scale_control == new.model.scale_control
    with pytest.raises(ConfigError, match="position.theta: kind learned does not read it.*fields of learned: none"):
        apply_overrides(base, {"model.position.theta": "5e4"})
    with pytest.raises(ConfigError, match="model.scale_control: set its fields one at a time"):
        apply_overrides(base, {"model.scale_control": "final_norm"})


def test_huginn_and_ouro_configs_round_trip_through_config_json():
    for m in (ouro_cfg(), cfg(rule="huginn_linear", position=dict(kind="rope", layout="interleaved", theta=50000.0),
                              qk_bias=True, block_norm="pre_post", embed_scale=D ** 0.5,
                              exit_norm="final", options=dict(adapter_bias=False, step_norm=False,
                                                              state_init="truncated_normal"))):
        c = Config(model=m, train=TrainConfig(supervision="exit_weighted") if m.exit_gate else TrainConfig())
        assert Config.from_json(c.to_json()) == c


def test_hf_config_names_the_key_value_heads():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from looplm.hf import LoopLMConfig

    hf = LoopLMConfig.from_looplm(Config(model=ouro_cfg()))
    assert hf.num_key_value_heads == 2 and hf.num_attention_heads == H
    assert LoopLMConfig.from_looplm(Config(model=cfg())).num_key_value_heads == H
    assert hf.looplm_config().model == ouro_cfg()


def test_post_ln_beta_scales_the_value_rows_of_grouped_attention():
    """DeepNorm/DeepLoop init with GQA: β multiplies exactly the value rows (the last n_kv_heads·hd rows of
    qkv), not the query and key rows."""
    c = cfg(rule="plain", residual="deeploop", residual_depth=50, n_kv_heads=2, n_core=2)
    beta = c.residual_alpha_beta[1]
    torch.manual_seed(0)
    W = build_model(c).core.blocks[0].attn.qkv.weight.detach()
    q, k, v = W[:H * HD], W[H * HD:(H + 2) * HD], W[(H + 2) * HD:]
    assert abs(q.std() / (c.init_std) - 1) < 0.1 and abs(k.std() / c.init_std - 1) < 0.15
    assert abs(v.std() / (beta * c.init_std) - 1) < 0.15


@torch.no_grad()
def test_compiled_rope_blocks_decode_without_recompiling():
    """Blocks compiled by dynamo (backend eager: the tracing, not inductor's codegen) read the rotary
    positions through the same graph break as the cache (``KVVisit.positions``): cached decoding equals
    eager decoding and the decode steps do not recompile as the cache grows."""
    import copy

    from looplm.eval.generate import generate
    from looplm.train.trainer import compile_blocks

    torch.manual_seed(0)
    eager = build_model(ouro_cfg(seq_len=32)).eval()
    compiled = compile_blocks(copy.deepcopy(eager), backend="eager")
    torch._dynamo.reset()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    assert generate(compiled, prompts, 6, depth=3).tokens == generate(eager, prompts, 6, depth=3).tokens
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = generate(compiled, [[3, 1, 4, 1, 5], [9, 2, 6]], 8, depth=3)
    assert again.tokens == generate(eager, [[3, 1, 4, 1, 5], [9, 2, 6]], 8, depth=3).tokens
