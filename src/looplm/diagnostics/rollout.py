"""Anchor-start rollouts and the injection-gain dose response (SCSE, arXiv:2607.27656, Figure 4; SPEC §7).

From Δ_0 = 0, ``depth`` realized steps (dropout off): the forcing-ray alignment cos(Δ_t, t·b_0) per example (None
where either is zero, as in SCSE), and the dose response D_{g,t} = Δ_t^(g) − Δ_t^(0) with the injection scaled by
g (RMS per step, relative to ‖Δ_T^(1)‖, cosine with D_{1,T}). The 2-D views project sequence means on the top two
principal directions of the uncentered cloud (the anchor stays at the origin).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from looplm.diagnostics.forcing import check_shared, deviation_step, energy
from looplm.model import LoopLM, eval_mode
from looplm.model.cursor import Loop

DOSE_GAINS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
KEEP_EXAMPLES = 6  # sequences kept for the 2-D views (the paper's case study uses six inputs)


def _cosines(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per-example cosine of (B, L, d) tensors over each (L, d) slice; examples with a zero side omitted."""
    x, y = x.flatten(1).double(), y.flatten(1).double()  # (B, L·d)
    nx, ny = x.norm(dim=1), y.norm(dim=1)
    ok = (nx > 0) & (ny > 0)
    return ((x * y).sum(dim=1)[ok] / (nx[ok] * ny[ok])).tolist()


def _cos_summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"cosine": None, "cosine_min": None, "cosine_max": None}
    return {"cosine": sum(values) / len(values), "cosine_min": min(values), "cosine_max": max(values)}


def _rms(x: torch.Tensor) -> float:
    return math.sqrt(energy(x))


@torch.no_grad()
def anchor_rollouts(model: LoopLM, idx: torch.Tensor, depth: int, *, gains: Sequence[float] = DOSE_GAINS,
                    keep_examples: int = KEEP_EXAMPLES) -> dict[str, Any]:
    """Anchor-start rollouts of idx (B, L) under each gain (0 and 1 always run): ``rollout`` records per t,
    ``dose_response`` per gain, and ``paths`` (numpy: {g: (k, T+1, d)} sequence-mean Δ_t of the first
    ``keep_examples``, and b_0). ValueError: unshared, depth < 1, or a negative gain."""
    check_shared(model, "anchor-start rollouts")
    if depth < 1:
        raise ValueError(f"depth: need at least one loop step for a rollout, got {depth}")
    if any(g < 0 for g in gains):
        raise ValueError(f"gains: injection gains must be >= 0, got {list(gains)}")
    with eval_mode(model):
        ctx = model.loop(idx).ctx
        run_gains = sorted({float(g) for g in gains} | {0.0, 1.0})
        loops = {g: Loop(model, model.to_state(ctx.anchor, ctx), ctx) for g in run_gains}  # Δ_0 = 0
        b0 = deviation_step(model, torch.zeros_like(ctx.anchor), 0, ctx)  # (B, L, d)
        k = min(keep_examples, idx.shape[0])

        def seq_mean(x: torch.Tensor) -> np.ndarray:
            return x[:k].double().mean(dim=1).cpu().numpy()  # (k, d)

        zero = torch.zeros_like(ctx.anchor)
        records = [{"t": 0, **_cos_summary([]), "delta_rms": 0.0, "ray_rms": 0.0}]
        disp_by_t = {g: [0.0] for g in run_gains}
        paths = {g: [seq_mean(zero)] for g in run_gains}
        deltas = {g: zero for g in run_gains}
        for t in range(depth):
            for g in run_gains:
                deltas[g] = loops[g].advance(injection_gain=g) - ctx.anchor  # (B, L, d)
                disp_by_t[g].append(_rms(deltas[g] - deltas[0.0]))
                paths[g].append(seq_mean(deltas[g]))
            records.append({"t": t + 1, **_cos_summary(_cosines(deltas[1.0], b0)), "delta_rms": _rms(deltas[1.0]),
                            "ray_rms": (t + 1) * _rms(b0)})
        push = _rms(deltas[1.0])
        unit = deltas[1.0] - deltas[0.0]
        dose = []
        for g in (float(g) for g in gains):
            disp = deltas[g] - deltas[0.0]
            cos = _cosines(disp, unit)
            dose.append({"gain": g, "displacement_rms": disp_by_t[g][-1],
                         "relative_to_push": disp_by_t[g][-1] / push if push > 0 else None,
                         "cosine_to_unit_gain": sum(cos) / len(cos) if cos else None,
                         "displacement_rms_by_t": disp_by_t[g]})
    return {"rollout": {"bias0_rms": _rms(b0), "records": records},
            "dose_response": {"push_rms": push, "records": dose},
            "paths": {"trajectory": {g: np.stack(p, axis=1) for g, p in paths.items()},  # (k, T+1, d)
                      "bias0": seq_mean(b0)}}


def pca_basis(points: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """``(basis (2, d), variance shares)`` of an uncentered cloud (n, d); all-zero: the first two axes, [0, 0]."""
    d = points.shape[-1]
    if not np.any(points):
        return np.eye(2, d), [0.0, 0.0]
    _, sv, vt = np.linalg.svd(points, full_matrices=False)
    basis = np.zeros((2, d))
    basis[: min(2, len(vt))] = vt[:2]
    total = float((sv ** 2).sum())
    shares = [float(sv[i] ** 2 / total) if i < len(sv) else 0.0 for i in range(2)]
    return basis, shares


def pca_views(paths: dict[str, Any], gains: Sequence[float]) -> dict[str, Any]:
    """Figure 4's 2-D views: ``trajectories`` (panel a: gain-1 paths and the ray b_0) and ``displacements``
    (panel b: D_{g,t} of the nonzero gains, in their own projection)."""
    traj = paths["trajectory"]
    a = traj[1.0]  # (k, T+1, d)
    basis, share = pca_basis(a.reshape(-1, a.shape[-1]))
    view_a = {"basis_share": share, "paths": (a @ basis.T).tolist(), "ray": (paths["bias0"] @ basis.T).tolist()}
    disp = {g: traj[g] - traj[0.0] for g in (float(g) for g in gains) if g != 0.0}
    stacked = [x.reshape(-1, x.shape[-1]) for x in disp.values()] or [np.zeros((0, a.shape[-1]))]
    basis_b, share_b = pca_basis(np.concatenate(stacked))  # no nonzero gain: an empty, all-zero cloud
    view_b = {"basis_share": share_b, "paths": {str(g): (x @ basis_b.T).tolist() for g, x in disp.items()}}
    return {"trajectories": view_a, "displacements": view_b}
