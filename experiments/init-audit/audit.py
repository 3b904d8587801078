"""Initialization audit of every rule with learned source modules (issue 11 §1), at initialization.

For each recurrence rule and each ``model.options.source_init`` scheme, a model of the `cpu` preset's
shape (d = 192; the Huginn family in the `huginn-cpu` 1 + 2×R + 1 layout) is built with seed 0 and run on
one batch of token ids, in float64. Reported per (rule, scheme):

- rms(e): the prelude output (the embedding when there is no prelude);
- rms(Δ₀): the part of the initial loop state that is not the anchor, h_0 − h* (SCSE family, adapters);
  for the Huginn family the initial state's rms;
- rms(inj): the injection the rule adds at each step (α·W_in h*, W_c γ, W e …), when it has one;
- rms(h_1 − h_0): the first step's update;
- gain₀: the random-direction gain at t = 0 (SCSE §5; :func:`looplm.diagnostics.gain.gain_profile`).

At initialization every embedding row is an i.i.d. draw, so uniform random token ids give the same
statistics as real text (we use them so the audit needs no data). The reference figures are the SCSE
paper's trained gains at t = 0 (looped 3.98, tuned adapter 1.135, SCSE 1.118): an init whose gain₀ is
far above them starts where the paper's models never are.

Rules without source modules (looped, norm_reset) get one row (init "-"), as references.

Run: python experiments/init-audit/audit.py   (≈ 1 minute on one core; writes audit.md next to it)
"""

from __future__ import annotations

from pathlib import Path

import torch

from looplm.config import RULE_NAMES, apply_overrides, options_class
from looplm.diagnostics.gain import gain_profile
from looplm.model import build_model
from looplm.presets import get_preset

SCHEMES = ("gpt2", "torch", "matched")
HUGINN = ("huginn_linear", "parcae", "parcae_decay", "orthoinj", "deq_qkv")


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


@torch.no_grad()
def audit(rule: str, scheme: str) -> dict[str, float]:
    preset = get_preset("huginn-cpu" if rule in HUGINN else "cpu")
    overrides = {"model.rule": rule} | ({"model.options.source_init": scheme} if scheme != "-" else {})
    cfg = apply_overrides(preset, overrides).model
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    e = model.embed(idx)
    state, ctx = model.start(e)
    h0 = model.hidden(state, ctx)
    h1 = model.hidden(model.step(state, 0, ctx), ctx)
    anchor = ctx.anchor if ctx.anchor is not None else torch.zeros_like(h0)
    inj = ctx.injection if ctx.injection is not None else None
    out = {"rms_e": rms(e), "rms_dev0": rms(h0 - anchor) if rule not in HUGINN else rms(h0),
           "rms_inj": rms(inj) if inj is not None else float("nan"), "rms_step": rms(h1 - h0),
           "gain0": gain_profile(model, idx[:2], [0])[0]["gain"]}
    return out


def main() -> None:
    rules = [r for r in RULE_NAMES if r != "plain"]
    rows = ["| rule | init | rms(e) | rms(Δ₀) | rms(inj) | rms(h₁ − h₀) | gain₀ |", "|---|---|---:|---:|---:|---:|---:|"]
    for rule in rules:
        has = "source_init" in options_class(rule).field_names()
        for scheme in SCHEMES if has else ("-",):
            r = audit(rule, scheme)
            rows.append(f"| {rule} | {scheme} | {r['rms_e']:.4f} | {r['rms_dev0']:.4f} | {r['rms_inj']:.4f} "
                        f"| {r['rms_step']:.4f} | {r['gain0']:.2f} |")
            print(rows[-1], flush=True)
    path = Path(__file__).with_name("audit.md")
    path.write_text("# Initialization audit (at init, seed 0, float64)\n\nMade by `python experiments/init-audit/audit.py`;"
                    " see its docstring for the quantities.\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
