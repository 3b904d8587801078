"""Zero-deviation forcing bias (SCSE, arXiv:2607.27656, eq. 7–9, Table 3, Figure 5; SPEC §7) in anchor coordinates.

The deviation map at step t is ``T_t(Δ; e) = h_{t+1} − h*`` for ``h_t = h* + Δ`` (the realized step, dropout
off); ``b_t = T_t(0; e)``, ``b̃_t`` the same without the SCSE zero-deviation mask. Along the ordinary trajectory
``R_t = (N⁻¹‖b_t‖²) / max(N⁻¹‖Δ_{t+1} − Δ_t‖², 1e-12)`` (eq. 9) and ``E_Δ,t = N⁻¹‖Δ_t‖²``; N = B·L·d.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from looplm.model import LoopLM, eval_mode
from looplm.model.recurrence import LoopContext

RATIO_FLOOR = 1e-12  # the numerical floor of eq. 9
DTYPES = {"float64": torch.float64, "float32": torch.float32}  # the diagnostics' computation dtypes


def energy(x: torch.Tensor) -> float:
    """N⁻¹‖x‖²_F over all N entries, accumulated in float64."""
    return float(x.double().pow(2).mean())


def check_shared(model: LoopLM, what: str, steps: Sequence[int] | None = None) -> None:
    """ValueError for an unshared ``model`` or (if given) empty or negative ``steps``."""
    if not model.shared:
        raise ValueError(f"{what} needs a shared (looped) architecture; this model is "
                         "model.architecture=unshared")
    if steps is not None and (not steps or min(steps) < 0):
        raise ValueError(f"steps: need loop steps >= 0, got {list(steps)}")


def deviation_step(model: LoopLM, delta: torch.Tensor, t: int, ctx: LoopContext, *,
                   mask: bool = True) -> torch.Tensor:
    """``T_t(Δ; e)``: Δ (B, L, d) → Δ_{t+1} (exact for Δ = 0); ``mask=False``: the SCSE raw pre-mask map."""
    state = model.to_state(ctx.anchor + delta, ctx)
    return model.hidden(model.step(state, t, ctx, mask=mask), ctx) - ctx.anchor


def forcing_record(model: LoopLM, state: torch.Tensor, nxt: torch.Tensor, t: int,
                   ctx: LoopContext) -> dict[str, float]:
    """Energies of b_t and b̃_t, R_t, E_Δ,t and the max-abs bias entries at step t, given state_t and state_{t+1}."""
    zero = torch.zeros_like(ctx.anchor)
    b = deviation_step(model, zero, t, ctx)  # (B, L, d)
    b_raw = deviation_step(model, zero, t, ctx, mask=False)
    delta_t = model.hidden(state, ctx) - ctx.anchor
    motion = model.hidden(nxt, ctx) - model.hidden(state, ctx)  # Δ_{t+1} − Δ_t
    return {"t": t, "bias_energy": energy(b), "raw_bias_energy": energy(b_raw),
            "ratio": energy(b) / max(energy(motion), RATIO_FLOOR), "anchor_energy": energy(delta_t),
            "bias_max_abs": float(b.abs().max()), "raw_bias_max_abs": float(b_raw.abs().max())}


def along_trajectory(model: LoopLM, idx: torch.Tensor, steps: Sequence[int],
                     record: Callable[[int, torch.Tensor, torch.Tensor, LoopContext], Any]) -> list[Any]:
    """``record(t, state_t, state_{t+1}, ctx)`` at each loop step t in ``steps`` of the ordinary trajectory
    of ``idx`` (B, L): one cursor (:meth:`LoopLM.loop`) advanced to max(steps) + 1, in the model's mode."""
    loop, wanted, records = model.loop(idx), set(steps), []
    while loop.t <= max(steps):
        t, state = loop.t, loop.state
        loop.advance()
        if t in wanted:
            records.append(record(t, state, loop.state, loop.ctx))
    return records


@torch.no_grad()
def forcing_profile(model: LoopLM, idx: torch.Tensor, steps: Sequence[int]) -> list[dict[str, float]]:
    """:func:`forcing_record` at loop steps ``steps`` of one unroll of ``idx`` (B, L), dropout off."""
    check_shared(model, "forcing bias", steps)
    with eval_mode(model):
        return along_trajectory(model, idx, steps, lambda t, s, nxt, ctx: forcing_record(model, s, nxt, t, ctx))
