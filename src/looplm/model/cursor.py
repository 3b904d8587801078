"""The loop cursor: one unroll of a :class:`~looplm.model.DepthLM`, one realized step at a time (SPEC §1–2).

Every loop driver (forward, :func:`looplm.eval.exits.exit_loop`, the diagnostics) iterates a :class:`Loop`;
the scale-clamp target, the gradient window and the exit runner's row selection live here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from looplm.config import GradientConfig, build_choice


def token_rms(h: torch.Tensor) -> torch.Tensor:
    """Per-token RMS over the last dim, computed in at least float32: (..., d) → (..., 1), h's dtype."""
    return h.to(torch.promote_types(h.dtype, torch.float32)).pow(2).mean(-1, keepdim=True).sqrt().to(h.dtype)


def select_rows(obj: Any, keep: torch.Tensor, batch: int) -> Any:
    """``index_select(0, keep)`` on every batch-first tensor inside obj (tensor, tuple/list, dataclass)."""
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, keep) if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(select_rows(o, keep, batch) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: select_rows(getattr(obj, f.name), keep, batch)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


@dataclass(frozen=True)
class Gradient:
    """The gradient estimator (SPEC §5; LMDR §3.1, A.2, arXiv:2610.06833), b = ``steps``: ``bptt`` (full),
    ``tbptt`` (state detached before the last b steps; the context keeps its gradient), ``endpoint``
    (Neumann-b: b steps with autograd from sg(z^T), read out and keyed at T + b). Raises ConfigError."""

    kind: str = "bptt"
    steps: int = 0

    def __post_init__(self):
        given = {"steps": self.steps} if self.kind != "bptt" or self.steps else {}  # bptt has no steps field
        build_choice(GradientConfig, {"kind": self.kind, **given})  # the checks of train.gradient

    def key(self, depth: int) -> int:
        """The depth the readout of requested ``depth`` is taken and keyed at."""
        return depth + self.steps if self.kind == "endpoint" else depth

    def grad_from(self, last: int) -> int:
        """The first step with autograd for a readout at ``last`` (-1: every step)."""
        if self.kind == "endpoint" or (self.kind == "tbptt" and self.steps < last):
            return last - self.steps
        return -1


BPTT = Gradient()


@dataclass(frozen=True)
class Readout:
    """How an unroll is read out (SPEC §4). ``logits``: keep (B, L, V) logits (False: the fused readout + loss
    with targets, unless ``fused_ce=False``; the coda alone without); ``states``: return every h_t;
    ``final_depth``: where ``final_only_norm`` starts; ``tokens``: (rows, cols) (N,) each, read out only these."""

    logits: bool = True
    states: bool = False
    final_depth: int | None = None
    tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    fused_ce: bool = True


#: the loss-only readout of training and evaluation: per-token NLL, no logits kept
NLL = Readout(logits=False)


class Loop:
    """A cursor on one unroll (open it with :meth:`DepthLM.loop`): ``state`` (B, L, d) after ``t`` steps, ``ctx``,
    hidden state ``h``; ``e`` the prelude output. ``scale_clamp`` (SPEC §4): after loop 1, every step rescales
    each token to its loop-1 RMS (:attr:`clamp_rms`)."""

    def __init__(self, model, state: torch.Tensor, ctx, *, e: torch.Tensor | None = None,
                 scale_clamp: bool = False):
        self.model, self.state, self.ctx, self.e = model, state, ctx, e
        self.t = 0
        self.h = model.hidden(state, ctx)
        self.scale_clamp = scale_clamp
        self.clamp_rms: torch.Tensor | None = None  # (B, L, 1) once loop 1 has run
        self.grad_from = -1
        self.frozen: torch.Tensor | None = None  # (B,) bool rows that keep their state
        self._state0 = state

    @property
    def scope(self):  # the attention scope (KV cache, padding), or None
        return self.ctx.scope

    @property
    def cached(self) -> bool:  # the steps write a KV cache
        return self.scope is not None and self.scope.cache is not None

    def resume(self, t: int, h: torch.Tensor) -> Loop:
        """Jump to step t with hidden state h (B, L, d), keeping the context (z̄ = sg(z^t), LMDR §3.2, §5.5).
        ValueError: the unshared reference, t < 0, a wrong shape, or ``scale_clamp`` with t > 0."""
        if not self.model.shared:
            raise ValueError("resume: the unshared reference has no loop state to resume")
        if t < 0:
            raise ValueError(f"resume: T0 must be >= 0, got {t}")
        if self.scale_clamp and t > 0:
            raise ValueError("resume: scale_clamp needs the loop-1 RMS, which a loop resumed at "
                             f"T0 = {t} never computes")
        if h.shape != self.state.shape:
            raise ValueError(f"resume: the state must have shape {tuple(self.state.shape)}, "
                             f"got {tuple(h.shape)}")
        self.state, self.t = self.model.to_state(h, self.ctx), t
        self.h = self.model.hidden(self.state, self.ctx)
        return self

    def window(self, gradient: Gradient, last: int) -> None:
        """Open the gradient window of ``gradient`` for a readout at ``last``."""
        self.grad_from = gradient.grad_from(last) if torch.is_grad_enabled() else -1

    def advance(self, **variant) -> torch.Tensor:
        """One realized step (:meth:`LoopLM.step` with ``variant``), t → t + 1; frozen rows keep theirs. → h."""
        if self.t == self.grad_from:  # an exact zero keeps the initial state's parameters in the graph (DDP)
            self.state = self.state.detach() + 0.0 * self._state0.sum()
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.t >= self.grad_from):
            new = self.model.step(self.state, self.t, self.ctx, clamp_rms=self.clamp_rms, **variant)
        self.state = new if self.frozen is None else torch.where(self.frozen[:, None, None], self.state, new)
        self.t += 1
        self.h = self.model.hidden(self.state, self.ctx)
        if self.scale_clamp and self.clamp_rms is None:
            self.clamp_rms = token_rms(self.h).detach()
        return self.h

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows ``keep`` (n,) int64 of the batch (the exit runner drops halted rows)."""
        B = self.state.shape[0]
        self.state, self.ctx, self.h, self.e, self.clamp_rms, self.frozen, self._state0 = select_rows(
            (self.state, self.ctx, self.h, self.e, self.clamp_rms, self.frozen, self._state0), keep, B)

    def freeze(self, rows: torch.Tensor) -> None:
        """Freeze ``rows`` (B,) bool: they keep their state and copy their exit visit's K/V forward."""
        self.frozen = rows
        if self.scope is not None:
            self.scope.freeze(rows)
