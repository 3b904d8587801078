"""Initialization of the source modules and embeddings (SPEC §1; issue 11 §1): the default draws exactly
what the code before the options drew (a copy of that code is the reference), each scheme against a
hand computation, the ``matched`` RMS of Δ₀, and the configs that select them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

from looplm.config import (ANCHORED_SOURCE_INIT, ANCHORED_SOURCE_INIT_STD, RULE_NAMES, Config, ConfigError, ModelConfig,
                           _AnchoredOptions, apply_overrides, options_class)
from looplm.model import build_model
from looplm.model.recurrence import init_source_modules

D = 32


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=D, n_heads=4, d_ff=64, seq_len=12, dropout=0.0, n_prelude=1, n_core=2,
                n_coda=1)
    base.update(kw)
    return ModelConfig(**base)


def _reference_reset(model) -> None:
    """``reset_parameters`` as it was before ``source_init`` / ``embed_init_std`` (commit 0ad6090), pre-LN."""
    std = model.cfg.init_std
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            nn.init.zeros_(p)
        if p.dim() < 2:
            continue
        if name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight"):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * model.n_physical_blocks()))
        else:
            nn.init.normal_(p, 0.0, std)
    if model.shared and getattr(model.rule, "anchor_proj", None) is not None:
        nn.init.normal_(model.rule.anchor_proj.weight, 0.0, std)


RULES_AND_UNSHARED = [*RULE_NAMES, "unshared"]
#: rules whose source_init defaults to the init study's choice (the SCSE family and the adapters)
ANCHORED = {r for r in RULE_NAMES if issubclass(options_class(r), _AnchoredOptions)}


def _cfg(rule: str, **kw) -> ModelConfig:
    return tiny(architecture="unshared", n_layers=3) if rule == "unshared" else tiny(rule=rule, **kw)


@pytest.mark.parametrize("rule", RULES_AND_UNSHARED)
def test_gpt2_init_draws_exactly_as_before(rule):
    """``source_init=gpt2`` (the default before the init study; still the Huginn family's): the same RNG
    state gives a state_dict identical, bit for bit, to the pre-option code's. parcae_decay's default
    gains the RMSNorm gain of e (ones), the paper's Parcae-Decay; with ``input_norm_affine=false`` its
    state_dict is the old one exactly."""
    gpt2 = {"options": {"source_init": "gpt2", "source_init_std": 0.0}} if rule in ANCHORED else {}
    variants = [gpt2] + ([{"options": {"input_norm_affine": False}}] if rule == "parcae_decay" else [])
    for kw in variants:
        torch.manual_seed(3)
        model = build_model(_cfg(rule, **kw))
        torch.manual_seed(7)
        model.reset_parameters()
        new = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(7)
        _reference_reset(model)
        old = model.state_dict()
        for k in old:
            assert torch.equal(new[k], old[k]), f"{rule}: {k} differs from the pre-option init"  # exact: same draws
    if rule == "parcae_decay":  # the gain is the only new tensor, and draws nothing
        keys = {k: set(build_model(_cfg(rule, **kw)).state_dict()) for k, kw in (("new", {}), ("old", variants[1]))}
        assert keys["new"] - keys["old"] == {"rule.in_norm.weight"} and keys["old"] <= keys["new"]
        assert torch.equal(build_model(_cfg(rule)).rule.in_norm.weight.detach(), torch.ones(D))  # exact: init


SOURCE_NAMES = {
    "adapter": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.in_proj.weight"],
    "step_adapter": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.in_proj.weight",
                     "rule.step_proj.weight"],
    "step_film": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.in_proj.weight"],
    "scse": ["rule.anchor_proj.weight", "rule.init_proj.weight"],
    "sc_cond": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.cond_proj.weight"],
    "sc_subtract": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.cond_proj.weight"],
    "scse_leak": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.cond_proj.weight"],
    "additive_subtract": ["rule.anchor_proj.weight", "rule.init_proj.weight", "rule.in_proj.weight"],
    "huginn_linear": ["rule.adapter.weight", "rule.adapter.bias"],
    "parcae_decay": ["rule.in_proj.weight"], "parcae": ["rule.in_proj.weight"], "orthoinj": ["rule.in_proj.weight"],
    "deq_qkv": ["rule.qkv_proj.0.weight", "rule.qkv_proj.1.weight"],
}


def test_source_module_list_covers_every_rule_with_sources():
    no_sources = {"looped", "norm_reset", "plain"}
    assert set(SOURCE_NAMES) | no_sources == set(RULE_NAMES)
    for rule in no_sources:
        assert not hasattr(tiny(rule=rule).options, "source_init")
        assert build_model(tiny(rule=rule)).rule.source_modules() == []


@pytest.mark.parametrize("rule", sorted(SOURCE_NAMES))
@pytest.mark.parametrize("scheme", ["torch", "matched", "normal"])
def test_scheme_changes_only_the_source_modules(rule, scheme):
    """Same seed: every parameter but the source modules is drawn exactly as under gpt2; the source
    weights follow the scheme (checked against hand-computed bounds and stds)."""
    opts = {"source_init": scheme, **({"source_init_std": 2.0} if scheme == "normal" else {})}
    torch.manual_seed(0)
    base = build_model(tiny(rule=rule, options={"source_init": "gpt2"})).state_dict()
    torch.manual_seed(0)
    model = build_model(tiny(rule=rule, options=opts))
    sd = model.state_dict()
    for k in base:
        if k not in SOURCE_NAMES[rule]:
            assert torch.equal(sd[k], base[k]), f"{rule}/{scheme}: {k} changed"  # exact: same draws
    matched = {id(m.weight): s for m, s in model.rule.source_modules()}
    for k in SOURCE_NAMES[rule]:
        w = sd[k]
        assert not torch.equal(w, base[k]) or (k.endswith(".bias") and scheme != "torch")  # gpt2 bias: 0
        fan_in = w.shape[-1] if w.dim() == 2 else 2 * D  # the bias of W_lin: fan_in 2d
        if scheme == "torch":
            assert w.abs().max() <= 1 / math.sqrt(fan_in) and w.abs().max() > 0.8 / math.sqrt(fan_in)
        elif k.endswith(".bias"):
            assert torch.equal(w, torch.zeros_like(w))  # exact: init
        else:
            want = 2.0 if scheme == "normal" else matched[id(dict(model.named_parameters())[k])]
            assert w.std().item() == pytest.approx(want, rel=0.1)


def test_matched_std_is_the_hand_derivation():
    """σ_m = 1/√(d·(c_0² + c_a²)) for A and I (A only when the anchor uses it), 1/√fan_in otherwise."""
    sc = build_model(tiny(rule="scse", options={"anchor_scale": 0.1, "init_scale": 0.2})).rule.source_modules()
    assert [s for _, s in sc] == pytest.approx([1 / math.sqrt(D * (0.01 + 0.04))] * 2, rel=1e-12)
    emb = build_model(tiny(rule="scse", options={"anchor": "embedding", "init_scale": 0.2})).rule.source_modules()
    assert [s for _, s in emb] == pytest.approx([1 / (0.2 * math.sqrt(D))], rel=1e-12)  # 0.884 at d = 32
    ad = build_model(tiny(rule="adapter")).rule.source_modules()
    assert [s for _, s in ad] == pytest.approx([1 / math.sqrt(D * 0.02)] * 2 + [1 / math.sqrt(D)], rel=1e-12)
    hl = build_model(tiny(rule="huginn_linear")).rule.source_modules()
    assert [s for _, s in hl] == pytest.approx([1 / math.sqrt(2 * D)], rel=1e-12)


def test_matched_delta0_has_the_rms_of_e():
    """At d = 256, matched A and I give rms(Δ₀) ≈ rms(e); GPT-2's 0.02 gives ≈ 0.02·√(d·0.02)·rms(e)."""
    d = 256
    cfg = dict(vocab_size=97, d_model=d, n_heads=4, d_ff=64, seq_len=12, dropout=0.0, rule="scse")
    e = torch.randn(4, 12, d, generator=torch.Generator().manual_seed(0))
    for scheme, want in (("matched", 1.0), ("gpt2", 0.02 * math.sqrt(d * 0.02))):
        torch.manual_seed(1)
        rule = build_model(ModelConfig(**cfg, options={"source_init": scheme})).rule
        with torch.no_grad():
            delta0, _ = rule.start(e)
        ratio = (delta0.pow(2).mean().sqrt() / e.pow(2).mean().sqrt()).item()
        assert ratio == pytest.approx(want, rel=0.1), scheme


def test_torch_scheme_is_nn_linear_default():
    """torch: exactly what nn.Linear.reset_parameters draws from the same RNG state."""
    model = build_model(tiny(rule="huginn_linear", options={"source_init": "torch"}))
    torch.manual_seed(5)
    init_source_modules(model.rule, "torch")
    w, b = model.rule.adapter.weight.clone(), model.rule.adapter.bias.clone()
    ref = nn.Linear(2 * D, D)
    torch.manual_seed(5)
    ref.reset_parameters()
    assert torch.equal(w, ref.weight) and torch.equal(b, ref.bias)  # exact: same draws


def test_embed_init_std():
    torch.manual_seed(0)
    base = build_model(tiny(rule="looped")).state_dict()
    torch.manual_seed(0)
    sd = build_model(tiny(rule="looped", embed_init_std=1.0)).state_dict()
    for k in base:
        if k in ("tok_emb.weight", "pos_emb.weight", "lm_head.weight"):  # lm_head is tied
            assert sd[k].std().item() == pytest.approx(1.0, rel=0.1)
        else:
            assert torch.equal(sd[k], base[k]), k  # exact: same draws


def test_init_fields_are_validated():
    with pytest.raises(ConfigError, match=r"model.options.source_init: got 'xavier'; allowed: 'gpt2', 'torch'"):
        tiny(rule="scse", options={"source_init": "xavier"})
    with pytest.raises(ConfigError, match=r"model.options.source_init_std: must be > 0 with source_init=normal"):
        tiny(rule="scse", options={"source_init": "normal", "source_init_std": 0.0})
    with pytest.raises(ConfigError, match=r"model.options.source_init_std: read only by source_init=normal"):
        tiny(rule="adapter", options={"source_init": "gpt2", "source_init_std": 1.0})
    with pytest.raises(ConfigError, match=r"model.options.source_init: rule looped does not use it"):
        apply_overrides(Config(model=tiny(rule="looped")), {"model.options.source_init": "matched"})
    with pytest.raises(ConfigError, match=r"model.embed_init_std: must be > 0, or -1"):
        tiny(embed_init_std=0.0)
    with pytest.raises(ConfigError, match=r"model.options.source_init_std: must be finite"):
        tiny(rule="scse", options={"source_init": "normal", "source_init_std": float("inf")})
    cfg = apply_overrides(Config(model=tiny(rule="looped")), {"model.rule": "adapter", "model.options.source_init":
                                                               "normal", "model.options.source_init_std": "2.0"})
    assert (cfg.model.options.source_init, cfg.model.options.source_init_std) == ("normal", 2.0)


@pytest.mark.parametrize("rule", ["scse", "parcae_decay", "huginn_linear"])
def test_config_file_without_a_field_is_an_error_naming_it(rule):
    d = Config(model=tiny(rule=rule)).to_dict()
    for section, name in (("options", "source_init"), ("model", "embed_init_std"), ("optim", "schedule")):
        bad = json.loads(json.dumps(d))
        (bad["model"]["options"] if section == "options" else bad[section]).pop(name)
        key = f"model.options.{name}" if section == "options" else f"{section}.{name}"
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: missing"):
            Config.from_dict(bad)


def test_the_init_study_default_for_the_scse_family_and_adapters():
    """The SCSE family and the adapters default to the init study's N(0, 2.0) source modules (issue 11;
    experiments/scse-cpu/init-study); the Huginn family keeps gpt2."""
    assert ANCHORED == {"adapter", "step_adapter", "step_film", "scse", "sc_cond", "sc_subtract", "scse_leak",
                        "additive_subtract"}
    for rule in sorted(ANCHORED):
        opts = tiny(rule=rule).options
        assert (opts.source_init, opts.source_init_std) == (ANCHORED_SOURCE_INIT, ANCHORED_SOURCE_INIT_STD) == (
            "normal", 2.0)
        torch.manual_seed(0)
        model = build_model(tiny(rule=rule))
        for module, _ in model.rule.source_modules():
            assert abs(float(module.weight.detach().std()) - 2.0) < 0.1, rule  # D·D ≥ 1,024 draws of N(0, 2)
    assert tiny(rule="huginn_linear").options.source_init == "gpt2"
    # another scheme takes the std's default without complaint and stores 0 (the config of a gpt2 run is
    # the same as before the study); a different std is refused
    assert tiny(rule="scse", options={"source_init": "matched"}).options.source_init_std == 0.0
    cfg = apply_overrides(Config(model=tiny(rule="scse")), {"model.options.source_init": "gpt2"})
    assert cfg.model.options.source_init_std == 0.0
    assert Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match=r"source_init_std: read only by source_init=normal .* leave it at 2"):
        tiny(rule="scse", options={"source_init": "matched", "source_init_std": 1.0})


