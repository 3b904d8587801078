"""Visit alignment of the shared core's weight gradients (SPEC §7; DeepLoop, arXiv:2607.13491, §3.4, eq. 12):
κ̂_j = ‖Σ_r G_{r,j}‖² / Σ_r ‖G_{r,j}‖², κ̂_R = max_j κ̂_j (1: orthogonal visits of equal norm, R: identical).

Sublayers j: ``core.blocks.i.attn`` and ``core.blocks.i.mlp``, G_{r,j} their concatenated visit-r gradients,
captured in one backward: a forward hook saves each call's input x and hooks its output gradient g, so a
bias-free Linear's per-call gradient is gᵀx (their sum is autograd's ``.grad``: tests).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from looplm.model import LoopLM
from looplm.model.cursor import NLL

LOSSES = ("terminal", "per_loop")


def core_sublayers(model: LoopLM) -> dict[str, dict[str, nn.Linear]]:
    """{"core.blocks.i.attn" | "core.blocks.i.mlp": {module name: nn.Linear}} in block order (ValueError: unshared)."""
    if not model.shared:
        raise ValueError("visit alignment needs a shared (looped) core; this model is model.architecture=unshared")
    out: dict[str, dict[str, nn.Linear]] = {}
    for i, block in enumerate(model.core.blocks):
        for part in ("attn", "mlp"):
            name = f"core.blocks.{i}.{part}"
            out[name] = {f"{name}.{n}" if n else name: m for n, m in getattr(block, part).named_modules()
                         if isinstance(m, nn.Linear)}
    return out


class _VisitRecorder:
    """Forward/tensor hooks that accumulate, per Linear module, Σ_r G_r and every ‖G_r‖² (float64)."""

    def __init__(self, modules: dict[str, nn.Linear]):
        self.sums = {n: torch.zeros_like(m.weight, dtype=torch.float64) for n, m in modules.items()}
        self.sq: dict[str, dict[int, float]] = {n: {} for n in modules}
        self.calls: dict[str, int] = {n: 0 for n in modules}
        self.handles = [m.register_forward_hook(self._forward_hook(n)) for n, m in modules.items()]

    def _forward_hook(self, name: str) -> Callable:
        def hook(module: nn.Linear, args, output: torch.Tensor) -> None:
            if not output.requires_grad:
                return
            if module.bias is not None:
                raise ValueError(f"{name}: visit alignment assumes bias-free Linear layers")
            r = self.calls[name]
            self.calls[name] += 1
            x = args[0].detach()

            def grad_hook(g: torch.Tensor) -> None:
                G = g.detach().reshape(-1, g.shape[-1]).double().T @ x.reshape(-1, x.shape[-1]).double()  # (out, in)
                self.sq[name][r] = self.sq[name].get(r, 0.0) + float(G.pow(2).sum())
                self.sums[name] = self.sums[name] + G

            output.register_hook(grad_hook)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _loss(model: LoopLM, idx: torch.Tensor, targets: torch.Tensor, depth: int, loss: str) -> torch.Tensor:
    if loss == "terminal":
        return model(idx, depth, targets, readout=NLL).loss
    out = model(idx, list(range(1, depth + 1)), targets, readout=NLL)
    valid = (targets != -100).sum().clamp(min=1)
    return torch.stack([out.nll_by_depth[t].sum() / valid for t in range(1, depth + 1)]).mean()


def visit_gradients(model: LoopLM, idx: torch.Tensor, targets: torch.Tensor, depth: int, *,
                    loss: str = "terminal") -> dict[str, dict[str, Any]]:
    """``{sublayer: {"visits", "sum": {module: Σ_r G_r (out, in)}, "visit_sq": [‖G_{r,j}‖² per r]}}`` of one
    batch (idx, targets (B, L)) at depth R; ``.grad`` untouched. ``loss``: ``terminal`` (CE at depth R) or
    ``per_loop`` (mean over r of the CE at loop r). ValueError: unshared, depth < 1, a bad loss."""
    if depth < 1:
        raise ValueError(f"depth: need R >= 1 for visit alignment, got {depth}")
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {', '.join(LOSSES)}, got {loss!r}")
    subs = core_sublayers(model)
    modules = {n: m for mods in subs.values() for n, m in mods.items()}
    rec = _VisitRecorder(modules)
    try:
        with torch.enable_grad():
            torch.autograd.grad(_loss(model, idx, targets, depth, loss), [m.weight for m in modules.values()],
                                allow_unused=True)
    finally:
        rec.close()
    out: dict[str, dict[str, Any]] = {}
    for sub, mods in subs.items():
        counts = {rec.calls[n] for n in mods}
        if len(counts) > 1:
            raise ValueError(f"{sub}: its Linear modules were called different numbers of times "
                             f"({ {n: rec.calls[n] for n in mods} }); cannot pair visits")
        visits = counts.pop() if counts else 0
        sq = [sum(rec.sq[n].get(r, 0.0) for n in mods) for r in range(visits)]
        out[sub] = {"visits": visits, "sum": {n: rec.sums[n] for n in mods}, "visit_sq": sq}
    return out


def _kappa_from(stats: dict[str, Any]) -> float | None:
    denom = sum(stats["visit_sq"])
    if stats["visits"] == 0 or denom == 0.0:
        return None
    return sum(float(s.pow(2).sum()) for s in stats["sum"].values()) / denom


def visit_alignment(model: LoopLM, idx: torch.Tensor, targets: torch.Tensor, depth: int, *,
                    loss: str = "terminal") -> dict[str, Any]:
    """``{"kappa_hat": max_j κ̂_j (None: no nonzero gradient), "depth", "loss", "per_sublayer": [{"name",
    "kappa", "visits", "visit_grad_norm"}]}`` of one batch (as :func:`visit_gradients`)."""
    stats = visit_gradients(model, idx, targets, depth, loss=loss)
    per = [{"name": name, "kappa": _kappa_from(s), "visits": s["visits"],
            "visit_grad_norm": [v ** 0.5 for v in s["visit_sq"]]} for name, s in stats.items()]
    kappas = [p["kappa"] for p in per if p["kappa"] is not None]
    return {"kappa_hat": max(kappas) if kappas else None, "depth": depth, "loss": loss, "per_sublayer": per}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def merge_batches(records: Sequence[dict[str, Any]], labels: tuple[str, ...] = ("t",)) -> dict[str, Any]:
    """Average per-batch records key by key: labels kept, ``*_max``/``*_max_abs`` maxed, ``*_min`` minned,
    lists averaged elementwise, None ignored."""
    out: dict[str, Any] = {}
    for key in records[0]:
        vals = [r[key] for r in records]
        if key in labels:
            out[key] = vals[0]
        elif isinstance(vals[0], list):
            out[key] = [_mean(col) for col in zip(*vals)]
        else:
            nums = [float(v) for v in vals if v is not None]
            pick = max if key.endswith(("_max", "_max_abs")) else min if key.endswith("_min") else _mean
            out[key] = pick(nums) if nums else None
    return out


def merge_alignment(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch means of κ̂_j and visit norms (each batch a minibatch gradient, as an optimizer step sees it);
    κ̂_R = max_j of the means; ``kappa_hat_batch_max`` the largest single-batch κ̂_R."""
    if not records:
        raise ValueError("visit alignment: no batches to merge")
    per = [merge_batches([r["per_sublayer"][j] for r in records], labels=("name", "visits"))
           for j in range(len(records[0]["per_sublayer"]))]
    kappas = [p["kappa"] for p in per if p["kappa"] is not None]
    batch = [r["kappa_hat"] for r in records if r["kappa_hat"] is not None]
    return {"kappa_hat": max(kappas) if kappas else None, "depth": records[0]["depth"], "loss": records[0]["loss"],
            "batches": len(records), "kappa_hat_batch_max": max(batch) if batch else None, "per_sublayer": per}
