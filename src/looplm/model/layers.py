"""Transformer layers shared by every looplm architecture (SPEC §1).
Sources: SCSE arXiv:2607.27656 §2 (G(0) = 0); DeepLoop arXiv:2607.13491 eq. 2–8 (Post-LN family).

Projections are bias-free and RMSNorm(0) = 0, so ``Block(0) == 0`` exactly (SCSE relies on it, SPEC §2).
Modules return residual *updates* (``Block(x) = Block_full(x) − x``, ``Core(x)`` = G(x)), called through
``__call__`` so module hooks (FSDP2, torch.compile) work. Huginn-0125 / Ouro options (issue 14) are off by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · g`` over the last dim (no g when ``affine=False``): (..., d) → (..., d)."""

    def __init__(self, d: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()  # at least fp32 statistics
        y = F.rms_norm(xf, (x.shape[-1],), eps=self.eps).to(x.dtype)
        return y * self.weight if self.weight is not None else y


@dataclass(frozen=True)
class Rope:
    """Rotary embedding (arXiv:2104.09864): pair i rotated by p·ω_i, ω_i = θ^(−2i/head_dim) / factor (linear
    interpolation), in float32; pairs ``half`` (i, i + hd/2; HF Llama, Ouro) or ``interleaved`` (2i, 2i+1;
    Huginn-0125). ``table_dtype`` bfloat16 rounds cos, sin first (Huginn-0125's stored ``freqs_cis``)."""

    head_dim: int
    theta: float
    layout: str = "half"
    factor: float = 1.0
    table_dtype: str = "float32"

    def inv_freq(self, device) -> torch.Tensor:
        """ω (head_dim/2,) float32."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                    / self.head_dim))
        return inv / self.factor if self.factor != 1.0 else inv

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles p·ω_i: positions (B, L) int64 → 2 × (B, 1, L, head_dim/2) float32."""
        angles = positions.float()[:, None, :, None] * self.inv_freq(positions.device)  # (B, 1, L, hd/2)
        if self.table_dtype == "bfloat16":
            return angles.cos().bfloat16().float(), angles.sin().bfloat16().float()
        return angles.cos(), angles.sin()

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, H, L, head_dim) rotated pair by pair: (a, b) → (a·cos − b·sin, b·cos + a·sin)."""
        xf = x.float()
        if self.layout == "half":
            a, b = xf.chunk(2, dim=-1)  # (B, H, L, hd/2) each
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            pairs = xf.unflatten(-1, (-1, 2))  # (B, H, L, hd/2, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return out.to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with grouped-query heads: q (B, H, Lq, hd), k and v (B, H_kv, Lk, hd)
    with H_kv dividing H; key/value head j serves query heads j·g … j·g + g − 1 (g = H / H_kv, HF's
    ``repeat_kv``). Returns (B, H, Lq, hd)."""
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, Lk, hd)
    return F.scaled_dot_product_attention(q, k, v, **kw)


