"""AdamW with weight decay on matrices only; linear warm-up, then cosine decay or warm-up–stable–decay
(SPEC §5); :class:`Optimization`, the optimizer step that train, distill and rl share."""

from __future__ import annotations

import math

import torch
from torch import nn

from looplm.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; parameters with ≥ 2 dims (matrices, embeddings) get ``weight_decay``, the rest none."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


#: schedule=wsd: the share of the steps in the final cosine decay (LMDR §5.1: "10% cosine decay to one-tenth
#: of the peak learning rate")
WSD_DECAY_FRACTION = 0.1


def lr_factor(step: int, cfg: OptimConfig, steps: int) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based) of ``steps``: linear warm-up over
    ``warmup_steps``, then a cosine from 1 to ``min_lr_ratio`` at ``steps``, at once (``schedule=cosine``) or,
    for ``wsd`` (warm-up–stable–decay, LMDR §5.1), after 1 until ``max(warmup_steps, steps − round(0.1·steps))``.
    LMDR warms up over 5% of the steps (set ``warmup_steps`` to that; preset ``huginn-cpu``)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    start = cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = max(cfg.warmup_steps, steps - round(WSD_DECAY_FRACTION * steps))
        if step < start:
            return 1.0
    span = max(1, steps - start)
    progress = min(1.0, (step - start) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, steps: int,
                    start: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """:func:`lr_factor` over ``steps`` as a scheduler whose next step is ``start`` (> 0: the groups need
    ``initial_lr``)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg, steps), last_epoch=start - 1)


class Optimization:
    """AdamW (:func:`build_optimizer`) over ``model``, its schedule over ``steps`` (:func:`build_scheduler`) and
    gradient clipping at ``cfg.grad_clip``: the optimizer step of every run (train, distill, rl)."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, steps: int):
        self.params, self.cfg = list(model.parameters()), cfg  # clipped in the module's order
        self.opt = build_optimizer(model, cfg)
        self.sched = build_scheduler(self.opt, cfg, steps)

    def step(self, loss: float) -> tuple[float, float, bool]:
        """After the backward: clip the gradient (``grad_clip`` 0: off), then one optimizer step unless ``loss`` or
        the gradient norm is non-finite (the step is skipped); the schedule advances either way (a function of the
        step, so resume stays exact). Returns the gradient norm, this step's lr and whether the step was taken."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf))
        lr = self.sched.get_last_lr()[0]
        kept = math.isfinite(loss) and math.isfinite(grad_norm)
        if kept:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, lr, kept

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
