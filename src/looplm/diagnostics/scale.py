"""Hidden-state scale along the loop (SPEC §4, §7; the readout-blind-spot paper §2–3, Table 3, Figure 3,
Appendix D; no arXiv id). Per loop k, on readout-coordinate states H_0 … H_K:

- token RMS and L2 (mean, p50, p99, max; the paper's final norms 4×10⁴–6×10⁴ may be L2, SPEC §10);
- radial-gradient fraction r_k = Σ_t ⟨g_t, û_t⟩² / Σ_t ‖g_t‖², g = ∂L_k/∂H_k of the immediate readout loss
  (H_k detached; ≈ 0 for an RMSNorm readout without a coda, Lemma 1);
- radial derivative Σ_t ⟨g_t, H_t⟩ = ∂L_k/∂log s (at k = K the paper's g_K);
- radial increment a_rad,k = mean_t ⟨u_t, F(H_k)_t − H_{k,t}⟩ / d, u_t = H_t/‖H_t‖_rms (Lemma 2).

Pooled over batches: token means and percentiles, r_k as a ratio of pooled sums, the derivative as a batch mean.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from looplm.model import LoopLM
from looplm.model.cursor import token_rms

DEFAULT_LOOPS = 8  # K when the checkpoint has no training depth


def immediate_readout_gradient(model: LoopLM, h: torch.Tensor, targets: torch.Tensor, *,
                               final: bool) -> tuple[float, torch.Tensor]:
    """(mean CE at loop k, g = ∂L_k/∂H_k (B, L, d)) with h detached; ``final`` at the last loop."""
    with torch.enable_grad():
        x = h.detach().requires_grad_(True)
        logits = model.readout(x, final=final)  # (B, L, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        (g,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), g


class ScaleAccumulator:
    """Pools the per-loop scale statistics over batches: ``add(model, states H_0 … H_{K+1} (the last is
    F(H_K)), targets, mask of real tokens)``."""

    def __init__(self, loops: int):
        if loops < 1:
            raise ValueError(f"loops: need K >= 1 for the scale diagnostic, got {loops}")
        self.K = loops
        self.d = self.tokens = 0
        # per loop k = 0 … K: token values (rms, l2) and batch values (radial_deriv, ce); pooled sums
        self.rms, self.l2, self.radial_deriv, self.ce = ([[] for _ in range(loops + 1)] for _ in range(4))
        self.rad_num, self.rad_den, self.a_rad, self.rms_inc = ([0.0] * (loops + 1) for _ in range(4))

    def add(self, model: LoopLM, states: Sequence[torch.Tensor], targets: torch.Tensor,
            mask: torch.Tensor | None = None) -> None:
        K = self.K
        if len(states) < K + 2:
            raise ValueError(f"states: need H_0 … H_{K + 1} ({K + 2} states), got {len(states)}")
        B, L, d = states[0].shape
        self.d = d
        keep = (torch.ones(B, L, dtype=torch.bool) if mask is None else mask.detach().bool()).to(states[0].device)
        self.tokens += int(keep.sum())
        for k in range(K + 1):
            H = states[k].detach()
            H64 = H.double()
            rms = token_rms(H64)[..., 0]  # (B, L) float64
            self.rms[k].append(rms[keep].cpu().numpy())
            ce, g = immediate_readout_gradient(model, H, targets, final=k == K)
            g64 = g.double()
            norm = H64.norm(dim=-1)  # (B, L) per-token L2 norm
            self.l2[k].append(norm[keep].cpu().numpy())
            radial = (g64 * H64).sum(-1)  # ⟨g_t, H_t⟩, (B, L)
            cos_part = torch.where(norm > 0, radial / norm.clamp_min(1e-300), torch.zeros_like(radial))
            self.rad_num[k] += float(cos_part.pow(2).sum())
            self.rad_den[k] += float(g64.pow(2).sum())
            self.radial_deriv[k].append(float(radial.sum()))
            self.ce[k].append(ce)
            step = states[k + 1].detach().double() - H64  # F(H_k) − H_k, (B, L, d)
            # ⟨u, ΔH⟩/d with u = H/‖H‖_rms = √d·H/‖H‖₂
            a = (H64 * step).sum(-1) / (norm.clamp_min(1e-300) * math.sqrt(d))  # (B, L)
            self.a_rad[k] += float(a[keep].sum())
            self.rms_inc[k] += float((token_rms(states[k + 1].detach().double())[..., 0] - rms)[keep].sum())

    def result(self) -> dict[str, Any]:
        """``{"K", "d", "tokens", "loops": [per k: token stats, "ce", "radial_grad_fraction", "radial_derivative",
        "radial_increment", "rms_increment"], "g_K", "final_rms_mean", "final_l2_mean"}``; ValueError: empty."""
        if not self.tokens:
            raise ValueError("scale: no batches (or no real tokens) were added")
        loops = []
        for k in range(self.K + 1):
            stats = {}
            for name, v in (("rms", np.concatenate(self.rms[k])), ("l2", np.concatenate(self.l2[k]))):
                stats.update({f"{name}_mean": float(v.mean()), f"{name}_p50": float(np.percentile(v, 50)),
                              f"{name}_p99": float(np.percentile(v, 99)), f"{name}_max": float(v.max())})
            loops.append({
                "k": k, **stats,
                "ce": float(np.mean(self.ce[k])),
                "radial_grad_fraction": self.rad_num[k] / self.rad_den[k] if self.rad_den[k] > 0 else None,
                "radial_derivative": float(np.mean(self.radial_deriv[k])),
                "radial_increment": self.a_rad[k] / self.tokens,
                "rms_increment": self.rms_inc[k] / self.tokens,
            })
        return {"K": self.K, "d": self.d, "tokens": self.tokens, "loops": loops,
                "g_K": loops[-1]["radial_derivative"], "final_rms_mean": loops[-1]["rms_mean"],
                "final_l2_mean": loops[-1]["l2_mean"]}

