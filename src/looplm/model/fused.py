"""Fused, chunked readout + cross-entropy (issue 15): per-token NLL of ``h @ Wᵀ`` without the (N, V) logits.

:func:`linear_cross_entropy` is ``F.cross_entropy(F.linear(h, W).float(), targets, ignore_index=-100,
reduction="none")`` over chunks of tokens, so the largest logits alive are (chunk, V), not (N, V) (at
V = 50,257 a 16 × 128 batch has 411 MB of fp32 logits; a 166-token chunk 33 MB).

**Gradient.** The forward forms ``G = softmax − onehot`` per chunk and saves ``G @ W`` (N × d) and ``Gᵀh``
(V × d fp32). With per-token upstream weights w, ``∂h = w ⊙ (G @ W)`` always, and ``∂W = w · Gᵀh`` when the
scored tokens' weights are equal (every mean-CE loss); otherwise (``exit_weighted``) ∂W recomputes each
chunk's logits. Training thus does three readout matmuls, as the plain path, not four.

**Exactness.** On CPU a row block of a matmul is bitwise the rows of the full matmul
(``tests/model/test_perf.py``), so NLL, losses and PPL are bit-identical to the plain path; gradients agree to
rounding (≤ 1e-5 relative), since ∂W is summed chunk by chunk. Under autocast the caller passes h and W
in the autocast dtype; the softmax is fp32 and ∂W accumulates in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: elements of one chunk's logits (chunk tokens × V); 2²³ fp32 elements = 32 MiB (166 tokens at V = 50,257)
CHUNK_ELEMENTS = 1 << 23


def _chunks(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, gh: torch.Tensor | None,
            gw: torch.Tensor | None, nll: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
    """Chunk by chunk of rows of h (N, d): the NLL into ``nll`` (N,), G = softmax − onehot (ignored rows 0; × the
    per-token ``scale`` (N,) fp32) as G @ W into ``gh`` (N, d) and accumulated Gᵀh into ``gw`` (V, d) fp32."""
    for i in range(0, h.shape[0], chunk):
        hc, tc = h[i:i + chunk], targets[i:i + chunk]
        logp = F.log_softmax(F.linear(hc, weight).float(), dim=-1)  # (c, V)
        if nll is not None:
            # = F.cross_entropy(..., ignore_index=-100, reduction="none"), bitwise (log-softmax, gather)
            nll[i:i + chunk] = torch.where(tc != -100, -logp.gather(1, tc.clamp(min=0)[:, None]).squeeze(1), 0.0)
        if gh is None and gw is None:
            continue
        g = logp.exp_()  # softmax − onehot, in place
        keep = tc != -100
        rows = torch.arange(len(tc), device=g.device)
        g[rows[keep], tc[keep]] -= 1.0
        g.mul_(keep[:, None])
        g = g.to(h.dtype) if scale is None else g.to(torch.float32).mul_(scale[i:i + chunk, None]).to(h.dtype)
        if gh is not None:
            torch.mm(g, weight, out=gh[i:i + chunk])
        if gw is not None:
            gw.addmm_(g.t(), hc) if g.dtype == torch.float32 else gw.add_((g.t() @ hc).float())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                shape: torch.Size, ahead_h: bool, ahead_w: bool) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=h.device)  # not a view: FSDP2 hooks outputs
        gh = torch.empty_like(h) if ahead_h else None  # (N, d): rows of (softmax − onehot) @ W
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if ahead_w else None  # (V, d)
        _chunks(h, weight, targets, chunk, gh, gw, out.view(-1))
        ctx.save_for_backward(h, weight, targets, gh, gw)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor):
        h, weight, targets, gh, gw = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_nll = grad_nll.reshape(-1).float()
        grad_h = grad_w = None
        if need_h and gh is not None:  # row-local: any per-token weights
            grad_h = (grad_nll[:, None] * gh.float()).to(h.dtype)
        if need_w and gw is not None:  # Σ_i w_i g_iᵀ h_i = w · Σ_i g_iᵀ h_i when the weights are uniform
            w = grad_nll[targets != -100]
            if w.numel() == 0 or bool((w == w[0]).all()):
                grad_w = gw * (w[0] if w.numel() else 0.0)
        redo_h, redo_w = need_h and grad_h is None, need_w and grad_w is None
        if redo_h or redo_w:  # recompute each chunk's logits
            grad_h = torch.empty_like(h) if redo_h else grad_h
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if redo_w else grad_w
            _chunks(h, weight, targets, ctx.chunk, grad_h if redo_h else None, grad_w if redo_w else None,
                    scale=grad_nll)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None, ahead: bool = True) -> torch.Tensor:
    """Per-token NLL (fp32) of the readout ``h @ weightᵀ``, chunked (module docstring).

    h (..., d), weight (V, d), targets (...) int64 (-100: NLL 0) → (...) float32, equal to
    ``F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100, reduction="none")``. ``ahead``: form
    the gradients in the forward (False: recompute the logits in backward).
    """
    shape = targets.shape
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        h, weight = h.to(dt), weight.to(dt)
    h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    n = max(1, h2.shape[0])  # tokens per chunk: ⌊CHUNK_ELEMENTS / V⌋, at least 16, at most n
    c = chunk if chunk is not None else max(1, min(n, max(16, CHUNK_ELEMENTS // max(1, weight.shape[0]))))
    with torch.autocast(dev, enabled=False):
        grad = torch.is_grad_enabled()
        return _LinearCrossEntropy.apply(h2.contiguous(), weight, t2, c, shape,
                                         grad and h2.requires_grad and ahead, grad and weight.requires_grad and ahead)
