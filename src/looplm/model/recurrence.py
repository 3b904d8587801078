"""Recurrence rules: one registry, one name each (SPEC §2).
Sources: SCSE arXiv:2607.27656 (eq. 2–6, 22); Huginn-family injections arXiv:2610.06833 (eq. 8, Table 7).

A rule maps the embedding ``e`` (B, L, d) to h*, the initial loop state and a :class:`LoopContext` (``start``),
and updates the loop state (``step``, wrapped by :meth:`LoopLM.step`); ``core(x, qkv_inject=None, *, call=0)``
returns G(x) at KV visit ``t · core_calls_per_step + call``. The state is h, or Δ = h − h* for the SCSE family
and additive_subtract (``hidden`` / ``to_state``). Injections (scaled by ``with_injection_gain``, SPEC §7): ``e``
(looped, norm_reset), ``α·W_in h*`` (adapter, step_adapter, step_film), ``κ·W_c h*`` (sc_cond, sc_subtract,
scse_leak, scse with ``kappa ≠ 0``), ``α·W_in e`` (additive_subtract); main SCSE has none.
:func:`register_rule` adds a rule; ``ModelConfig.rule`` names it and ``config.RULE_OPTIONS`` its options.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from looplm.config import RULE_NAMES, ModelConfig
from looplm.model.layers import RMSNorm, sinusoidal_step_embedding


@dataclass
class LoopContext:
    """Per-sequence constants of one unroll, (B, L, d) unless stated: ``anchor`` h*, ``injection`` (re-added
    every step; None for none), ``qkv`` per-core-block Q/K/V injections (B, L, 3d) of ``deq_qkv``; set by the
    model: ``valid`` (B, L, 1) real tokens (None = all) and ``scope``, a cached forward's attention scope."""

    anchor: torch.Tensor | None
    injection: torch.Tensor | None = None
    qkv: list | None = None
    valid: torch.Tensor | None = None
    scope: object | None = None


