"""LoopLM: embed → prelude → loop (core × T under a recurrence rule) → coda → readout (SPEC §1).

:meth:`LoopLM.step` is the whole realized loop step (rule update, SCSE zero-deviation mask, scale control
and clamp); ``forward``, the exit runner (:mod:`looplm.eval.exits`), KV-sharing evaluation and every
diagnostic call it and nothing else, variants being named arguments (``mask``, ``injection_gain``).
:class:`TransformerLM` is the unshared reference: depth T runs the first ``min(T, N)`` of N blocks
(the FLOP proxy of SCSE eq. 20, arXiv:2607.27656). Both share :class:`DepthLM`'s forward; :func:`build_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import Config, ModelConfig
from looplm.model.cursor import BPTT, Gradient, Loop, Readout, token_rms
from looplm.model.fused import linear_cross_entropy
from looplm.model.kvcache import AttentionScope, KVCache, chunk_positions
from looplm.model.layers import Block, CausalSelfAttention, Core, RMSNorm, Rope
from looplm.model.recurrence import LoopContext, build_rule, init_source_modules


@dataclass
class LoopOutput:
    """What :meth:`LoopLM.forward` returns: ``logits`` (B, L, V) and ``loss`` (mean CE over targets != -100) at the
    largest depth; per depth T ``logits_by_depth`` (B, L, V), ``nll_by_depth`` (B, L) nats,
    ``exit_logits_by_depth`` (B, L); ``states`` h_0 … h_T (B, L, d) before the coda; ``anchor`` h*."""

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    logits_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    nll_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    states: list[torch.Tensor] | None = None
    anchor: torch.Tensor | None = None
    exit_logits_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)


def _block_args(cfg: ModelConfig) -> dict:
    """The arguments every :class:`Block` of ``cfg`` takes (sizes, post-LN α, norms, kv heads, q/k bias, rope)."""
    pos = cfg.position  # scaling_factor is 1 unless scaling=linear (the config checks it)
    rope = (Rope(cfg.head_dim, pos.theta, pos.layout, pos.scaling_factor, pos.table_dtype)
            if pos.NAME == "rope" else None)
    return dict(d=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff, dropout=cfg.dropout, eps=cfg.norm_eps,
                post_ln_alpha=None if cfg.residual == "pre_ln" else cfg.residual_alpha_beta[0],
                norm=cfg.block_norm, n_kv_heads=cfg.kv_heads, qk_bias=cfg.qk_bias, rope=rope)


def _normal(name: str, p: torch.Tensor, std: float) -> None:
    """N(0, std) into ``p``; the fused ``gate_up`` as its gate then up halves (the pre-fusion RNG order)."""
    for part in p.chunk(2 if name.endswith("mlp.gate_up.weight") else 1):
        nn.init.normal_(part, 0.0, std)


def _xavier(name: str, p: torch.Tensor, cfg: ModelConfig) -> None:
    """Xavier-normal (DeepNet's base, arXiv:2203.00555) into block matrix ``p`` (out, in), per logical matrix
    (q, k, v of ``attn.qkv``; gate, up of ``mlp.gate_up``)."""
    rows = p.shape[0]
    if name.endswith("attn.qkv.weight"):
        kv = cfg.kv_heads * cfg.head_dim
        splits = [rows - 2 * kv, kv, kv]
    elif name.endswith("mlp.gate_up.weight"):
        splits = [rows // 2, rows // 2]
    else:
        splits = [rows]
    with torch.no_grad():
        for chunk in p.split(splits):
            nn.init.normal_(chunk, 0.0, math.sqrt(2.0 / (p.shape[1] + chunk.shape[0])))


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (dropout off) inside the block; its train/eval mode restored after, also on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class DepthLM(nn.Module):
    """What a looped model and its unshared reference share: embeddings, final norm, readout, init and
    :meth:`forward`. Subclasses define :meth:`start`, :meth:`step`, :meth:`hidden` / :meth:`to_state` and
    the ``prelude`` / ``coda`` blocks."""

    #: whether the model has a shared, depth-recurrent core (False for the unshared reference)
    shared = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # the depth from which a final_only_norm readout normalizes (see forward); None = the largest
        # requested depth. Loading a checkpoint sets it to the nominal training depth.
        self.final_depth: int | None = None
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d) if cfg.position.NAME == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.in_norm = RMSNorm(d, cfg.norm_eps) if cfg.input_norm else None
        self.prelude: Sequence[nn.Module] = ()  # blocks before / after the loop (a LoopLM's own)
        self.coda: Sequence[nn.Module] = ()

    def _finish_init(self) -> None:
        d = self.cfg.d_model
        self.norm_f = RMSNorm(d, self.cfg.norm_eps)
        # exit_norm=final uses norm_f itself (no second module, so no second state-dict key)
        self.exit_norm = RMSNorm(d, self.cfg.norm_eps) if self.cfg.exit_norm == "learned" else None
        self.lm_head = nn.Linear(d, self.cfg.vocab_size, bias=False)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        for i, m in enumerate(m for m in self.modules() if isinstance(m, CausalSelfAttention)):
            m.layer_id = i  # physical layer index for KV caches
        self.reset_parameters()

    # ------------------------------------------------------------------ init and accounting
    def n_physical_blocks(self) -> int:
        return sum(isinstance(m, Block) for m in self.modules())

    def reset_parameters(self) -> None:
        """Pre-LN (GPT-2): N(0, init_std), residual projections init_std/√(2·blocks). Post-LN (SPEC §3): N(0,
        init_std) or Xavier, then value rows, ``attn.proj`` and MLP matrices × β = (8N)^-p. Biases 0; then
        ``embed_init_std`` and the rule's source modules re-draw (so the defaults draw as before)."""
        std = self.cfg.init_std
        post_ln = self.cfg.residual != "pre_ln"
        beta = self.cfg.residual_alpha_beta[1] if post_ln else 1.0
        for name, p in self.named_parameters():
            if name.endswith(".bias") or name.endswith(".qk_bias"):
                nn.init.zeros_(p)
            if p.dim() < 2:
                continue
            in_block = ".attn." in name or ".mlp." in name
            if post_ln and in_block:
                if self.cfg.block_init == "xavier_normal":
                    _xavier(name, p, self.cfg)
                else:
                    _normal(name, p, std)
                with torch.no_grad():
                    if name.endswith("attn.qkv.weight"):
                        p[p.shape[0] - self.cfg.kv_heads * self.cfg.head_dim:].mul_(beta)  # value rows only
                    else:
                        p.mul_(beta)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.n_physical_blocks()))
            else:
                _normal(name, p, std)
        if self.cfg.embed_init_std != -1.0:
            nn.init.normal_(self.tok_emb.weight, 0.0, self.cfg.embed_init_std)
            if self.pos_emb is not None:
                nn.init.normal_(self.pos_emb.weight, 0.0, self.cfg.embed_init_std)

    def num_params(self, trainable_only: bool = True) -> int:
        """Unique parameters; tied embeddings count once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    # ------------------------------------------------------------------ the pieces of the loop
    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None, *,
              scope: AttentionScope | None = None) -> torch.Tensor:
        """Token embedding × ``embed_scale`` + positions (+ input RMSNorm), then the prelude: (B, L) → (B, L, d).
        ``positions`` (B, L) default to 0 … L−1; ``scope`` (KV cache, padding mask, rope positions) at visit 0.
        Raises ValueError when a position reaches ``seq_len``."""
        B, L = idx.shape
        if positions is None:
            if L > self.cfg.seq_len:
                raise ValueError(f"sequence length {L} exceeds model.seq_len={self.cfg.seq_len}")
        elif L and (scope is None or scope.check_positions) and int(positions.max()) >= self.cfg.seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds model.seq_len={self.cfg.seq_len}: "
                             "prompt plus continuation must fit the context length")
        x = self.tok_emb(idx)  # (B, L, d)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        if self.pos_emb is not None:
            pos = torch.arange(L, device=idx.device) if positions is None else positions
            x = x + self.pos_emb(pos)  # + (L, d) or (B, L, d)
        x = self.drop(x)
        if self.in_norm is not None:
            x = self.in_norm(x)
        kv = None if scope is None else scope.at(0)
        for block in self.prelude:
            x = x + block(x, None, kv)
        return x

    def readout(self, h: torch.Tensor, final: bool = True, *, scope: AttentionScope | None = None,
                record: bool = True, tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``lm_head`` of :meth:`readout_features`: (B, L, d) → (B, L, V), or (N, V) for ``tokens`` = (rows, cols)."""
        return self.lm_head(self.readout_features(h, final, scope=scope, record=record, tokens=tokens))

    def readout_features(self, h: torch.Tensor, final: bool = True, *, scope: AttentionScope | None = None,
                         record: bool = True, tokens: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """Exit norm, coda, token selection, then the readout norm (SPEC §4) → (B, L, d) or (N, d): ``rmsnorm``
        ``RMSNorm(h)``, ``raw`` h, ``final_only_norm`` raw unless ``final``. Coda layers attend through ``scope`` at
        visit 0; ``record=False`` reads the KV cache without writing."""
        if self.cfg.exit_norm != "none":  # the loop's exit, before the coda (Huginn-0125: ln_f)
            h = (self.exit_norm if self.exit_norm is not None else self.norm_f)(h)
        kv = None if scope is None else scope.at(0, record)
        for block in self.coda:
            h = h + block(h, None, kv)
        if tokens is not None:
            h = h[tokens[0], tokens[1]]  # (N, d)
        mode = self.cfg.readout
        if mode == "rmsnorm" or (mode == "final_only_norm" and final):
            h = self.norm_f(h)
        return h

    def resolve_final_depth(self, final_depth: int | None, largest: int) -> int:
        """Where ``final_only_norm`` starts: ``final_depth``, else ``self.final_depth``, else ``largest``."""
        return next(f for f in (final_depth, self.final_depth, largest) if f is not None)

    def hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:  # readout coordinates h
        return state

    def to_state(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:  # inverse of hidden
        return h

    # ------------------------------------------------------------------ forward: the recurrence
    def loop(self, idx: torch.Tensor, *, cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
             scale_clamp: bool = False) -> Loop:
        """A :class:`~looplm.model.cursor.Loop` at t = 0 on ``idx`` (B, L) int64: embed → prelude → start.
        ``cache``: continue the cached tokens (SPEC §6); ``attention_mask`` (B, L): 0 = left padding;
        ``scale_clamp``: the evaluation-time clamp (SPEC §4). ValueError: a cache on the unshared reference."""
        if cache is not None and not self.shared:
            raise ValueError("cache: KV caches need the shared architecture")
        scope, positions, valid = self._attention(idx, cache, attention_mask)
        e = self.embed(idx, positions, scope=scope)  # (B, L, d)
        state, ctx = self.start(e, positions)
        if valid is not None or scope is not None:  # valid: (B, L, 1) real tokens
            ctx = dataclasses.replace(ctx, valid=None if valid is None else valid[..., None].to(e.dtype), scope=scope)
        return Loop(self, state, ctx, e=e, scale_clamp=scale_clamp)

    def forward(self, idx: torch.Tensor, depth: int | Sequence[int] = 8, targets: torch.Tensor | None = None, *,
                gradient: Gradient = BPTT, readout: Readout = Readout()) -> LoopOutput:
        """:meth:`read` of a fresh :meth:`loop` on ``idx`` (B, L) int64; cached, padded or clamped unrolls use
        ``model.read(model.loop(idx, cache=cache), depth)``."""
        return self.read(self.loop(idx), depth, targets, gradient=gradient, readout=readout)

    def read(self, loop: Loop, depth: int | Sequence[int], targets: torch.Tensor | None = None, *,
             gradient: Gradient = BPTT, readout: Readout = Readout(),
             on_depth: Callable[[int, torch.Tensor, torch.Tensor | None], None] | None = None) -> LoopOutput:
        """Advance ``loop`` to the largest requested depth, reading out at every requested depth on the way.

        ``loop`` is at step t0 ≤ every depth; ``targets`` (B, L) int64 (or (N,) with ``readout.tokens``), -100
        ignored; ``endpoint`` reads depth T at ``gradient.key(T)``; ``on_depth(T, h_T, logits_T or None)`` runs at
        every T = t0 … max(depth).
        ValueError: no depth, a depth below t0, a cached unroll at depth 0 or with an endpoint gradient, or a
        truncated gradient on the unshared reference."""
        depths = sorted({int(depth)} if isinstance(depth, int) else {int(t) for t in depth})
        if not depths or depths[0] < loop.t:
            raise ValueError(f"depth: need one or more loop depths >= t0 = {loop.t}, got {depth!r}")
        if loop.cached and depths[-1] < 1:
            raise ValueError(f"depth: a cached forward needs a loop depth >= 1, got {depth!r}")
        if gradient.kind != "bptt" and not self.shared:
            raise ValueError("gradient: the unshared reference has no recurrence to truncate, got "
                             f"{gradient.kind}-{gradient.steps}")
        if gradient.kind == "endpoint" and loop.cached:
            raise ValueError("gradient: endpoint gradients are a training estimator; a cached forward has none")
        last = gradient.key(depths[-1])
        wanted = {*depths[:-1], last}
        loop.window(gradient, last)
        out = LoopOutput(states=[] if readout.states else None, anchor=loop.ctx.anchor)
        final = self.resolve_final_depth(readout.final_depth, last)
        fused = readout.fused_ce and targets is not None and not readout.logits

        def read(T: int, h: torch.Tensor) -> torch.Tensor | None:
            """Exit-gate logits, then logits and NLL, or the fused readout + loss, or the coda alone (to fill the
            cache; only the last readout records)."""
            if self.exit_gate is not None and T >= 1:
                out.exit_logits_by_depth[T] = self.exit_gate(h).squeeze(-1)  # (B, L)
            kw = dict(final=T >= final, scope=loop.scope, record=T == last, tokens=readout.tokens)
            if fused or (targets is None and not readout.logits):  # no (B, L, V) logits
                feats = self.readout_features(h, **kw)
                if fused:
                    out.nll_by_depth[T] = linear_cross_entropy(feats, self.lm_head.weight, targets)
                return None
            logits = self.readout(h, **kw)
            if readout.logits:
                out.logits_by_depth[T] = logits
            if targets is not None:
                # returned tensors must not be views: FSDP2 hooks the root module's outputs for backward
                out.nll_by_depth[T] = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                                                      ignore_index=-100, reduction="none").view(targets.shape).clone()
            return logits

        while True:
            if readout.states:
                out.states.append(loop.h)
            logits = read(loop.t, loop.h) if loop.t in wanted else None
            if on_depth is not None:
                on_depth(loop.t, loop.h, logits)
            if loop.t == last:
                break
            loop.advance()
        if loop.cached:
            loop.scope.commit()
        out.logits = out.logits_by_depth.get(last)
        if targets is not None:
            out.loss = out.nll_by_depth[last].sum() / (targets != -100).sum().clamp(min=1)
        return out

    def _attention(self, idx: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None
                   ) -> tuple[AttentionScope | None, torch.Tensor | None, torch.Tensor | None]:
        """(scope, positions (B, L), valid (B, L) bool) of a forward; all None without cache or mask."""
        if cache is None and attention_mask is None:
            return None, None, None
        valid = (attention_mask.bool() if attention_mask is not None
                 else torch.ones(idx.shape, dtype=torch.bool, device=idx.device))  # (B, L)
        if cache is not None:
            cache.calls_per_step = self.calls_per_step
            if cache.capacity is None:
                cache.capacity = self.cfg.seq_len  # the static cache's preallocated positions
        positions = chunk_positions(valid, cache, idx.shape[1], idx.device)  # (B, L)
        key_valid = valid if attention_mask is not None else None
        scope = AttentionScope(None, key_valid, positions) if cache is None else cache.open_scope(key_valid, positions)
        return scope, positions, key_valid

    calls_per_step = 1


class LoopLM(DepthLM):
    """A looped LM: embed → prelude → T × (rule over a shared core) → coda → readout (SPEC §1–2).
    Raises ValueError unless ``cfg.architecture`` is ``shared`` (use :func:`build_model`)."""

    shared = True

    def __init__(self, cfg: ModelConfig):
        if cfg.architecture != "shared":
            raise ValueError(f"model.architecture: LoopLM builds shared models, got {cfg.architecture!r}; "
                             "use looplm.model.build_model (TransformerLM for the unshared reference)")
        super().__init__(cfg)
        d = cfg.d_model
        self.prelude = nn.ModuleList(Block(**_block_args(cfg)) for _ in range(cfg.n_prelude))
        self.core = Core(cfg.n_core, **_block_args(cfg))
        self.rule = build_rule(cfg)
        self.coda = nn.ModuleList(Block(**_block_args(cfg)) for _ in range(cfg.n_coda))
        control = cfg.scale_control
        self.loop_norm = RMSNorm(d, cfg.norm_eps) if control.NAME == "inter_loop_norm" else None
        self.damping_raw = (nn.Parameter(torch.tensor(math.log(control.init / (1 - control.init))))
                            if control.NAME == "spectral_damping" else None)
        self.exit_gate = nn.Linear(d, 1) if cfg.exit_gate else None
        self.calls_per_step = self.rule.core_calls_per_step
        self._finish_init()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self.rule, "anchor_proj", None) is not None:
            nn.init.normal_(self.rule.anchor_proj.weight, 0.0, self.cfg.init_std)  # frozen_random keeps this draw
        opts = self.cfg.options
        if hasattr(opts, "source_init"):
            init_source_modules(self.rule, opts.source_init, opts.source_init_std,
                                unit_projections=getattr(opts, "projection_init", "source") == "unit")

    def start(self, e: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, LoopContext]:
        """Initial loop state (B, L, d) and :class:`LoopContext` from e (B, L, d) (:meth:`loop` adds the scope)."""
        return self.rule.start(e, positions) if self.rule.uses_positions else self.rule.start(e)

    def step(self, state: torch.Tensor, t: int, ctx: LoopContext, *, mask: bool = True,
             injection_gain: float = 1.0, clamp_rms: torch.Tensor | None = None) -> torch.Tensor:
        """The realized loop step t (0-based): state_t → state_{t+1}, (B, L, d): the rule's update (SPEC §2), the
        scale control on h (SPEC §4), then the clamp to ``clamp_rms`` (B, L, 1). The core attends at visit
        ``t · calls_per_step + call``. ``mask=False``: SCSE's raw b̃_t (arXiv:2607.27656 §2); ``injection_gain``:
        the dose response g (SPEC §7)."""
        if injection_gain != 1.0:
            ctx = self.rule.with_injection_gain(ctx, injection_gain)
        scope, base = ctx.scope, t * self.calls_per_step

        def core(x: torch.Tensor, qkv_inject=None, *, call: int = 0) -> torch.Tensor:
            return self.core(x, qkv_inject, None if scope is None else scope.at(base + call))

        state = self.rule.step(core, state, t, ctx, mask=mask)
        final_norm = self.cfg.scale_control.NAME == "final_norm"
        if self.loop_norm is None and self.damping_raw is None and clamp_rms is None and not final_norm:
            return state
        h = self.rule.hidden(state, ctx)
        if self.loop_norm is not None:
            h = self.loop_norm(h)
        if final_norm:
            h = self.norm_f(h)
        if self.damping_raw is not None:
            h = torch.sigmoid(self.damping_raw) * h
        if clamp_rms is not None:
            h = h * (clamp_rms / token_rms(h).clamp(min=1e-12))
        return self.rule.to_state(h, ctx)

    def hidden(self, state, ctx):
        return self.rule.hidden(state, ctx)

    def to_state(self, h, ctx):
        return self.rule.to_state(h, ctx)


