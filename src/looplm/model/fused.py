"""Fused, chunked readout + cross-entropy (issue 15): per-token NLL of ``h @ Wᵀ`` without the
(N, V) logits.

:func:`linear_cross_entropy` computes ``F.cross_entropy(F.linear(h, W).float(), targets,
ignore_index=-100, reduction="none")`` over chunks of ``chunk`` tokens: each chunk's logits are formed,
reduced to the NLL and dropped, so the largest logits tensor alive is (chunk, V) instead of (N, V)
(at V = 50,257, one 16 × 128 batch has 411 MB of fp32 logits; a 166-token chunk 33 MB).

**Gradient.** A ``torch.autograd.Function`` saves only h, W and the targets and recomputes each
chunk's logits in backward, where ``∂NLL/∂logits = softmax − onehot`` is formed directly (one softmax
pass, no log-softmax graph) and multiplied into ``∂h`` and ``∂W`` chunk by chunk. This beats
``torch.utils.checkpoint`` per chunk, which would re-run the chunk's whole forward (log-softmax and
gather included) and then back-propagate it through autograd's generic log-softmax backward, and
would keep one autograd graph per chunk.

**Cost.** The recomputation is one more (N × d) × (d × V) matmul than the plain path's three
(forward, ∂h, ∂W), so with gradients the fused loss does 4/3 of the readout's matmul FLOPs; what it
buys is memory (no (N, V) fp32 logits, log-probabilities or their gradient alive) and cache-resident
chunks. Without gradients (evaluation) it does the same FLOPs as the plain path.

**Exactness.** The forward calls the same kernel as the plain path on the same rows
(``F.cross_entropy`` on each chunk's fp32 logits). On CPU a row block of a matmul gives bitwise the
rows of the full matmul (checked by ``tests/test_perf.py``), so the per-token NLL, the losses and every
evaluation PPL are bit-identical to the plain path. Gradients agree to rounding (≤ 1e-5 relative in
the tests) but not bitwise: ``∂W`` is summed chunk by chunk, a different floating-point order than one
(N × V)ᵀ(N × d) matmul, so a training run's losses after its first step can differ from the plain
path's in the last bits.

**Mixed precision.** Under autocast the caller passes h and W already cast to the autocast dtype
(as ``nn.Linear`` would be); logits are formed in that dtype and the softmax is taken in fp32, as in
the plain path. ``∂W`` is accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: elements of one chunk's logits (chunk tokens × V); 2²³ fp32 elements = 32 MiB (166 tokens at V = 50,257)
CHUNK_ELEMENTS = 1 << 23


def chunk_rows(vocab: int, n: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``: ⌊CHUNK_ELEMENTS / V⌋ (at least 16, at most n)."""
    return max(1, min(n, max(16, CHUNK_ELEMENTS // max(1, vocab))))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                shape: torch.Size) -> torch.Tensor:
        n = h.shape[0]
        out = torch.empty(shape, dtype=torch.float32, device=h.device)  # not a view: FSDP2 hooks outputs
        nll = out.view(-1)
        for i in range(0, n, chunk):
            logits = F.linear(h[i:i + chunk], weight).float()  # (c, V)
            nll[i:i + chunk] = F.cross_entropy(logits, targets[i:i + chunk], ignore_index=-100, reduction="none")
        ctx.save_for_backward(h, weight, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor):
        h, weight, targets = ctx.saved_tensors
        chunk, n = ctx.chunk, h.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_nll = grad_nll.reshape(-1).float()
        for i in range(0, n, chunk):
            hc, tc = h[i:i + chunk], targets[i:i + chunk]
            g = torch.softmax(F.linear(hc, weight).float(), dim=-1)  # (c, V)
            keep = tc != -100
            rows = torch.arange(len(tc), device=h.device)
            g[rows[keep], tc[keep]] -= 1.0
            g.mul_((grad_nll[i:i + chunk] * keep)[:, None])  # ignored tokens: no gradient
            g = g.to(h.dtype)
            if need_h:
                torch.mm(g, weight, out=grad_h[i:i + chunk])
            if need_w:
                if g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hc)
                else:
                    grad_w += (g.t() @ hc).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Per-token NLL (fp32) of the readout ``h @ weightᵀ``, chunked (module docstring).

    Args:
        h: (..., d) readout features (after the final norm).
        weight: (V, d) readout matrix.
        targets: (...) int64 target ids, -100 = ignored (NLL 0, no gradient).
        chunk: tokens per chunk (default :func:`chunk_rows`).
    Returns:
        (...) float32, equal to ``F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100,
        reduction="none")``.
    """
    shape = targets.shape
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        h, weight = h.to(dt), weight.to(dt)
    h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    c = chunk if chunk is not None else chunk_rows(weight.shape[0], max(1, h2.shape[0]))
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(h2.contiguous(), weight, t2, c, shape)
