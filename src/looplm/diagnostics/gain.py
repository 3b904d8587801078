"""Random-direction gain of the one-step deviation map (SCSE appendix, Beyond Pointwise Bias; SPEC §7).
Source: SCSE, arXiv:2607.27656 (appendix Beyond Pointwise Bias, Table 22).

    gain_t = mean over directions v and examples b of ‖T_t(Δ_t + ε·v) − T_t(Δ_t)‖_F / ε,

with ``‖v^(b)‖_F = 1`` per example (Frobenius norm over its (L, d) slice), ε = 1e-3, four seeded
random directions, Δ_t the ordinary trajectory's deviation at step t. For an affine map
``T(Δ) = A·Δ + b`` the gain is exactly the mean of ‖A·v‖_F.

Precision: with ε = 1e-3 spread over L·d entries, each entry moves by ~1e-3/√(L·d) (≈ 5e-6 at the
paper's 128×384), so float32 rounding of ‖T‖ (~6e-8·‖T‖_F) is not negligible against the ε·gain
signal. Run the model in float64 (:func:`looplm.diagnostics.runner.diagnose_model` does by default;
``RMSNorm`` keeps float64 statistics for a float64 model).
"""

from __future__ import annotations

from typing import Sequence

import torch

from looplm.diagnostics.forcing import along_trajectory, check_shared
from looplm.model import LoopLM
from looplm.model.recurrence import LoopContext

FD_EPS = 1e-3
N_DIRECTIONS = 4


def random_directions(shape: Sequence[int], n: int = N_DIRECTIONS, *, seed: int = 0,
                      dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """``n`` Gaussian directions of ``shape`` (B, L, d), each normalized to ‖v^(b)‖_F = 1 per example.

    Direction k is drawn in float64 on the CPU from a generator seeded with ``seed + k``, so the
    directions do not depend on the device or on the global RNG.
    """
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(seed + k)
        v = torch.randn(*shape, generator=g, dtype=torch.float64)
        v = v / v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))  # ‖v^(b)‖_F = 1
        out.append(v.to(device=device, dtype=dtype))
    return out


def direction_gain(model: LoopLM, state: torch.Tensor, t: int, ctx: LoopContext,
                   directions: Sequence[torch.Tensor], *, eps: float = FD_EPS) -> float:
    """Mean over ``directions`` and examples of ‖T_t(Δ + ε·v) − T_t(Δ)‖_F / ε at the rule state ``state``.

    Args:
        state: the rule's loop state at step t (B, L, d); the perturbation is applied to the hidden
            state h = h* + Δ and mapped back with ``to_state``.
        directions: (B, L, d) tensors with unit Frobenius norm per example (:func:`random_directions`).

    Raises:
        ValueError: eps <= 0 or no directions.
    """
    if eps <= 0 or not directions:
        raise ValueError(f"eps must be > 0 and directions non-empty, got eps={eps}, {len(directions)} directions")
    h = model.hidden(state, ctx)
    base = model.hidden(model.step(state, t, ctx), ctx)  # h* + T_t(Δ)
    gains = []
    for v in directions:
        moved = model.hidden(model.step(model.to_state(h + eps * v, ctx), t, ctx), ctx)
        gains.append((moved - base).flatten(1).norm(dim=1) / eps)  # (B,)
    return float(torch.stack(gains).double().mean())


@torch.no_grad()
def gain_profile(model: LoopLM, idx: torch.Tensor, steps: Sequence[int], *, eps: float = FD_EPS,
                 n_directions: int = N_DIRECTIONS, seed: int = 0) -> list[dict[str, float]]:
    """Random-direction gain at loop steps ``steps`` of one unroll of ``idx`` (dropout off).

    Runs in the model's own dtype (see the module docstring for why float64 is advisable).

    Returns:
        One ``{"t": t, "gain": gain_t}`` per step.

    Raises:
        ValueError: unshared architecture or a negative step.
    """
    check_shared(model, "random-direction gain", steps)
    was_training = model.training
    model.eval()
    dirs = random_directions((*idx.shape, model.cfg.d_model), n_directions, seed=seed,
                             dtype=model.tok_emb.weight.dtype, device=idx.device)  # the loop state's
    records = along_trajectory(model, idx, steps, lambda t, s, _nxt, ctx: {
        "t": t, "gain": direction_gain(model, s, t, ctx, dirs, eps=eps)})
    model.train(was_training)
    return records
