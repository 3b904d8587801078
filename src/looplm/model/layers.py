"""Transformer layers shared by every looplm architecture (SPEC §1).
Sources: SCSE arXiv:2607.27656 §2 (G(0) = 0); DeepLoop arXiv:2607.13491 eq. 2–8 (Post-LN family).

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

    Shapes: (B, L, d) → (B, L, d). ``qkv_inject`` (B, L, 3d), when given, is added to the Q/K/V
    projections (the ``deq_qkv`` injection, SPEC §2). ``kv`` (a :class:`looplm.model.kvcache.KVVisit`:
    the attention scope of the forward and the virtual-layer visit index, passed down explicitly as
    HF passes ``layer_idx``), when given, routes attention through the KV cache and/or key-padding
    mask of that scope; without it attention is plain causal SDPA. ``layer_id`` (set by the model)
    names the physical layer.
    """

    def __init__(self, d: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.dropout = dropout
        self.layer_id = -1

    def forward(self, x: torch.Tensor, qkv_inject: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        B, L, d = x.shape
        qkv = self.qkv(x)  # (B, L, 3d)
        if qkv_inject is not None:
            qkv = qkv + qkv_inject
        q, k, v = qkv.split(d, dim=-1)  # 3 × (B, L, d)
        q, k, v = (t.view(B, L, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, L, hd)
        if kv is not None:
            y = kv.attend(self.layer_id, q, k, v, dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, hd)
        return self.proj(y.transpose(1, 2).reshape(B, L, d))  # (B, L, d)


class SwiGLU(nn.Module):
    """Bias-free SwiGLU MLP: ``W_down(silu(W_gate x) ⊙ W_up x)``. Shapes: (B, L, d) → (B, L, d).

    The gate and up projections are one fused matmul: ``gate_up.weight`` (2·d_ff, d) holds ``W_gate``
    in rows ``[0, d_ff)`` and ``W_up`` in rows ``[d_ff, 2·d_ff)``. State dicts of the earlier layout
    (``gate.weight`` and ``up.weight``, each (d_ff, d)) load: :meth:`_load_from_state_dict` stacks
    them into ``gate_up.weight`` (every other key is loaded, strictly or not, as before).
    """

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # 2 × (B, L, d_ff)
        return self.down(F.silu(gate) * up)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        gate, up = prefix + "gate.weight", prefix + "up.weight"
        if gate in state_dict and up in state_dict and prefix + "gate_up.weight" not in state_dict:
            state_dict[prefix + "gate_up.weight"] = torch.cat([state_dict.pop(gate), state_dict.pop(up)], 0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Block(nn.Module):
    """Transformer block (SPEC §1, §3), returning its residual update (full block output − x).

    Pre-LN (``post_ln_alpha=None``): ``x + Attn(N(x))``, then ``+ MLP(N(·))``; the update is the sum of
    the two branch outputs, so ``block(0) == 0`` holds exactly in floating point.
    Post-LN family (``post_ln_alpha=α``, SPEC §3 / DeepNet eq. 1 / DeepLoop): ``x₁ = N₁(α·x + Attn(x))``,
    ``x₂ = N₂(α·x₁ + MLP(x₁))``; the update is ``x₂ − x``. RMSNorm(0) = 0, so it is zero-preserving too.
    Shapes: (B, L, d) → (B, L, d); ``qkv_inject`` (B, L, 3d) or None and ``kv`` (the KV visit, or
    None) go to the attention.
    """

    def __init__(self, d: int, n_heads: int, d_ff: int, dropout: float, eps: float,
                 post_ln_alpha: float | None = None):
        super().__init__()
        self.norm1 = RMSNorm(d, eps)
        self.attn = CausalSelfAttention(d, n_heads, dropout)
        self.norm2 = RMSNorm(d, eps)
        self.mlp = SwiGLU(d, d_ff)
        self.drop = nn.Dropout(dropout)
        self.post_ln_alpha = post_ln_alpha

    def forward(self, x: torch.Tensor, qkv_inject: torch.Tensor | None = None, kv=None) -> torch.Tensor:
        if self.post_ln_alpha is not None:
            alpha = self.post_ln_alpha
            x1 = self.norm1(alpha * x + self.drop(self.attn(x, qkv_inject, kv)))  # (B, L, d)
            x2 = self.norm2(alpha * x1 + self.drop(self.mlp(x1)))  # (B, L, d)
            return x2 - x
        a = self.drop(self.attn(self.norm1(x), qkv_inject, kv))  # (B, L, d)
        m = self.drop(self.mlp(self.norm2(x + a)))  # (B, L, d)
        return a + m


class Core(nn.Module):
    """The shared core: K blocks applied in order; ``core(x)`` returns the paper's update
    G(x) = Core_full(x) − x (SCSE eq. 1). Shapes: (B, L, d) → (B, L, d). Zero-preserving: G(0) = 0 exactly.
    """

    def __init__(self, n_blocks: int, d: int, n_heads: int, d_ff: int, dropout: float, eps: float,
                 post_ln_alpha: float | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n_heads, d_ff, dropout, eps, post_ln_alpha) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor, qkv_inject: list[torch.Tensor] | None = None, kv=None) -> torch.Tensor:
        """G(x); ``qkv_inject`` optionally gives block j's Q/K/V injection (B, L, 3d) (``deq_qkv``);
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
