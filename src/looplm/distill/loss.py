"""The distillation loss, LMDR eq. 4 (arXiv:2610.06833 §3.2; SPEC §8):

    L(ψ) = E_x[ ‖ẑ − z^R‖²_F / (N·d·σ_T²)  +  N⁻¹ Σ_t KL(p_t ‖ p̂_t) ]

for windows of N tokens of width d, ẑ = S_ψ(e) (B, N, d), each term weighted (0 = off). Our choices where the
paper is silent: σ_T² is the population variance of every entry of z^R, estimated once before step 0 from
``distill.sigma_batches`` batches and stored with the student (a fixed scale; :class:`VarianceAccumulator`,
float64); p̂_t applies the teacher's own coda + readout to ẑ, so both terms vanish at ẑ = z^R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DistillLoss:
    """``loss`` = hidden_weight·hidden + kl_weight·kl; ``hidden``, ``kl`` the unweighted 0-d terms."""

    loss: torch.Tensor
    hidden: torch.Tensor
    kl: torch.Tensor


def hidden_term(z_hat: torch.Tensor, z: torch.Tensor, sigma2: float) -> torch.Tensor:
    """‖ẑ − z‖²_F / (N·d·σ_T²) averaged over the batch. z_hat, z: (B, N, d). Returns a 0-d float32+ tensor.
    ValueError: shapes differ or σ_T² ≤ 0."""
    if z_hat.shape != z.shape:
        raise ValueError(f"hidden term: ẑ has shape {tuple(z_hat.shape)}, z^R {tuple(z.shape)}")
    if not sigma2 > 0:
        raise ValueError(f"hidden term: σ_T² must be > 0, got {sigma2}")
    diff = z_hat.float() - z.float()
    return diff.pow(2).sum() / (diff.numel() * sigma2)


def kl_term(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Token mean of KL(p_t ‖ p̂_t), p = softmax(teacher_logits), p̂ = softmax(student_logits).
    Both (..., V); returns a 0-d tensor (nats)."""
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    n_tokens = log_p.numel() // log_p.shape[-1]
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum") / n_tokens


def distill_loss(z_hat: torch.Tensor, z: torch.Tensor, sigma2: float, *, student_logits: torch.Tensor | None = None,
                 teacher_logits: torch.Tensor | None = None, hidden_weight: float = 1.0,
                 kl_weight: float = 1.0) -> DistillLoss:
    """Eq. 4 (module docstring). z_hat, z: (B, N, d); student_logits, teacher_logits: (B, N, V), needed
    when ``kl_weight > 0``.
    ValueError: ``kl_weight > 0`` without both logits; bad shapes or σ_T² (see :func:`hidden_term`)."""
    hidden = hidden_term(z_hat, z, sigma2)
    if student_logits is not None and teacher_logits is not None:
        kl = kl_term(teacher_logits, student_logits)
    elif kl_weight > 0:
        raise ValueError("distill loss: kl_weight > 0 needs the teacher's and the student's logits")
    else:
        kl = hidden.new_zeros(())
    return DistillLoss(loss=hidden_weight * hidden + kl_weight * kl, hidden=hidden, kl=kl)


class VarianceAccumulator:
    """Population variance of every entry seen (float64 sums): σ² = E[z²] − E[z]² over all entries."""

    def __init__(self) -> None:
        self.n, self.total, self.total_sq = 0, 0.0, 0.0

    def add(self, z: torch.Tensor) -> None:
        z = z.detach().double()
        self.n += z.numel()
        self.total += float(z.sum())
        self.total_sq += float(z.pow(2).sum())

    def variance(self) -> float:
        """Raises ValueError: nothing added, or a variance of 0 (constant states)."""
        if self.n == 0:
            raise ValueError("σ_T²: no teacher state was seen")
        mean = self.total / self.n
        var = self.total_sq / self.n - mean * mean
        if not var > 0:
            raise ValueError(f"σ_T²: the teacher's z^R has variance {var} (constant states); eq. 4 divides by it")
        return var
