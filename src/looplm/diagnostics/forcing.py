"""Zero-deviation forcing bias (SCSE §2–3, eq. 7–9; SPEC §7), in each model's own anchor coordinates.
Source: SCSE, arXiv:2607.27656 (eq. 7–9, Table 3, Figure 5).

The one-step deviation map of a rule at loop step t is ``T_t(Δ; e) = h_{t+1} − h*`` for
``h_t = h* + Δ`` (the realized step :meth:`LoopLM.step`, scale control and all; dropout off). ``b_t(e) = T_t(0; e)``: run the realized step from
the anchor (h = h*, i.e. Δ = 0) and subtract h*. ``b̃_t`` is the same with the zero-deviation mask
of the SCSE family disabled (raw pre-mask response). Along the ordinary trajectory,
``R_t = (N⁻¹‖b_t‖²) / max(N⁻¹‖Δ_{t+1} − Δ_t‖², 1e-12)`` (eq. 9) and the anchor energy
``E_Δ,t = N⁻¹‖Δ_t‖²`` with Δ_t = h_t − h*; N counts all entries of the batch tensor (B·L·d).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from looplm.model import LoopLM
from looplm.model.recurrence import LoopContext

RATIO_FLOOR = 1e-12  # the numerical floor of eq. 9


def energy(x: torch.Tensor) -> float:
    """N⁻¹‖x‖²_F over all N entries, accumulated in float64."""
    return float(x.double().pow(2).mean())


def check_shared(model: LoopLM, what: str, steps: Sequence[int] | None = None) -> None:
    """Raise ValueError when ``model`` has no recurrence (unshared architecture), or when ``steps``
    (if given) is empty or holds a negative loop step."""
    if not model.shared:
        raise ValueError(f"{what} needs a shared (looped) architecture with an anchor; this model is "
                         "model.architecture=unshared")
    if steps is not None and (not steps or min(steps) < 0):
        raise ValueError(f"steps: need loop steps >= 0, got {list(steps)}")


def deviation_step(model: LoopLM, delta: torch.Tensor, t: int, ctx: LoopContext, *,
                   mask: bool = True) -> torch.Tensor:
    """``T_t(Δ; e)``: the realized step t at ``h = h* + Δ``, minus h*: Δ (B, L, d) → Δ_{t+1}. For Δ = 0 the
    state is exactly h* (and ``to_state(h*)`` exactly 0 for Δ-state rules), so b_t has no rounding;
    ``mask=False`` gives the SCSE family's raw pre-mask map.
    """
    state = model.to_state(ctx.anchor + delta, ctx)
    return model.hidden(model.step(state, t, ctx, mask=mask), ctx) - ctx.anchor


def forcing_record(model: LoopLM, state: torch.Tensor, nxt: torch.Tensor, t: int,
                   ctx: LoopContext) -> dict[str, float]:
    """Forcing-bias record at step t of one batch, given the ordinary trajectory's state_t and state_{t+1}.

    Returns:
        ``t``, ``bias_energy`` N⁻¹‖b_t‖², ``raw_bias_energy`` N⁻¹‖b̃_t‖², ``ratio`` R_t (eq. 9),
        ``anchor_energy`` E_Δ,t, and the max-abs entries ``bias_max_abs``, ``raw_bias_max_abs``
        (exact-zero checks).
    """
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
    """Forcing-bias records (:func:`forcing_record`) at 0-based loop steps ``steps`` of one unroll of ``idx``
    (B, L), dropout off. Raises ValueError for the unshared architecture or a negative step.
    """
    check_shared(model, "forcing bias", steps)
    was_training = model.training
    model.eval()
    records = along_trajectory(model, idx, steps, lambda t, s, nxt, ctx: forcing_record(model, s, nxt, t, ctx))
    model.train(was_training)
    return records