class CausalSelfAttention(nn.Module):
    """Causal self-attention (SDPA), bias-free: (B, L, d) → (B, L, d). ``n_kv_heads`` < ``n_heads``: grouped-query
    (fused ``qkv`` rows q, k, v); ``qk_bias`` on q and k; ``rope`` rotates q, k (the cache stores rotated keys);
    ``qkv_inject`` (B, L, qkv rows) is added to the projections (``deq_qkv``); ``kv`` (a
    :class:`~looplm.model.kvcache.KVVisit`, passed as HF passes ``layer_idx``) routes through the cache and
    padding mask and gives the positions. ``layer_id`` (set by the model) names the physical layer.
    """

    def __init__(self, d: int, n_heads: int, dropout: float, *, n_kv_heads: int | None = None,
                 qk_bias: bool = False, rope: Rope | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        hd = d // n_heads
        self.splits = (n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd)  # q, k, v rows
        self.qkv = nn.Linear(d, sum(self.splits), bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(self.splits[0] + self.splits[1])) if qk_bias else None
        self.proj = nn.Linear(d, d, bias=False)
        self.dropout = dropout
        self.rope = rope
        self.layer_id = -1

    def forward(self, x: torch.Tensor, qkv_inject: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        B, L, d = x.shape
        qkv = self.qkv(x)  # (B, L, qkv rows)
        if qkv_inject is not None:
            qkv = qkv + qkv_inject
        q, k, v = qkv.split(self.splits, dim=-1)  # (B, L, H·hd), 2 × (B, L, H_kv·hd)
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[:self.splits[0]], k + self.qk_bias[self.splits[0]:]
        hd = d // self.n_heads
        q = q.view(B, L, self.n_heads, hd).transpose(1, 2)  # (B, H, L, hd)
        k, v = (t.view(B, L, self.n_kv_heads, hd).transpose(1, 2) for t in (k, v))  # (B, H_kv, L, hd)
        if self.rope is not None:
            pos = kv.positions(L, x.device) if kv is not None else torch.arange(L, device=x.device)[None]
            cos, sin = self.rope.cos_sin(pos)  # (B or 1, 1, L, hd/2)
            q, k = self.rope.rotate(q, cos, sin), self.rope.rotate(k, cos, sin)
        if kv is not None:
            y = kv.attend(self.layer_id, q, k, v, dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, hd)
        else:
            y = attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, hd)
        return self.proj(y.transpose(1, 2).reshape(B, L, d))  # (B, L, d)


class SwiGLU(nn.Module):
    """``W_down(silu(W_gate x) ⊙ W_up x)``, (B, L, d) → (B, L, d); ``gate_up.weight`` (2·d_ff, d) is [W_gate; W_up]."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # 2 × (B, L, d_ff)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Transformer block (SPEC §1, §3), returning its residual update (full block output − x).

    (B, L, d) → (B, L, d), N₁, N₂ = ``norm1``, ``norm2``, N₁', N₂' = ``post_attn_norm``, ``post_mlp_norm``:
    pre: ``x + Attn(N₁(x))``, then ``+ MLP(N₂(·))`` (the update is the branch sum, so ``block(0) == 0`` exactly);
    sandwich (Ouro): ``x₁ = x + N₁'(Attn(N₁(x)))``, ``x₂ = x₁ + N₂'(MLP(N₂(x₁)))``; pre_post (Huginn-0125):
    ``x₁ = N₁'(x + Attn(N₁(x)))``, ``x₂ = N₂'(x₁ + MLP(N₂(x₁)))``; post-LN (``post_ln_alpha=α``, SPEC §3, DeepNet
    eq. 1): ``x₁ = N₁(α·x + Attn(x))``, ``x₂ = N₂(α·x₁ + MLP(x₁))``. ``qkv_inject``, ``kv``, ``attn_kw``: attention's.
    """

    def __init__(self, d: int, n_heads: int, d_ff: int, dropout: float, eps: float,
                 post_ln_alpha: float | None = None, *, norm: str = "pre", **attn_kw):
        super().__init__()
        if norm not in ("pre", "sandwich", "pre_post") or (norm != "pre" and post_ln_alpha is not None):
            raise ValueError(f"model.block_norm: got {norm!r}; allowed: pre, sandwich, pre_post (the last two "
                             "with residual=pre_ln only)")
        self.norm1 = RMSNorm(d, eps)
        self.attn = CausalSelfAttention(d, n_heads, dropout, **attn_kw)
        self.norm2 = RMSNorm(d, eps)
        self.mlp = SwiGLU(d, d_ff)
        self.drop = nn.Dropout(dropout)
        self.post_ln_alpha = post_ln_alpha
        self.norm = norm
        if norm != "pre":
            self.post_attn_norm = RMSNorm(d, eps)
            self.post_mlp_norm = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, qkv_inject: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        if self.post_ln_alpha is not None:
            alpha = self.post_ln_alpha
            x1 = self.norm1(alpha * x + self.drop(self.attn(x, qkv_inject, kv)))  # (B, L, d)
            x2 = self.norm2(alpha * x1 + self.drop(self.mlp(x1)))  # (B, L, d)
            return x2 - x
        if self.norm == "pre_post":
            x1 = self.post_attn_norm(x + self.drop(self.attn(self.norm1(x), qkv_inject, kv)))  # (B, L, d)
            x2 = self.post_mlp_norm(x1 + self.drop(self.mlp(self.norm2(x1))))  # (B, L, d)
            return x2 - x
        if self.norm == "sandwich":
            a = self.drop(self.post_attn_norm(self.attn(self.norm1(x), qkv_inject, kv)))  # (B, L, d)
            m = self.drop(self.post_mlp_norm(self.mlp(self.norm2(x + a))))  # (B, L, d)
            return a + m
        a = self.drop(self.attn(self.norm1(x), qkv_inject, kv))  # (B, L, d)
        m = self.drop(self.mlp(self.norm2(x + a)))  # (B, L, d)
        return a + m


class Core(nn.Module):
    """The shared core: K blocks applied in order; ``core(x)`` returns the paper's update
    G(x) = Core_full(x) − x (SCSE eq. 1). Shapes: (B, L, d) → (B, L, d). Zero-preserving: G(0) = 0 exactly.
    ``block_kw`` (``norm``, ``n_kv_heads``, ``qk_bias``, ``rope``) goes to every :class:`Block`.
    """

    def __init__(self, n_blocks: int, d: int, n_heads: int, d_ff: int, dropout: float, eps: float,
                 post_ln_alpha: float | None = None, **block_kw):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n_heads, d_ff, dropout, eps, post_ln_alpha, **block_kw)
                                    for _ in range(n_blocks))

    def forward(self, x: torch.Tensor, qkv_inject: list[torch.Tensor] | None = None, kv=None) -> torch.Tensor:
        """G(x); ``qkv_inject`` optionally gives block j's Q/K/V injection (B, L, qkv rows) (``deq_qkv``);
        ``kv`` is the KV visit of this core application (every block of the core shares it: the
        blocks are distinct physical layers)."""
        inj = qkv_inject if qkv_inject is not None else [None] * len(self.blocks)
        delta = self.blocks[0](x, inj[0], kv)
        for block, q in zip(self.blocks[1:], inj[1:]):
            delta = delta + block(x + delta, q, kv)
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