def test_xavier_block_init_std_before_beta():
    """block_init=xavier_normal (DeepNet's base, arXiv:2203.00555): every logical block matrix has std
    √(2/(fan_in + fan_out)), times β = (8N)^-1/2 on v, proj and the MLP (q, k unscaled), N = K·R = 6,
    against the formula computed here. Sample-std tolerance: n >= 128·128 entries give a relative standard
    error 1/√(2n) <= 0.6%; 4% is > 6 standard errors."""
    d, ff = 128, 384
    cfg = tiny(d_model=d, n_heads=4, d_ff=ff, n_prelude=0, n_coda=0, residual="deeploop", residual_depth=3,
               block_init="xavier_normal", rule="plain")
    torch.manual_seed(0)
    model = build_model(cfg)
    beta = (8 * 2 * 3) ** -0.5
    xav = lambda fi, fo: math.sqrt(2.0 / (fi + fo))  # noqa: E731
    for i in range(2):
        blk = model.core.blocks[i]
        q, k, v = blk.attn.qkv.weight.split([d, d, d])
        gate, up = blk.mlp.gate_up.weight.split([ff, ff])
        for w, want in ((q, xav(d, d)), (k, xav(d, d)), (v, beta * xav(d, d)), (blk.attn.proj.weight, beta * xav(d, d)),
                        (gate, beta * xav(d, ff)), (up, beta * xav(d, ff)), (blk.mlp.down.weight, beta * xav(ff, d))):
            assert float(w.detach().std()) == pytest.approx(want, rel=0.04)


