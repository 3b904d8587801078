"""Transformer layers shared by every looplm architecture (SPEC §1).

All projections are bias-free and RMSNorm maps 0 to 0, so a block's residual update is
zero-preserving: ``Block(0) == 0`` exactly. SCSE relies on this (SPEC §2).

Modules return residual *updates*: ``Block(x)`` is the block's branch sum ``Block_full(x) − x`` and
``Core(x)`` is G(x) = Core_full(x) − x, so callers write ``x + block(x)``. Calling blocks through
``__call__`` (never a side method) keeps module hooks working: FSDP2 unshards parameters and
``torch.compile`` compiles ``forward``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · g`` over the last dim; learned gain g (or none when ``affine=False``).

    Shapes: (..., d) → (..., d). RMSNorm(0) = 0 exactly.
    """

    def __init__(self, d: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()  # at least fp32 statistics
        y = F.rms_norm(xf, (x.shape[-1],), eps=self.eps).to(x.dtype)
        return y * self.weight if self.weight is not None else y


class CausalSelfAttention(nn.Module):
    """Bias-free multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    Shapes: (B, L, d) → (B, L, d).
    """

    def __init__(self, d: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 × (B, L, d)
        q, k, v = (t.view(B, L, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, L, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, hd)
        return self.proj(y.transpose(1, 2).reshape(B, L, d))  # (B, L, d)


class SwiGLU(nn.Module):
    """Bias-free SwiGLU MLP: ``W_down(silu(W_gate x) ⊙ W_up x)``. Shapes: (B, L, d) → (B, L, d)."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d, d_ff, bias=False)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-LN transformer block ``x + Attn(N(x))``, then ``+ MLP(N(·))`` (SPEC §1), returning its update.

    ``block(x)`` returns the residual branch (full block output − x) computed as the sum of the two
    branch outputs, so that ``block(0) == 0`` holds exactly in floating point. Shapes: (B, L, d) → (B, L, d).
    """

    def __init__(self, d: int, n_heads: int, d_ff: int, dropout: float, eps: float):
        super().__init__()
        self.norm1 = RMSNorm(d, eps)
        self.attn = CausalSelfAttention(d, n_heads, dropout)
        self.norm2 = RMSNorm(d, eps)
        self.mlp = SwiGLU(d, d_ff)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.drop(self.attn(self.norm1(x)))  # (B, L, d)
        m = self.drop(self.mlp(self.norm2(x + a)))  # (B, L, d)
        return a + m


class Core(nn.Module):
    """The shared core: K blocks applied in order; ``core(x)`` returns the paper's update
    G(x) = Core_full(x) − x (SCSE eq. 1). Shapes: (B, L, d) → (B, L, d). Zero-preserving: G(0) = 0 exactly.
    """

    def __init__(self, n_blocks: int, d: int, n_heads: int, d_ff: int, dropout: float, eps: float):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n_heads, d_ff, dropout, eps) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.blocks[0](x)
        for block in self.blocks[1:]:
            delta = delta + block(x + delta)
        return delta


def sinusoidal_step_embedding(t: int, d: int, device=None, dtype=None) -> torch.Tensor:
    """Transformer sinusoidal embedding γ_t of the loop step t (SCSE eq. 6). Shape: (d,)."""
    half = d // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = t * freqs
    emb = torch.cat([torch.sin(angles), torch.cos(angles)])
    if d % 2:
        emb = torch.cat([emb, emb.new_zeros(1)])
    return emb.to(dtype) if dtype is not None else emb