class RecurrenceRule(nn.Module):
    """Base class. Subclasses implement ``start`` and ``step``; :func:`register_rule` names them."""

    #: whether ``start`` takes the token positions (the Huginn family's gaussian initial state)
    uses_positions = False
    #: core applications per loop step (2 for the subtractive controls)
    core_calls_per_step = 1

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        #: residual step scale s (plain and the Huginn family have none)
        self.s = getattr(cfg.options, "step_scale", 1.0)

    def start(self, e: torch.Tensor) -> tuple[torch.Tensor, LoopContext]:
        raise NotImplementedError

    def step(self, core, state: torch.Tensor, t: int, ctx: LoopContext, *,
             mask: bool = True) -> torch.Tensor:
        """``state_t → state_{t+1}`` (B, L, d) at 0-based step t (via :meth:`LoopLM.step`); ``mask=False``: the
        raw pre-mask map b̃ (the masked SCSE family)."""
        raise NotImplementedError

    def hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return state

    def to_state(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return h

    def source_modules(self) -> list[tuple[nn.Linear, float]]:
        """The linear maps of e, h* or γ_t that feed the loop, each with its ``matched`` std, in a fixed order: here
        1/√fan_in, the σ_m of a map whose output keeps its input's RMS."""
        maps = [getattr(self, name, None) for name in ("in_proj", "step_proj", "cond_proj", "adapter")]
        return [(m, 1.0 / math.sqrt(m.in_features)) for m in maps + [*getattr(self, "qkv_proj", ())] if m is not None]

    def with_injection_gain(self, ctx: LoopContext, gain: float) -> LoopContext:
        """``ctx`` with the injection scaled by ``gain`` (dose response, SPEC §7; unchanged without one)."""
        return dataclasses.replace(ctx, injection=None if ctx.injection is None else gain * ctx.injection,
                                   qkv=None if ctx.qkv is None else [gain * q for q in ctx.qkv])


RULES: dict[str, type[RecurrenceRule]] = {}


def register_rule(*names: str):
    """Class decorator: ``RULES[name]`` is the class for each of ``names`` (the class reads ``cfg.rule``)."""
    def register(cls: type[RecurrenceRule]) -> type[RecurrenceRule]:
        RULES.update(dict.fromkeys(names, cls))
        return cls
    return register


def build_rule(cfg: ModelConfig) -> RecurrenceRule:
    """The rule named by ``cfg.rule`` (KeyError listing the known names if unregistered)."""
    if cfg.rule not in RULES:
        raise KeyError(f"model.rule: unknown recurrence rule {cfg.rule!r}; known: {', '.join(sorted(RULES))}")
    return RULES[cfg.rule](cfg)


def _linear(d: int) -> nn.Linear:
    return nn.Linear(d, d, bias=False)


def init_source_modules(rule: RecurrenceRule, scheme: str, std: float = 0.0, *, unit_projections: bool = False) -> None:
    """Initialize the rule's source modules by ``scheme`` (option ``source_init``; SPEC §1, our choice): ``gpt2``
    keeps N(0, init_std), ``torch`` nn.Linear's default, ``normal`` N(0, ``std``) (``unit_projections``: only A, I),
    ``matched`` N(0, σ_m), bias 0. rms(Wx) = σ·√n·rms(x), so SCSE's Δ₀ = c_0·I(e) − c_a·A(e) (eq. 3–4) has the
    RMS of e at σ_m = 1/√(d·(c_0² + c_a²)); the other maps get 1/√fan_in (the rule's scalar sets the size).
    ValueError: an unknown scheme, or ``normal`` without a positive ``std``."""
    if scheme == "gpt2":
        return
    if scheme not in ("torch", "matched", "normal"):
        raise ValueError(f"model.options.source_init: unknown scheme {scheme!r}; known: gpt2, torch, matched, normal")
    if scheme == "normal" and not std > 0:
        raise ValueError(f"model.options.source_init_std: must be > 0 with source_init=normal, got {std}")
    state_modules = [getattr(rule, "anchor_proj", None), getattr(rule, "init_proj", None)]  # A, I
    for module, matched in rule.source_modules():
        if scheme == "torch":
            module.reset_parameters()
            continue
        unit = unit_projections and not any(module is m for m in state_modules)
        nn.init.normal_(module.weight, 0.0, matched if scheme == "matched" or unit else std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


@register_rule("looped")
class Looped(RecurrenceRule):
    """Looped baseline: ``h_{t+1} = h_t + s·G(h_t + e)``, h* = h_0 = e, s = 1 (SPEC §2, our choice)."""

    def start(self, e):
        return e, LoopContext(anchor=e, injection=e)

    def step(self, core, state, t, ctx, *, mask=True):
        return state + self.s * core(state + ctx.injection)


class _AnchoredStart(RecurrenceRule):
    """Learned anchor ``h* = e + c_a·A(e)`` and initial state ``h_0 = e + c_0·I(e)`` (SCSE eq. 3–4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.c_a, self.c_0 = cfg.options.anchor_scale, cfg.options.init_scale
        self.anchor_proj = _linear(cfg.d_model)  # A
        self.init_proj = _linear(cfg.d_model)  # I

    def anchor_and_init(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return e + self.c_a * self.anchor_proj(e), e + self.c_0 * self.init_proj(e)

    def source_modules(self):
        """A (if the rule has it) and I at σ_m = 1/√(d·(c_0² + c_a²)) (:func:`init_source_modules`), then the rest."""
        A = getattr(self, "anchor_proj", None)
        d = self.init_proj.in_features
        c2 = self.c_0 ** 2 + (self.c_a ** 2 if A is not None else 0.0)
        sigma = 1.0 / math.sqrt(d * c2) if c2 > 0 else 1.0 / math.sqrt(d)
        return [(m, sigma) for m in (A, self.init_proj) if m is not None] + super().source_modules()


@register_rule("adapter")
class Adapter(_AnchoredStart):
    """Tuned adapter: ``h_{t+1} = h_t + s·G(h_t + α·W_in h*)``; α learned (init 0.15), s = 0.35."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.in_proj = _linear(cfg.d_model)  # W_in
        self.alpha = nn.Parameter(torch.tensor(float(cfg.options.alpha_init)))

    def start(self, e):
        anchor, h0 = self.anchor_and_init(e)
        return h0, LoopContext(anchor=anchor, injection=self.alpha * self.in_proj(anchor))

    step = Looped.step


@register_rule("step_adapter")
class StepAdapter(Adapter):
    """Recurrent-step-conditioned adapter (SCSE eq. 6): adds ``τ·P_step γ_t`` to the core input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.tau = cfg.options.step_tau
        self.step_proj = _linear(cfg.d_model)  # P_step

    def step(self, core, state, t, ctx, *, mask=True):
        gamma = sinusoidal_step_embedding(t, state.shape[-1], device=state.device, dtype=state.dtype)  # (d,)
        return state + self.s * core(state + ctx.injection + self.tau * self.step_proj(gamma))


@register_rule("step_film")
class StepFilm(Adapter):
    """Step-FiLM adapter (SCSE appendix; SPEC §2): ``u = h + α·W_in h*``, ``h_{t+1} = h + s·G((1 + σ·g_t)⊙u + σ·b_t)``,
    (g_t, b_t) = ``film[min(t, steps − 1)]`` of a learned (steps, 2, d) table, N(0, init_std) after
    :meth:`LoopLM.reset_parameters` (a near-identity start; our choice)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.sigma = cfg.options.sigma
        self.film = nn.Parameter(torch.zeros(cfg.options.steps, 2, cfg.d_model))  # (n_steps, {g, b}, d)

    def step(self, core, state, t, ctx, *, mask=True):
        g, b = self.film[min(t, self.film.shape[0] - 1)]  # (d,), (d,)
        u = state + ctx.injection  # (B, L, d)
        return state + self.s * core((1.0 + self.sigma * g) * u + self.sigma * b)


@register_rule("norm_reset")
class NormReset(Looped):
    """Periodic normalization reset (SCSE appendix; SPEC §2): the looped step, then ``h ← RMSNorm(h)``
    (parameter-free, our choice: parameter-matched to looped) whenever t + 1 ≡ 0 mod ``period``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.period = cfg.options.period
        self.reset_norm = RMSNorm(cfg.d_model, cfg.norm_eps, affine=False)

    def step(self, core, state, t, ctx, *, mask=True):
        h = super().step(core, state, t, ctx, mask=mask)
        return self.reset_norm(h) if (t + 1) % self.period == 0 else h


@register_rule("scse", "sc_cond", "scse_leak")
class SourceCentered(_AnchoredStart):
    """The masked source-centered recurrence of the SCSE family (SCSE eq. 5, Listing 1; SPEC §2) on Δ = h − h*:
    ``q_t = s·U(Δ_t)``, ``m_b = 1{‖Δ_t^(b)‖²_F > ε}``, ``Δ_{t+1} = (1 − λ)Δ_t + m_b·q_t``, readout ``h* + Δ_T``;
    the injection is ``c_sc = κ·W_c h*``; option ``anchor`` picks h*, ``leak`` λ (0 without the option).
    ``scse``: the main method, κ = 0 (then no W_c at all), λ = 0, s = 0.5. ``sc_cond`` (SC-Cond, SCSE appendix):
    ``q = s·G(Δ + c_sc)``, W_c whatever κ, no leak; masked, b_t = 0 but b̃_t = s·G(c_sc). ``scse_leak`` (SCSE
    appendix; Listing 1): SC-Cond with deviation leak λ_leak = ``leak``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.anchor_kind = cfg.options.anchor
        self.use_mask = cfg.options.mask
        self.eps = cfg.options.eps
        self.leak = getattr(cfg.options, "leak", 0.0)
        if self.anchor_kind in ("embedding", "init"):
            del self.anchor_proj
        elif self.anchor_kind == "frozen_random":
            self.anchor_proj.weight.requires_grad_(False)
        kappa = cfg.options.kappa
        if kappa != 0.0 or cfg.rule != "scse":  # the SC-Cond rules keep W_c whatever κ
            self.cond_proj = _linear(cfg.d_model)  # W_c
            self.kappa = nn.Parameter(torch.tensor(float(kappa)))
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
        return h0 - anchor, LoopContext(anchor=anchor, injection=cond)

    def raw_update(self, core, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """U(Δ) = G(Δ + c_sc) (G(Δ) without conditioning). (B, L, d) → (B, L, d)."""
        return core(state if ctx.injection is None else state + ctx.injection)

    def step(self, core, state, t, ctx, *, mask=True):
        q = self.s * self.raw_update(core, state, ctx)  # (B, L, d)
        if mask and self.use_mask:
            sq = state.pow(2) if ctx.valid is None else state.pow(2) * ctx.valid  # padding excluded
            energy = sq.sum(dim=(1, 2))  # (B,) ‖Δ_t^(b)‖²_F
            if ctx.scope is not None:  # cached decoding: the norm runs over the whole prefix too
                energy = ctx.scope.accumulate(("scse_energy", t), energy)
            active = (energy > self.eps)[:, None, None]  # (B, 1, 1)
            q = q * active.to(q.dtype)
        return (1.0 - self.leak) * state + q if self.leak else state + q

    def hidden(self, state, ctx):
        return ctx.anchor + state

    def to_state(self, h, ctx):
        return h - ctx.anchor


@register_rule("sc_subtract")
class SCSubtract(SourceCentered):
    """Subtractive SC-Cond (SCSE appendix; SPEC §2): ``q = s·[G(Δ + c_sc) − G(c_sc)]``, two core calls per step
    (c_body = 2; independent dropout masks in training, as in the paper)."""

    core_calls_per_step = 2

    def raw_update(self, core, state, ctx):
        return core(state + ctx.injection) - core(ctx.injection, call=1)


@register_rule("additive_subtract")
class AdditiveSubtract(Adapter):
    """Additive forcing subtraction (SCSE eq. 22; SPEC §2) on Δ: ``u_t = G(h* + Δ_t + α·W_in e + τ_t) −
    G(h* + α·W_in e + τ_t)``, ``Δ_{t+1} = Δ_t + s·u_t``; τ_t = τ·P_step γ_t, τ = 0 by default (our choice: the
    paper lists no step term for this control); two core calls per step; no mask."""

    core_calls_per_step = 2

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)  # A, I, then W_in and α
        self.tau = cfg.options.step_tau
        self.step_proj = _linear(cfg.d_model) if self.tau else None  # P_step

    def start(self, e):
        anchor, h0 = self.anchor_and_init(e)
        return h0 - anchor, LoopContext(anchor=anchor, injection=self.alpha * self.in_proj(e))

    def step(self, core, state, t, ctx, *, mask=True):
        base = ctx.anchor + ctx.injection  # h* + α·W_in e, (B, L, d)
        if self.step_proj is not None:
            gamma = sinusoidal_step_embedding(t, state.shape[-1], device=state.device, dtype=state.dtype)  # (d,)
            base = base + self.tau * self.step_proj(gamma)
        # base + 0 == base exactly, so at Δ = 0 the two (dropout-free) calls cancel bit for bit
        return state + self.s * (core(base + state) - core(base, call=1))

    hidden, to_state = SourceCentered.hidden, SourceCentered.to_state  # the state is Δ = h − h*


@register_rule("plain")
class Plain(RecurrenceRule):
    """No injection (DeepLoop baseline; SPEC §2): ``h_{t+1} = h_t + G(h_t)``, h* = h_0 = e, no scale s."""

    def start(self, e):
        return e, LoopContext(anchor=e, injection=None)

    def step(self, core, state, t, ctx, *, mask=True):
        return state + core(state)


class _Huginn(RecurrenceRule):
    """Huginn family (SPEC §2): ζ from h and e at the core entrance, ``h_{r+1} = ζ_r + G(ζ_r)``; anchor and
    injection e. Random initial states draw from the global RNG in training; in evaluation (``state_init_seed``
    ≥ 0) from a fixed seeded (seq_len, d) table indexed by position (our choice; -1: fresh, as Huginn-0125)."""

    uses_positions = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.state_init = cfg.options.state_init
        self.std = cfg.options.state_init_std
        self.seed = cfg.options.state_init_seed
        self.seq_len = cfg.seq_len
        self._table: torch.Tensor | None = None

    def _unit_noise(self, shape, like: torch.Tensor, generator=None) -> torch.Tensor:
        """Unit-std noise of ``shape``: N(0, 1), or N(0, 1) truncated to ±3 (``truncated_normal``)."""
        if self.state_init == "gaussian":
            return torch.randn(shape, generator=generator, dtype=like.dtype, device=like.device)
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
        return nn.init.trunc_normal_(out, 0.0, 1.0, -3.0, 3.0, generator=generator)

    def initial_state(self, e: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """h_0 (B, L, d) from e (B, L, d); ``positions`` (B, L) or None (0..L−1)."""
        if self.state_init == "zeros":
            return torch.zeros_like(e)
        if self.state_init == "embedding":
            return e
        if self.training or self.seed < 0:
            return self.std * self._unit_noise(e.shape, e)
        d = e.shape[-1]
        if self._table is None or self._table.device != e.device or self._table.shape != (self.seq_len, d):
            g = torch.Generator(device="cpu").manual_seed(self.seed)
            self._table = self._unit_noise((self.seq_len, d), torch.empty(0), g).to(e.device)
        if positions is None:
            positions = torch.arange(e.shape[1], device=e.device).expand(e.shape[0], -1)
        return (self.std * self._table[positions]).to(e.dtype)  # (B, L, d)

    def start(self, e, positions=None):
        return self.initial_state(e, positions), LoopContext(anchor=e, injection=e)

    def core_input(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """ζ (B, L, d); h itself unless the rule mixes in e (deq_qkv injects into attention instead)."""
        return state

    def step(self, core, state, t, ctx, *, mask=True):
        z = self.core_input(state, ctx)
        return z + core(z, ctx.qkv)


@register_rule("huginn_linear")
class HuginnLinear(_Huginn):
    """``ζ = W_lin [h; e; 1]``, ``h_{r+1} = RMSNorm(ζ + G(ζ))`` (SPEC §2); ``adapter_bias=false`` and
    ``step_norm=false`` give Huginn-0125's recurrence (arXiv:2502.05171)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=cfg.options.adapter_bias)  # W_lin
        self.exit_norm = RMSNorm(cfg.d_model, cfg.norm_eps, affine=False) if cfg.options.step_norm else None

    def core_input(self, state, ctx):
        return self.adapter(torch.cat([state, ctx.injection], dim=-1))

    def step(self, core, state, t, ctx, *, mask=True):
        h = super().step(core, state, t, ctx, mask=mask)
        return self.exit_norm(h) if self.exit_norm is not None else h


class _Decay(_Huginn):
    """Per-channel decay Λ = diag(exp(−Δ⊙α)), Δ = softplus(Δ_raw), α = exp(α_raw) (SPEC §2, Parcae), and W (d×d)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d = cfg.d_model
        self.delta_raw = nn.Parameter(torch.full((d,), float(cfg.options.delta_raw_init)))
        self.alpha_raw = nn.Parameter(torch.full((d,), float(cfg.options.alpha_raw_init)))
        self.in_proj = _linear(d)  # W

    def decay(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Λ, Δ), each (d,)."""
        delta = nn.functional.softplus(self.delta_raw)
        return torch.exp(-delta * torch.exp(self.alpha_raw)), delta


@register_rule("parcae", "parcae_decay")
class Parcae(_Decay):
    """``parcae``: ``ζ = Λ h + Δ ⊙ W e``; ``parcae_decay``: ``ζ = Λ h + Δ ⊙ W·RMSNorm(e)`` (SPEC §2; learned gains,
    LMDR Table 7, unless ``input_norm_affine=false``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        affine = getattr(cfg.options, "input_norm_affine", None)  # parcae_decay's option
        self.in_norm = nn.Identity() if affine is None else RMSNorm(cfg.d_model, cfg.norm_eps, affine=affine)

    def core_input(self, state, ctx):
        lam, delta = self.decay()
        return lam * state + delta * self.in_proj(self.in_norm(ctx.injection))


@register_rule("orthoinj")
class OrthoInj(_Decay):
    """Orthogonal injection (SPEC §2): ``q = Δ ⊙ W e``, ``ζ = Q_q Λ h + q``, ``Q_q v = v − q (qᵀv)/(‖q‖² + 1e-6)``."""

    def core_input(self, state, ctx):
        lam, delta = self.decay()
        q = delta * self.in_proj(ctx.injection)  # (B, L, d)
        v = lam * state
        coef = (q * v).sum(-1, keepdim=True) / (q.pow(2).sum(-1, keepdim=True) + 1e-6)  # (B, L, 1)
        return v - q * coef + q


@register_rule("deq_qkv")
class DEQQKV(_Huginn):
    """Per-layer Q/K/V injection (SPEC §2): ζ = h; core block j adds ``W_e^(j) e`` (d→3d) to its Q, K, V."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.qkv_proj = nn.ModuleList(nn.Linear(cfg.d_model, cfg.qkv_width, bias=False)
                                      for _ in range(cfg.n_core))  # W_e^(j), d → Q/K/V rows (3d without GQA)

    def start(self, e, positions=None):
        h0, ctx = super().start(e, positions)
        return h0, dataclasses.replace(ctx, injection=None, qkv=[w(e) for w in self.qkv_proj])


assert set(RULE_NAMES) == set(RULES), f"config RuleName and rule registry disagree on {set(RULE_NAMES) ^ set(RULES)}"
