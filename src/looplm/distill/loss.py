"""The distillation loss, LMDR eq. 4 (arXiv:2610.06833 §3.2; SPEC §8):

    L(ψ) = E_x[ ‖ẑ − z^R‖²_F / (N·d·σ_T²)  +  N⁻¹ Σ_t KL(p_t ‖ p̂_t) ]

for a window of N tokens of width d, with ẑ = S_ψ(e) (B, N, d) and z^R the teacher's hidden state after
R recurrences. Each term has a weight (``hidden_weight``, ``kl_weight``; 0 switches it off).

- **Hidden term**: summed over the batch's entries and divided by B·N·d·σ_T², i.e. the batch mean of
  the per-window term.
- **σ_T²** (our choice; the paper names it "the variance of the teacher's states" and is silent on the
  estimator): the population variance of every entry of z^R — one scalar, the mean over entries of
  (z − z̄)², z̄ the scalar mean of all entries — estimated **once**, before the first step, from
  ``distill.sigma_batches`` batches of the training stream drawn apart from the training batches, and
  stored with the student (so a resumed run uses the same value). A global constant keeps the hidden
  term's scale fixed over training (a per-batch estimate would reweight the two terms from batch to
  batch). :class:`VarianceAccumulator` computes it in float64.
- **KL term**: p_t = softmax of the teacher's logits at depth R, p̂_t = softmax of the teacher's own
  coda + readout applied to ẑ (our choice: both terms then vanish at ẑ = z^R, and the student with the
  teacher's coda is a standalone language model, the use LMDR §3.2 mentions). KL(p ‖ p̂) =
  Σ_v p_v (log p_v − log p̂_v), averaged over the B·N tokens, in float32 at least.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DistillLoss:
    """``loss`` = hidden_weight·hidden + kl_weight·kl (the scalar to back-propagate); ``hidden`` and ``kl``
    are the unweighted terms (0-d tensors; a switched-off term is still computed when its inputs are
    given, else 0)."""

    loss: torch.Tensor
    hidden: torch.Tensor
    kl: torch.Tensor


def hidden_term(z_hat: torch.Tensor, z: torch.Tensor, sigma2: float) -> torch.Tensor:
    """‖ẑ − z‖²_F / (N·d·σ_T²) averaged over the batch. z_hat, z: (B, N, d). Returns a 0-d float32+ tensor.

    Raises:
        ValueError: shapes differ or σ_T² ≤ 0.
    """
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

    Raises:
        ValueError: ``kl_weight > 0`` without both logits; bad shapes or σ_T² (see :func:`hidden_term`).
    """
    hidden = hidden_term(z_hat, z, sigma2)
    if student_logits is not None and teacher_logits is not None:
        kl = kl_term(teacher_logits, student_logits)
    elif kl_weight > 0:
        raise ValueError("distill loss: kl_weight > 0 needs the teacher's and the student's logits")
    else:
        kl = hidden.new_zeros(())
    loss = hidden_weight * hidden + kl_weight * kl
    return DistillLoss(loss=loss, hidden=hidden, kl=kl)


class VarianceAccumulator:
    """Population variance of every entry seen (float64 sums): σ² = E[z²] − E[z]² over all entries."""

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.total_sq = 0.0

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
