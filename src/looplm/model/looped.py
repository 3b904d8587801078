"""LoopLM: embed → prelude → loop (core × T under a recurrence rule) → coda → readout (SPEC §1).

The same class builds the unshared Transformer reference (``architecture="unshared"``): N distinct
blocks, no recurrence, where depth T runs the first ``min(T, N)`` blocks (its active depth saturates
at N, matching the FLOP proxy of SCSE eq. 20).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ModelConfig
from looplm.model.kvcache import AttentionScope, KVCache
from looplm.model.layers import Block, CausalSelfAttention, Core, RMSNorm
from looplm.model.recurrence import LoopContext, build_rule


@dataclass
class LoopOutput:
    """What :meth:`LoopLM.forward` returns.

    Attributes:
        logits: (B, L, V) at the largest requested depth (None when ``keep_logits=False``).
        loss: mean cross-entropy over targets != -100 at the largest requested depth (None without
            targets).
        logits_by_depth: {T: (B, L, V)} for every requested depth (when ``keep_logits``).
        nll_by_depth: {T: (B, L)} per-token negative log-likelihood in nats (with targets).
        states: hidden states h_0 … h_T, each (B, L, d), in readout coordinates (h = h* + Δ for SCSE),
            before the coda (``return_states=True``).
        anchor: the anchor h* (B, L, d) (shared architecture only).
        exit_logits_by_depth: {T: (B, L)} exit-gate logits at each requested depth T ≥ 1 (models with
            ``exit_gate``; SPEC §4 exit_weighted supervision).
    """

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    logits_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    nll_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    states: list[torch.Tensor] | None = None
    anchor: torch.Tensor | None = None
    exit_logits_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)


def _post_ln_alpha(cfg: ModelConfig) -> float | None:
    return None if cfg.residual == "pre_ln" else cfg.residual_alpha_beta[0]


def _block(cfg: ModelConfig) -> Block:
    return Block(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.norm_eps, _post_ln_alpha(cfg))


def token_rms(h: torch.Tensor) -> torch.Tensor:
    """Per-token RMS over the last dim: (..., d) → (..., 1)."""
    return h.float().pow(2).mean(-1, keepdim=True).sqrt().to(h.dtype)


class LoopLM(nn.Module):
    """A looped (or unshared reference) causal language model.

    Args:
        cfg: the model config (SPEC §1–2).

    ``model(idx, depth=T)`` returns a :class:`LoopOutput`; ``depth`` may be an int or a sequence of
    depths, all read out from one unroll to the largest.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # the depth from which a final_only_norm readout normalizes (see forward); None = the largest
        # requested depth. Loading a checkpoint sets it to train.eval_depth.
        self.final_depth: int | None = None
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.drop = nn.Dropout(cfg.dropout)
        self.in_norm = RMSNorm(d, cfg.norm_eps) if cfg.input_norm else None
        self.shared = cfg.architecture == "shared"
        if self.shared:
            self.prelude = nn.ModuleList(_block(cfg) for _ in range(cfg.n_prelude))
            self.core = Core(cfg.n_core, d, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.norm_eps, _post_ln_alpha(cfg))
            self.rule = build_rule(cfg)
            self.coda = nn.ModuleList(_block(cfg) for _ in range(cfg.n_coda))
            self.loop_norm = RMSNorm(d, cfg.norm_eps) if cfg.scale_control == "inter_loop_norm" else None
            self.damping_raw = (nn.Parameter(torch.tensor(math.log(cfg.damping_init / (1 - cfg.damping_init))))
                                if cfg.scale_control == "spectral_damping" else None)
            self.exit_gate = nn.Linear(d, 1) if cfg.exit_gate else None
        else:
            self.layers = nn.ModuleList(_block(cfg) for _ in range(cfg.n_layers))
            self.loop_norm = self.damping_raw = self.exit_gate = None
        self.norm_f = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        for i, m in enumerate(m for m in self.modules() if isinstance(m, CausalSelfAttention)):
            m.layer_id = i  # physical layer index for KV caches
        self.reset_parameters()

    # ------------------------------------------------------------------ init and accounting
    def n_physical_blocks(self) -> int:
        if self.shared:
            return self.cfg.n_prelude + self.cfg.n_core + self.cfg.n_coda
        return self.cfg.n_layers

    def reset_parameters(self) -> None:
        """Initialization (our choice unless stated).

        Pre-LN (GPT-2): N(0, init_std) for every matrix and embedding; the residual output projections
        (attention ``proj``, MLP ``down``) get init_std/√(2·blocks), blocks counted physically.
        Post-LN family (SPEC §3, DeepNet/DeepLoop): N(0, init_std) everywhere, then the value rows of
        ``attn.qkv``, ``attn.proj`` and the MLP matrices (``gate``, ``up``, ``down``) of every block are
        multiplied once by β = (8N)^-p (q and k are not). Gains are 1, biases 0; the adapter gain α
        keeps its configured value.
        """
        std = self.cfg.init_std
        post_ln = self.cfg.residual != "pre_ln"
        beta = self.cfg.residual_alpha_beta[1] if post_ln else 1.0
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            if p.dim() < 2:
                continue
            in_block = ".attn." in name or ".mlp." in name
            if post_ln and in_block:
                nn.init.normal_(p, 0.0, std)
                with torch.no_grad():
                    if name.endswith("attn.qkv.weight"):
                        d = p.shape[1]
                        p[2 * d:].mul_(beta)  # value rows only
                    else:
                        p.mul_(beta)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.n_physical_blocks()))
            else:
                nn.init.normal_(p, 0.0, std)
        if self.shared and getattr(self.rule, "anchor_proj", None) is not None:
            nn.init.normal_(self.rule.anchor_proj.weight, 0.0, std)  # frozen_random keeps this draw

    def num_params(self, trainable_only: bool = True) -> int:
        """Number of (unique) parameters; tied embeddings count once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    # ------------------------------------------------------------------ forward pieces
    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token + learned position embedding (+ input RMSNorm), then the prelude. (B, L) int64 → (B, L, d).

        ``positions`` (B, L) int64 are the position ids (default 0 … L−1; left-padded batches and
        cached decoding pass their own).

        Raises:
            ValueError: a position reaches ``seq_len``.
        """
        B, L = idx.shape
        if positions is None:
            if L > self.cfg.seq_len:
                raise ValueError(f"sequence length {L} exceeds model.seq_len={self.cfg.seq_len}")
            pos_e = self.pos_emb(torch.arange(L, device=idx.device))  # (L, d)
        else:
            if L and int(positions.max()) >= self.cfg.seq_len:
                raise ValueError(f"position {int(positions.max())} exceeds model.seq_len={self.cfg.seq_len}: "
                                 "prompt plus continuation must fit the context length")
            pos_e = self.pos_emb(positions)  # (B, L, d)
        x = self.drop(self.tok_emb(idx) + pos_e)  # (B, L, d)
        if self.in_norm is not None:
            x = self.in_norm(x)
        if self.shared:
            for block in self.prelude:
                x = x + block(x)
        return x

    def readout(self, h: torch.Tensor, final: bool = True) -> torch.Tensor:
        """Coda, then the readout (SPEC §4). (B, L, d) → (B, L, V) logits.

        ``readout="rmsnorm"``: ``W_out · RMSNorm(h)``; ``raw``: ``W_out · h``; ``final_only_norm``: raw
        when ``final=False`` (an intermediate loop), RMSNorm at the last loop.
        """
        if self.shared:
            for block in self.coda:
                h = h + block(h)
        mode = self.cfg.readout
        if mode == "rmsnorm" or (mode == "final_only_norm" and final):
            h = self.norm_f(h)
        return self.lm_head(h)

    def resolve_final_depth(self, final_depth: int | None, largest: int) -> int:
        """The depth from which a ``final_only_norm`` readout normalizes: ``final_depth`` if given, else
        ``self.final_depth``, else ``largest`` (the largest depth of the forward)."""
        return next(f for f in (final_depth, self.final_depth, largest) if f is not None)

    def start(self, e: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, LoopContext]:
        """Initial loop state and per-sequence context (anchor, injection) of the recurrence rule."""
        if self.rule.uses_positions:
            return self.rule.start(e, positions)
        return self.rule.start(e)

    def loop_step(self, state: torch.Tensor, t: int, ctx: LoopContext, *,
                  clamp_rms: torch.Tensor | None = None) -> torch.Tensor:
        """One loop step of the rule (0-based t), then the between-loop scale control (SPEC §4):
        ``inter_loop_norm`` (h ← RMSNorm(h), learned gain) or ``spectral_damping`` (h ← σ(ρ)·h), applied
        to the hidden state h = hidden(state). ``clamp_rms`` (B, L, 1), when given, rescales each
        token's h to that RMS (the evaluation-time ``scale_clamp``). (B, L, d) → (B, L, d)."""
        state = self.rule.step(self.core, state, t, ctx)
        if self.loop_norm is None and self.damping_raw is None and clamp_rms is None:
            return state
        h = self.rule.hidden(state, ctx)
        if self.loop_norm is not None:
            h = self.loop_norm(h)
        if self.damping_raw is not None:
            h = torch.sigmoid(self.damping_raw) * h
        if clamp_rms is not None:
            h = h * (clamp_rms / token_rms(h).clamp(min=1e-12))
        return self.rule.to_state(h, ctx)

    def unroll(self, idx: torch.Tensor, max_depth: int, *, tbptt: int = 0, scale_clamp: bool = False,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               scope: AttentionScope | None = None
               ) -> Iterator[tuple[int, torch.Tensor, LoopContext | None]]:
        """Yield ``(T, h_T, ctx)`` for T = 0 … max_depth: the hidden state after T loop steps, in
        readout coordinates. For the unshared architecture h_T is the output of block
        min(T, n_layers) and ctx is None.

        Args:
            tbptt: truncated BPTT (SPEC §5): with b ≥ 1, the first max_depth − b steps run without
                autograd and the state is detached before the last b steps (so activation memory
                scales with b). Gradients still reach e and the prelude through the context
                (anchor, injection) at every back-propagated step; a rule without injection
                (``plain``) trains its prelude only through the untruncated steps, and parameters
                used only in the initial state (e.g. an anchor projection) get a zero gradient
                rather than none (the detached state carries ``0·Σ state_0``, so DDP needs no
                ``find_unused_parameters``). 0 = full BPTT.
            scale_clamp: rescale each token's state after every loop to its loop-1 RMS (SPEC §4).
            positions, valid: (B, L) position ids and real-token mask (left padding / cached decoding).
            scope: the attention scope of a cached forward (for per-sequence running statistics).
        """
        e = self.embed(idx, positions)
        if not self.shared:
            h = e
            yield 0, h, None
            for T in range(1, max_depth + 1):
                if T <= len(self.layers):
                    h = h + self.layers[T - 1](h)
                yield T, h, None
            return
        state, ctx = self.start(e, positions)
        if valid is not None or scope is not None:
            ctx = dataclasses.replace(ctx, valid=None if valid is None else valid[..., None].to(e.dtype), scope=scope)
        yield 0, self.rule.hidden(state, ctx), ctx
        no_grad_steps = max_depth - tbptt if tbptt and torch.is_grad_enabled() else 0
        state0 = state
        ref = None
        for t in range(max_depth):
            if no_grad_steps and t == no_grad_steps:
                # exact zero that keeps the initial state's parameters in the graph (DDP)
                state = state.detach() + 0.0 * state0.sum()
            with torch.set_grad_enabled(torch.is_grad_enabled() and t >= no_grad_steps):
                state = self.loop_step(state, t, ctx, clamp_rms=ref)
            h = self.rule.hidden(state, ctx)
            if scale_clamp and ref is None:
                ref = token_rms(h).detach()
            yield t + 1, h, ctx

    def forward(self, idx: torch.Tensor, depth: int | Sequence[int] = 8, *, targets: torch.Tensor | None = None,
                return_states: bool = False, keep_logits: bool = True, tbptt: int = 0, scale_clamp: bool = False,
                cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
                final_depth: int | None = None) -> LoopOutput:
        """Run the model at one or several loop depths in a single unroll.

        Args:
            idx: (B, L) int64 token ids, L ≤ seq_len.
            depth: loop depth T ≥ 0, or a sequence of depths (read out on the way to the largest).
            targets: optional (B, L) int64 next-token ids; -100 marks positions to ignore.
            return_states: also return every hidden state h_0 … h_T.
            keep_logits: keep the (B, L, V) logits (set False in evaluation to save memory).
            tbptt: truncated BPTT window b (0 = full BPTT), see :meth:`unroll`.
            scale_clamp: the evaluation-time scale clamp (SPEC §4).
            cache: a :class:`KVCache`; ``idx`` is then the next chunk after the cached tokens, its
                positions continue the cache's, and the chunk is appended to the cache (SPEC §6). With
                several depths only the last readout's coda enters the cache; the coda of an
                intermediate readout attends to the prefix's last-depth coda K/V.
            attention_mask: (B, L) 1 for real tokens, 0 for left padding; padded keys are masked and
                position ids count real tokens only.
            final_depth: for ``readout="final_only_norm"`` (SPEC §4), a readout at depth T applies
                the final RMSNorm iff T ≥ final_depth, so each depth's logits do not depend on which
                other depths are requested. None: ``self.final_depth`` (set from the checkpoint's
                ``train.eval_depth`` when loaded), else the largest requested depth (training).

        Raises:
            ValueError: a depth is negative, no depth is given, or a cache is given with depth 0.
        """
        depths = sorted({int(depth)} if isinstance(depth, int) else {int(t) for t in depth})
        if not depths or depths[0] < 0:
            raise ValueError(f"depth: need one or more loop depths >= 0, got {depth!r}")
        if cache is None and attention_mask is None:
            return self._forward(idx, depths, targets, return_states, keep_logits, tbptt, scale_clamp,
                                 final_depth=final_depth)
        if not self.shared and cache is not None:
            raise ValueError("cache: KV caches need the shared architecture")
        if cache is not None and depths[-1] < 1:
            raise ValueError(f"depth: a cached forward needs a loop depth >= 1, got {depth!r}")
        valid = (attention_mask.bool() if attention_mask is not None
                 else torch.ones(idx.shape, dtype=torch.bool, device=idx.device))  # (B, L)
        if cache is not None:
            cache.calls_per_step = self.rule.core_calls_per_step
        start = cache.n_valid[:, None] if cache is not None and cache.n_valid is not None else 0
        positions = (start + valid.long().cumsum(1) - 1).clamp(min=0)  # (B, L)
        with AttentionScope(cache, valid if attention_mask is not None else None) as scope:
            return self._forward(idx, depths, targets, return_states, keep_logits, tbptt, scale_clamp,
                                 final_depth=final_depth, positions=positions, valid=valid if attention_mask is not None else None,
                                 scope=scope)

    def _forward(self, idx, depths, targets, return_states, keep_logits, tbptt, scale_clamp, *,
                 final_depth=None, **unroll_kw) -> LoopOutput:
        out = LoopOutput(states=[] if return_states else None)
        wanted = set(depths)
        last = depths[-1]
        final_from = self.resolve_final_depth(final_depth, last)
        for T, h, ctx in self.unroll(idx, last, tbptt=tbptt, scale_clamp=scale_clamp, **unroll_kw):
            if return_states:
                out.states.append(h)
            if ctx is not None:
                out.anchor = ctx.anchor
            if T not in wanted:
                continue
            if self.exit_gate is not None and T >= 1:
                out.exit_logits_by_depth[T] = self.exit_gate(h).squeeze(-1)  # (B, L)
            scope = unroll_kw.get("scope")
            if scope is not None and T != last and self.shared and self.coda:
                with scope.peek():  # only the last readout's coda enters the KV cache
                    logits = self.readout(h, final=T >= final_from)
            else:
                logits = self.readout(h, final=T >= final_from)  # (B, L, V)
            if keep_logits:
                out.logits_by_depth[T] = logits
            if targets is not None:
                nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                      reduction="none").view(targets.shape).clone()  # (B, L); returned
                # tensors must not be views: FSDP2 hooks the root module's outputs for backward
                out.nll_by_depth[T] = nll
        out.logits = out.logits_by_depth.get(last)
        if targets is not None:
            valid = (targets != -100).sum().clamp(min=1)
            out.loss = out.nll_by_depth[last].sum() / valid
        return out
