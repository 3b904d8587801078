"""Training objectives of a looped model at one sampled depth T (SPEC §4, §5; readout blind spot,
no arXiv id in our copy; exit_weighted after Ouro, arXiv:2510.25741; TBPTT: arXiv:2610.06833 §3.1).

- ``terminal``: cross-entropy at the last loop T.
- ``per_loop``: mean cross-entropy over loops 1..T (readout-blind-spot "per-loop supervision").
- ``exit_weighted`` (Ouro-style): a learned exit gate gives, per token, the hazard
  λ_k = σ(gate(H_k)) of stopping at loop k < T; the exit distribution is
  p_k = λ_k ∏_{j<k}(1 − λ_j) for k < T and p_T = ∏_{j<T}(1 − λ_j); the loss is
  Σ_k p_k·CE_k − β·H(p), averaged over tokens, with β = ``train.exit_entropy``.
- ``norm_penalty`` (any supervision): + λ·T⁻¹ Σ_{k=1..T} mean_tokens ‖H_k‖²_rms (SPEC §4), where
  ‖H‖²_rms = mean over d of H².

The gradient estimator (``train.gradient``; SPEC §5, LMDR §3.1, A.2) is passed to the unroll; with ``endpoint``
(Neumann-b) every "loop T" term above is read at z̄^b (depth T + b). The learned prior observes (T, CE_T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looplm.config import TrainConfig
from looplm.model.cursor import Gradient, Readout


@dataclass
class LossResult:
    """``loss``: the scalar to back-propagate; ``ce``: the terminal-loop mean CE (nats, detached float);
    ``n_tokens``: supervised tokens; ``extras``: logged scalars (floats)."""

    loss: torch.Tensor
    ce: float
    n_tokens: int
    extras: dict


def exit_distribution(exit_logits: list[torch.Tensor]) -> torch.Tensor:
    """Exit probabilities (T, B, L) over loops 1..T from T gate logits (B, L) (the last unused: p_T is the rest)."""
    T = len(exit_logits)
    survive = torch.ones_like(exit_logits[0])
    probs = []
    for k in range(T - 1):
        lam = torch.sigmoid(exit_logits[k].float())
        probs.append(survive * lam)
        survive = survive * (1.0 - lam)
    probs.append(survive)
    return torch.stack(probs)


def training_loss(model, x: torch.Tensor, y: torch.Tensor, depth: int, tcfg: TrainConfig) -> LossResult:
    """The training loss of ``model`` (possibly DDP/FSDP-wrapped) on x, y (B, L) (-100 ignored) at depth T ≥ 1."""
    sup, lam = tcfg.supervision, tcfg.norm_penalty
    depths = list(range(1, depth + 1)) if sup != "terminal" else depth
    gradient = Gradient(tcfg.gradient.NAME, tcfg.gradient.steps)
    out = model(x, depths, y, gradient=gradient, readout=Readout(logits=False, states=lam > 0, final_depth=depth))
    keys = [*range(1, depth), gradient.key(depth)]  # the readouts of loops 1..T
    valid = (y != -100)
    n = valid.sum().clamp(min=1)
    ce_T = out.nll_by_depth[keys[-1]].sum() / n
    extras: dict = {}
    if sup == "terminal":
        loss = ce_T
    elif sup == "per_loop":
        loss = torch.stack([out.nll_by_depth[k].sum() / n for k in keys]).mean()
    else:
        logits = [out.exit_logits_by_depth[k] for k in keys]
        p = exit_distribution(logits)  # (T, B, L)
        nll = torch.stack([out.nll_by_depth[k] for k in keys])  # (T, B, L)
        m = valid.to(p.dtype)
        expected = (p * nll).sum(0)  # (B, L)
        entropy = -(p * torch.log(p.clamp(min=1e-12))).sum(0)  # (B, L)
        loss = ((expected - tcfg.exit_entropy * entropy) * m).sum() / n
        loss = loss + 0.0 * logits[-1].sum()  # keeps the last gate call in the graph (DDP)
        mean_exit = (p * torch.arange(1, depth + 1, dtype=p.dtype, device=p.device)[:, None, None]).sum(0)
        extras.update(exit_entropy=float((entropy * m).sum().detach() / n), mean_exit_loop=float((mean_exit * m).sum().detach() / n))
    if lam > 0:
        m = valid.float()  # (B, L): mean over the scored tokens (SPEC §4 mean_tokens)
        sq = torch.stack([(h.float().pow(2).mean(-1) * m).sum() / n for h in (out.states[k] for k in keys)])  # (T,)
        penalty = lam * sq.mean()
        loss = loss + penalty
        extras["norm_penalty"] = float(penalty.detach())
    return LossResult(loss=loss, ce=float(ce_T.detach()), n_tokens=int(n), extras=extras)
