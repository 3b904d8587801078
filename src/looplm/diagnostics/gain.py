"""Random-direction gain of the deviation map (SCSE, arXiv:2607.27656, Beyond Pointwise Bias, Table 22; SPEC §7):
gain_t = mean over directions v (‖v^(b)‖_F = 1 per example) and examples of ‖T_t(Δ_t + ε·v) − T_t(Δ_t)‖_F / ε.

Precision: ε = 1e-3 over L·d entries moves each by ~5e-6 at 128×384, below float32 rounding of ‖T‖; run in
float64 (``diagnose_model`` does by default).
"""

from __future__ import annotations

from typing import Sequence

import torch

from looplm.diagnostics.forcing import along_trajectory, check_shared
from looplm.model import LoopLM, eval_mode
from looplm.model.recurrence import LoopContext

FD_EPS = 1e-3
N_DIRECTIONS = 4


def random_directions(shape: Sequence[int], n: int = N_DIRECTIONS, *, seed: int = 0,
                      dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """``n`` Gaussian directions (B, L, d), ‖v^(b)‖_F = 1 per example; direction k from a float64 CPU generator
    seeded ``seed + k`` (independent of the device and the global RNG)."""
    vs = [torch.randn(*shape, generator=torch.Generator().manual_seed(seed + k), dtype=torch.float64) for k in range(n)]
    return [(v / v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))).to(device=device, dtype=dtype)
            for v in vs]  # ‖v^(b)‖_F = 1


def direction_gain(model: LoopLM, state: torch.Tensor, t: int, ctx: LoopContext,
                   directions: Sequence[torch.Tensor], *, eps: float = FD_EPS) -> float:
    """Mean of ‖T_t(Δ + ε·v) − T_t(Δ)‖_F / ε at the loop ``state`` (perturbing h = h* + Δ); ValueError: bad eps."""
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
    """``[{"t", "gain"}]`` at loop steps ``steps`` of one unroll of ``idx``, dropout off, in the model's dtype."""
    check_shared(model, "random-direction gain", steps)
    with eval_mode(model):
        dirs = random_directions((*idx.shape, model.cfg.d_model), n_directions, seed=seed,
                                 dtype=model.tok_emb.weight.dtype, device=idx.device)  # the loop state's
        return along_trajectory(model, idx, steps, lambda t, s, _nxt, ctx: {
            "t": t, "gain": direction_gain(model, s, t, ctx, dirs, eps=eps)})
