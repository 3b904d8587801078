"""Recurrence rules: one registry, one name each (SPEC §2).

A rule defines, from the embedding ``e`` (B, L, d):

- ``start(e)``: the anchor ``h*`` (computed once per sequence), the initial loop state and any
  per-sequence constants (the injection), packed in a :class:`LoopContext`;
- ``step(core, state, t, ctx)``: one loop step ``state_t → state_{t+1}``;
- ``hidden(state, ctx)`` / ``to_state(h, ctx)``: the map between a rule's loop state and the hidden
  state ``h`` that is read out (identity except for SCSE, whose state is the deviation Δ = h − h*).

Register a new rule with :func:`register_rule`; ``ModelConfig.rule`` must name a registered rule.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import nn

from looplm.config import RULE_NAMES, ModelConfig
from looplm.model.layers import Core, sinusoidal_step_embedding


@dataclass
class LoopContext:
    """Per-sequence constants of one unroll. All tensors (B, L, d)."""

    e: torch.Tensor
    anchor: torch.Tensor
    injection: torch.Tensor | None = None


class RecurrenceRule(nn.Module):
    """Base class. Subclasses set ``name`` and implement ``start`` and ``step``."""

    name = ""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.s = cfg.resolved_step_scale

    def start(self, e: torch.Tensor) -> tuple[torch.Tensor, LoopContext]:
        raise NotImplementedError

    def step(self, core: Core, state: torch.Tensor, t: int, ctx: LoopContext, *,
             mask: bool = True) -> torch.Tensor:
        """One loop step. ``mask=False`` gives the raw pre-mask map (only SCSE has a mask)."""
        raise NotImplementedError

    def hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return state

    def to_state(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return h


RULES: dict[str, type[RecurrenceRule]] = {}


def register_rule(cls: type[RecurrenceRule]) -> type[RecurrenceRule]:
    RULES[cls.name] = cls
    return cls


def build_rule(cfg: ModelConfig) -> RecurrenceRule:
    """Instantiate the rule named by ``cfg.rule``.

    Raises:
        KeyError: the name is not registered (the message lists the known names).
    """
    if cfg.rule not in RULES:
        raise KeyError(f"model.rule: unknown recurrence rule {cfg.rule!r}; known: {', '.join(sorted(RULES))}")
    return RULES[cfg.rule](cfg)


def _linear(d: int) -> nn.Linear:
    return nn.Linear(d, d, bias=False)


@register_rule
class Looped(RecurrenceRule):
    """Looped Transformer baseline with additive injection: ``h_{t+1} = h_t + s·G(h_t + e)``.

    h* = h_0 = e; s = 1 by default (SPEC §2, our choice).
    """

    name = "looped"

    def start(self, e):
        return e, LoopContext(e=e, anchor=e, injection=e)

    def step(self, core, state, t, ctx, *, mask=True):
        return state + self.s * core.update(state + ctx.injection)


class _AnchoredStart(RecurrenceRule):
    """Learned anchor ``h* = e + c_a·A(e)`` and initial state ``h_0 = e + c_0·I(e)`` (SCSE eq. 3–4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.c_a, self.c_0 = cfg.anchor_scale, cfg.init_scale
        self.anchor_proj = _linear(cfg.d_model)  # A
        self.init_proj = _linear(cfg.d_model)  # I

    def anchor_and_init(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return e + self.c_a * self.anchor_proj(e), e + self.c_0 * self.init_proj(e)


@register_rule
class Adapter(_AnchoredStart):
    """Tuned adapter: ``h_{t+1} = h_t + s·G(h_t + α·W_in h*)``; α learned (init 0.15), s = 0.35."""

    name = "adapter"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.in_proj = _linear(cfg.d_model)  # W_in
        self.alpha = nn.Parameter(torch.tensor(float(cfg.alpha_init)))

    def start(self, e):
        anchor, h0 = self.anchor_and_init(e)
        return h0, LoopContext(e=e, anchor=anchor, injection=self.alpha * self.in_proj(anchor))

    def step(self, core, state, t, ctx, *, mask=True):
        return state + self.s * core.update(state + ctx.injection)


@register_rule
class StepAdapter(Adapter):
    """Recurrent-step-conditioned adapter (SCSE eq. 6): adds ``τ·P_step γ_t`` to the core input."""

    name = "step_adapter"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.tau = cfg.step_tau
        self.step_proj = _linear(cfg.d_model)  # P_step

    def step(self, core, state, t, ctx, *, mask=True):
        gamma = sinusoidal_step_embedding(t, state.shape[-1], device=state.device, dtype=state.dtype)  # (d,)
        return state + self.s * core.update(state + ctx.injection + self.tau * self.step_proj(gamma))


@register_rule
class SCSE(_AnchoredStart):
    """Source-Centered State Evolution (SCSE eq. 5; SPEC §2). The loop state is the deviation Δ.

    ``q_t = s·G(Δ_t + κ·W_c h*)``, ``m_b = 1{‖Δ_t^(b)‖²_F > ε}``, ``Δ_{t+1} = (1−λ)Δ_t + m_b·q_t``;
    the readout state is ``h* + Δ_T``. Anchor options: learned, embedding (h* = e),
    init (h* = h_0, so Δ_0 = 0 exactly), frozen_random (A random and not trained).
    """

    name = "scse"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.anchor_kind = cfg.scse_anchor
        self.use_mask = cfg.scse_mask
        self.eps = cfg.scse_eps
        self.leak = cfg.scse_leak
        if cfg.scse_anchor in ("embedding", "init"):
            del self.anchor_proj
        elif cfg.scse_anchor == "frozen_random":
            self.anchor_proj.weight.requires_grad_(False)
        if cfg.scse_kappa != 0.0:
            self.cond_proj = _linear(cfg.d_model)  # W_c
            self.kappa = nn.Parameter(torch.tensor(float(cfg.scse_kappa)))
        else:
            self.cond_proj = None

    def start(self, e):
        h0 = e + self.c_0 * self.init_proj(e)
        if self.anchor_kind == "embedding":
            anchor = e
        elif self.anchor_kind == "init":
            anchor = h0
        else:
            anchor = e + self.c_a * self.anchor_proj(e)
        cond = self.kappa * self.cond_proj(anchor) if self.cond_proj is not None else None
        return h0 - anchor, LoopContext(e=e, anchor=anchor, injection=cond)

    def step(self, core, state, t, ctx, *, mask=True):
        x = state if ctx.injection is None else state + ctx.injection
        q = self.s * core.update(x)  # (B, L, d)
        if mask and self.use_mask:
            active = state.pow(2).sum(dim=(1, 2), keepdim=True) > self.eps  # (B, 1, 1)
            q = q * active.to(q.dtype)
        return (1.0 - self.leak) * state + q if self.leak else state + q

    def hidden(self, state, ctx):
        return ctx.anchor + state

    def to_state(self, h, ctx):
        return h - ctx.anchor


def _check_registry() -> None:
    missing = set(RULE_NAMES) ^ set(RULES)
    assert not missing, f"config RuleName and rule registry disagree on {sorted(missing)}"


_check_registry()
