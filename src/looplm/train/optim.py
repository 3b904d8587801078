"""AdamW with weight decay on matrices only, and linear warm-up + cosine decay (SPEC §5)."""

from __future__ import annotations

import math

import torch
from torch import nn

from looplm.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; parameters with ≥ 2 dims (matrices, embeddings) get ``weight_decay``, the rest none."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps``, then cosine from 1 to ``min_lr_ratio`` at ``steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
