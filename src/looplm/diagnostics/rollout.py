"""Anchor-start rollouts and the injection-gain dose response (SCSE Figure 4; SPEC §7).
Source: SCSE, arXiv:2607.27656 (Figure 4).

Every rollout starts at the anchor (Δ_0 = 0) and runs the realized map (dropout off) for ``depth`` steps:

- **forcing-ray alignment**: per example, cos(Δ_t, t·b_0(e)) over its (L, d) slice (b_0 = T_0(0; e)); None
  where either is zero (every example of SCSE).
- **dose response**: the injection scaled by g (``LoopLM.step(..., injection_gain=g)``; g = 0 removes it).
  D_{g,t} = Δ_t^(g) − Δ_t^(0) is reported as its RMS per step, relative to ‖Δ_T^(1)‖ at the last step,
  and by its per-example cosine with D_{1,T}. A rule without an injection has D ≡ 0.

Figure 4's 2-D views project the sequence-mean trajectories of the first examples on the top two
principal directions of the uncentered cloud (numpy SVD), so the anchor stays at the origin.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from looplm.diagnostics.forcing import check_shared, deviation_step, energy
from looplm.model import LoopLM
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
    """Anchor-start rollouts of one batch under each injection gain (dropout off, model's dtype).

    Args:
        idx: (B, L) token ids.
        depth: steps to roll out (T ≥ 1).
        gains: evaluation-time injection gains; 0 and 1 are always run (reference and trained map).
        keep_examples: sequences whose sequence-mean paths are returned for the 2-D views.

    Returns:
        ``rollout``: ``bias0_rms`` (RMS of b_0) and ``records`` per t = 0 … T with ``t``, ``cosine``
        (mean over examples; None when undefined), ``cosine_min``, ``cosine_max``, ``delta_rms``
        (RMS of Δ_t at gain 1), ``ray_rms`` (RMS of t·b_0);
        ``dose_response``: ``push_rms`` (RMS of Δ_T at gain 1) and per requested gain ``gain``,
        ``displacement_rms`` (RMS of D_{g,T}), ``relative_to_push``, ``cosine_to_unit_gain`` (mean
        per-example cosine of D_{g,T} with D_{1,T}; None when undefined), ``displacement_rms_by_t``;
        ``paths`` (numpy, not JSON): ``trajectory`` {g: (k, T+1, d)} sequence-mean Δ_t, ``bias0``
        (k, d) sequence-mean b_0.

    Raises:
        ValueError: unshared architecture, depth < 1, or a negative gain.
    """
    check_shared(model, "anchor-start rollouts")
    if depth < 1:
        raise ValueError(f"depth: need at least one loop step for a rollout, got {depth}")
    if any(g < 0 for g in gains):
        raise ValueError(f"gains: injection gains must be >= 0, got {list(gains)}")
    was_training = model.training
    model.eval()
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
    model.train(was_training)
    return {"rollout": {"bias0_rms": _rms(b0), "records": records},
            "dose_response": {"push_rms": push, "records": dose},
            "paths": {"trajectory": {g: np.stack(p, axis=1) for g, p in paths.items()},  # (k, T+1, d)
                      "bias0": seq_mean(b0)}}


def pca_basis(points: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Top-2 principal directions of an uncentered point cloud (n, d) and their variance shares.

    Uncentered so that the anchor (the origin) projects to the origin. Returns ``(basis (2, d),
    [share_1, share_2])``; an all-zero cloud gives the first two coordinate axes and shares [0, 0].
    """
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
    """JSON-ready 2-D projections for Figure 4 from the ``paths`` of :func:`anchor_rollouts`.

    Returns:
        ``trajectories``: {"basis_share", "paths" [[(x, y) per t] per example], "ray" [(x, y) of the
        sequence-mean b_0 per example] (the forcing ray t·b_0 is t times it)} — panel (a), gain 1;
        ``displacements``: {"basis_share", "paths" {gain: [[(x, y) per t] per example]}} of
        D_{g,t} = Δ_t^(g) − Δ_t^(0) for the nonzero requested gains — panel (b), its own projection.
    """
    traj = paths["trajectory"]
    a = traj[1.0]  # (k, T+1, d)
    basis, share = pca_basis(a.reshape(-1, a.shape[-1]))
    view_a = {"basis_share": share, "paths": (a @ basis.T).tolist(), "ray": (paths["bias0"] @ basis.T).tolist()}
    disp = {g: traj[g] - traj[0.0] for g in (float(g) for g in gains) if g != 0.0}
    if disp:
        stacked = np.concatenate([x.reshape(-1, x.shape[-1]) for x in disp.values()])
        basis_b, share_b = pca_basis(stacked)
        view_b = {"basis_share": share_b, "paths": {str(g): (x @ basis_b.T).tolist() for g, x in disp.items()}}
    else:
        view_b = {"basis_share": [0.0, 0.0], "paths": {}}
    return {"trajectories": view_a, "displacements": view_b}