class TransformerLM(DepthLM):
    """The unshared reference: step t applies block t (identity past ``n_layers``), so depth T runs the first
    ``min(T, n_layers)`` blocks (SCSE eq. 20). Raises ValueError unless ``cfg.architecture`` is ``unshared``."""

    def __init__(self, cfg: ModelConfig):
        if cfg.architecture != "unshared":
            raise ValueError(f"model.architecture: TransformerLM builds the unshared reference, got "
                             f"{cfg.architecture!r}")
        super().__init__(cfg)
        self.layers = nn.ModuleList(Block(**_block_args(cfg)) for _ in range(cfg.n_layers))
        self.exit_gate = None
        self._finish_init()

    def start(self, e, positions=None):
        return e, LoopContext(anchor=None)

    def step(self, state, t, ctx, *, clamp_rms=None):
        """Block t+1 of the stack (identity past ``n_layers``): h ← h + Block_t(h). (B, L, d) → (B, L, d)."""
        if clamp_rms is not None:
            raise ValueError("scale_clamp: the unshared reference has no loop to clamp")
        if t >= len(self.layers):
            return state
        return state + self.layers[t](state, None, None if ctx.scope is None else ctx.scope.at(0))


def build_model(cfg: Config | ModelConfig) -> DepthLM:
    """:class:`LoopLM` or :class:`TransformerLM`; from a whole Config, post-LN ``residual_depth = 0`` takes the
    depth sampler's maximum (SPEC §3)."""
    # a whole Config has a model section (duck-typed: an export's remote code holds its own copy of the classes)
    model = getattr(cfg, "model", cfg)
    if model is not cfg and model.residual != "pre_ln" and model.residual_depth == 0:
        model = model.replace(residual_depth=cfg.depth.max_depth())
    return LoopLM(model) if model.architecture == "shared" else TransformerLM(model)
