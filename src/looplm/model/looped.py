"""LoopLM: embed → prelude → loop (core × T under a recurrence rule) → coda → readout (SPEC §1).

The same class builds the unshared Transformer reference (``architecture="unshared"``): N distinct
blocks, no recurrence, where depth T runs the first ``min(T, N)`` blocks (its active depth saturates
at N, matching the FLOP proxy of SCSE eq. 20).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ModelConfig
from looplm.model.layers import Block, Core, RMSNorm
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
    """

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    logits_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    nll_by_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    states: list[torch.Tensor] | None = None
    anchor: torch.Tensor | None = None


def _block(cfg: ModelConfig) -> Block:
    return Block(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.norm_eps)


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
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.drop = nn.Dropout(cfg.dropout)
        self.shared = cfg.architecture == "shared"
        if self.shared:
            self.prelude = nn.ModuleList(_block(cfg) for _ in range(cfg.n_prelude))
            self.core = Core(cfg.n_core, d, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.norm_eps)
            self.rule = build_rule(cfg)
            self.coda = nn.ModuleList(_block(cfg) for _ in range(cfg.n_coda))
        else:
            self.layers = nn.ModuleList(_block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    # ------------------------------------------------------------------ init and accounting
    def n_physical_blocks(self) -> int:
        if self.shared:
            return self.cfg.n_prelude + self.cfg.n_core + self.cfg.n_coda
        return self.cfg.n_layers

    def reset_parameters(self) -> None:
        """GPT-2 initialization (our choice): N(0, init_std) for every matrix and embedding; the
        residual output projections (attention ``proj``, MLP ``down``) get init_std/√(2·blocks),
        blocks counted physically. Gains are 1; the adapter gain α keeps its configured value."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            if name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.n_physical_blocks()))
            else:
                nn.init.normal_(p, 0.0, std)
        if self.shared and getattr(self.rule, "anchor_proj", None) is not None:
            nn.init.normal_(self.rule.anchor_proj.weight, 0.0, std)  # frozen_random keeps this draw

    def num_params(self, trainable_only: bool = True) -> int:
        """Number of (unique) parameters; tied embeddings count once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    # ------------------------------------------------------------------ forward pieces
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + learned position embedding, then the prelude. (B, L) int64 → (B, L, d).

        Raises:
            ValueError: L exceeds ``seq_len``.
        """
        B, L = idx.shape
        if L > self.cfg.seq_len:
            raise ValueError(f"sequence length {L} exceeds model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(L, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, L, d)
        if self.shared:
            for block in self.prelude:
                x = x + block(x)
        return x

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Coda, then ``W_out · RMSNorm(h)``. (B, L, d) → (B, L, V) logits."""
        if self.shared:
            for block in self.coda:
                h = h + block(h)
        return self.lm_head(self.norm_f(h))

    def start(self, e: torch.Tensor) -> tuple[torch.Tensor, LoopContext]:
        """Initial loop state and per-sequence context (anchor, injection) of the recurrence rule."""
        return self.rule.start(e)

    def unroll(self, idx: torch.Tensor, max_depth: int) -> Iterator[tuple[int, torch.Tensor, LoopContext | None]]:
        """Yield ``(T, h_T, ctx)`` for T = 0 … max_depth: the hidden state after T loop steps, in
        readout coordinates. For the unshared architecture h_T is the output of block
        min(T, n_layers) and ctx is None."""
        e = self.embed(idx)
        if not self.shared:
            h = e
            yield 0, h, None
            for T in range(1, max_depth + 1):
                if T <= len(self.layers):
                    h = h + self.layers[T - 1](h)
                yield T, h, None
            return
        state, ctx = self.rule.start(e)
        yield 0, self.rule.hidden(state, ctx), ctx
        for t in range(max_depth):
            state = self.rule.step(self.core, state, t, ctx)
            yield t + 1, self.rule.hidden(state, ctx), ctx

    def forward(self, idx: torch.Tensor, depth: int | Sequence[int] = 8, *, targets: torch.Tensor | None = None,
                return_states: bool = False, keep_logits: bool = True) -> LoopOutput:
        """Run the model at one or several loop depths in a single unroll.

        Args:
            idx: (B, L) int64 token ids, L ≤ seq_len.
            depth: loop depth T ≥ 0, or a sequence of depths (read out on the way to the largest).
            targets: optional (B, L) int64 next-token ids; -100 marks positions to ignore.
            return_states: also return every hidden state h_0 … h_T.
            keep_logits: keep the (B, L, V) logits (set False in evaluation to save memory).

        Raises:
            ValueError: a depth is negative, or no depth is given.
        """
        depths = sorted({int(depth)} if isinstance(depth, int) else {int(t) for t in depth})
        if not depths or depths[0] < 0:
            raise ValueError(f"depth: need one or more loop depths >= 0, got {depth!r}")
        out = LoopOutput(states=[] if return_states else None)
        wanted = set(depths)
        for T, h, ctx in self.unroll(idx, depths[-1]):
            if return_states:
                out.states.append(h)
            if ctx is not None:
                out.anchor = ctx.anchor
            if T not in wanted:
                continue
            logits = self.readout(h)  # (B, L, V)
            if keep_logits:
                out.logits_by_depth[T] = logits
            if targets is not None:
                nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                      reduction="none").view(targets.shape).clone()  # (B, L); returned
                # tensors must not be views: FSDP2 hooks the root module's outputs for backward
                out.nll_by_depth[T] = nll
        last = depths[-1]
        out.logits = out.logits_by_depth.get(last)
        if targets is not None:
            valid = (targets != -100).sum().clamp(min=1)
            out.loss = out.nll_by_depth[last].sum() / valid
        return out