def test_xavier_block_init_needs_post_ln():
    with pytest.raises(ConfigError, match=r"model\.block_init: .*allowed with residual=pre_ln: 'normal'"):
        tiny(block_init="xavier_normal")


@pytest.mark.parametrize("rule,modules", [("adapter", ["in_proj"]), ("step_adapter", ["in_proj", "step_proj"]),
                                          ("sc_cond", ["cond_proj"])])
def test_projection_init_unit_gain(rule, modules):
    """projection_init=unit under source_init=normal (issue 25 §3): W_in, W_c, P_step ~ N(0, 1/√d) (unit
    gain), A and I keep N(0, source_init_std). Tolerance as above: d² = 16,384 entries, 4% > 6 standard errors."""
    d = 128
    torch.manual_seed(0)
    model = build_model(tiny(d_model=d, rule=rule, options={"source_init": "normal", "source_init_std": 2.0,
                                                            "projection_init": "unit"}))
    for name in modules:
        assert float(getattr(model.rule, name).weight.detach().std()) == pytest.approx(1 / math.sqrt(d), rel=0.04)
    for name in ("anchor_proj", "init_proj"):
        assert float(getattr(model.rule, name).weight.detach().std()) == pytest.approx(2.0, rel=0.04)
    # the unit gain as the issue states it: rms(W_in h) = rms(h) for a random h (same tolerance)
    h = torch.randn(64, d)
    w = getattr(model.rule, modules[0]).weight.detach()
    assert float((h @ w.T).pow(2).mean().sqrt() / h.pow(2).mean().sqrt()) == pytest.approx(1.0, rel=0.04)


def test_projection_init_read_only_by_normal():
    with pytest.raises(ConfigError, match=r"model\.options\.projection_init: read only by source_init=normal"):
        tiny(rule="adapter", options={"source_init": "matched", "projection_init": "unit"})
