"""Zero-deviation forcing bias (SCSE §2–3; SPEC §7), in each model's own anchor coordinates.

``b_t(e) = T_t(0; e)``: run the realized loop step t from the anchor (h = h*, i.e. Δ = 0) and
subtract h*. ``b̃_t`` is the same with the SCSE zero-deviation mask disabled (raw pre-mask response).
Along the ordinary trajectory, ``R_t = (N⁻¹‖b_t‖²) / max(N⁻¹‖Δ_{t+1} − Δ_t‖², 1e-12)`` and the anchor
energy ``E_Δ,t = N⁻¹‖Δ_t‖²`` with Δ_t = h_t − h*; N counts all entries of the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from looplm.model import LoopLM


def _energy(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean())


@torch.no_grad()
def forcing_profile(model: LoopLM, idx: torch.Tensor, steps: Sequence[int]) -> list[dict[str, float]]:
    """Forcing-bias records at loop steps ``steps`` of one unroll of ``idx`` (dropout off).

    Args:
        model: a shared-architecture LoopLM.
        idx: (B, L) token ids.
        steps: 0-based loop steps t at which to measure (unroll runs to max(steps) + 1).

    Returns:
        One record per t: ``t``, ``bias_energy`` N⁻¹‖b_t‖², ``raw_bias_energy`` N⁻¹‖b̃_t‖²,
        ``ratio`` R_t, ``anchor_energy`` E_Δ,t, plus the max-abs entries ``bias_max_abs`` and
        ``raw_bias_max_abs`` (exact-zero checks).

    Raises:
        ValueError: unshared architecture (no anchor) or a negative step.
    """
    if not model.shared:
        raise ValueError("forcing bias needs a shared (looped) architecture; this model is unshared")
    if not steps or min(steps) < 0:
        raise ValueError(f"steps: need loop steps >= 0, got {list(steps)}")
    was_training = model.training
    model.eval()
    rule, core = model.rule, model.core
    state, ctx = rule.start(model.embed(idx))
    anchor_state = rule.to_state(ctx.anchor, ctx)
    wanted = set(steps)
    records = []
    for t in range(max(steps) + 1):
        nxt = rule.step(core, state, t, ctx)
        if t in wanted:
            b = rule.hidden(rule.step(core, anchor_state, t, ctx), ctx) - ctx.anchor  # (B, L, d)
            b_raw = rule.hidden(rule.step(core, anchor_state, t, ctx, mask=False), ctx) - ctx.anchor
            delta_t = rule.hidden(state, ctx) - ctx.anchor
            motion = rule.hidden(nxt, ctx) - rule.hidden(state, ctx)  # Δ_{t+1} − Δ_t
            records.append({"t": t, "bias_energy": _energy(b), "raw_bias_energy": _energy(b_raw),
                            "ratio": _energy(b) / max(_energy(motion), 1e-12),
                            "anchor_energy": _energy(delta_t),
                            "bias_max_abs": float(b.abs().max()), "raw_bias_max_abs": float(b_raw.abs().max())})
        state = nxt
    model.train(was_training)
    return records
