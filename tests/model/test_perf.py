"""Issue 15 performance paths against their plain references: the fused gate+up projection (same
initial values as the separate matrices), the fused chunked readout +
cross-entropy (loss and gradients against ``F.cross_entropy`` on full logits for every readout mode,
tied and untied, with ignored targets, fp32 and bf16 autocast), the static KV cache, prefill that
reads out only the last position, compiled decoding and the FLOP proxy against ``FlopCounterMode``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ModelConfig
from looplm.model import build_model
from looplm.model import layers as layers_mod
from looplm.model.cursor import NLL, Readout


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_heads=4, d_ff=64, seq_len=24, dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


class _SeparateSwiGLU(nn.Module):
    """The layout before the fusion: separate gate and up matrices (drawn in this order)."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d, d_ff, bias=False)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _old_model(cfg: ModelConfig, seed: int, monkeypatch) -> nn.Module:
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "SwiGLU", _SeparateSwiGLU)
        torch.manual_seed(seed)
        return build_model(cfg)


@pytest.mark.parametrize("kw", [dict(), dict(residual="deeploop", residual_depth=3, n_core=2),
                                dict(n_prelude=1, n_core=2, n_coda=1, rule="looped"),
                                dict(architecture="unshared", n_layers=2)])
def test_fused_gate_up_initializes_as_the_separate_matrices(kw, monkeypatch):
    """A fresh model draws exactly the values of the pre-fusion layout (same seed, same RNG order), so
    committed experiments reproduce bit for bit; Post-LN β scales both halves."""
    cfg = tiny(**kw)
    old = _old_model(cfg, 3, monkeypatch)
    torch.manual_seed(3)
    new = build_model(cfg)
    old_sd, new_sd = old.state_dict(), new.state_dict()
    n_fused = 0
    for k, v in new_sd.items():
        if k.endswith("mlp.gate_up.weight"):
            p = k[: -len("gate_up.weight")]
            assert torch.equal(v, torch.cat([old_sd[p + "gate.weight"], old_sd[p + "up.weight"]]))  # exact: same draws
            n_fused += 1
        else:
            assert torch.equal(v, old_sd[k]), k  # exact: same draws
    assert n_fused > 0
    # the outputs agree too (the fused matmul computes the same rows)
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    torch.testing.assert_close(new(x, depth=2).logits, old(x, depth=2).logits, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- fused CE
def _plain_nll(model, x, y, depths):
    """Per-depth NLL through the plain readout (full logits, F.cross_entropy)."""
    out = model(x, depths)
    return {T: F.cross_entropy(lg.float().flatten(0, -2), y.flatten(), ignore_index=-100,
                               reduction="none").view(y.shape) for T, lg in out.logits_by_depth.items()}


@pytest.mark.parametrize("readout", ["rmsnorm", "raw", "final_only_norm"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_readout_cross_entropy_equals_plain(readout, tied, dtype, monkeypatch):
    """Loss (every depth) and gradients of the fused chunked readout + CE against the plain path.
    fp32: loss ≤ 1e-6 relative, gradients ≤ 1e-5; bf16 autocast: loss ≤ 1e-3 relative, gradients
    ≤ 2e-2 (bf16 logits and bf16 backward matmuls round differently in a different order)."""
    from looplm.model import fused

    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 97 * 7)  # 7-token chunks: several chunks and a ragged one
    cfg = tiny(readout=readout, tie_embeddings=tied, n_prelude=1, n_coda=1, rule="looped")
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, 20))
    y = torch.randint(0, cfg.vocab_size, (3, 20))
    y[0, :5] = -100
    y[2, -3:] = -100
    depths = [1, 3]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)
    rtol, gtol = (1e-6, 1e-5) if dtype == "float32" else (1e-3, 2e-2)

    def run(use_fused: bool):
        model.zero_grad(set_to_none=True)
        with ctx:
            out = model(x, depths, y, readout=Readout(logits=False, final_depth=3, fused_ce=use_fused))
        loss = out.loss + out.nll_by_depth[1].sum() / 7
        loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, g_plain = run(False)
    fused_out, g_fused = run(True)
    assert fused_out.logits is None and not fused_out.logits_by_depth
    for T in depths:
        assert fused_out.nll_by_depth[T].shape == y.shape
        assert (fused_out.nll_by_depth[T][y == -100] == 0).all()
        torch.testing.assert_close(fused_out.nll_by_depth[T], plain.nll_by_depth[T], rtol=rtol, atol=rtol)
    assert abs(fused_out.loss.item() - plain.loss.item()) <= rtol * abs(plain.loss.item())
    assert g_plain.keys() == g_fused.keys()
    for n in g_plain:
        scale = g_plain[n].abs().max().clamp(min=1e-12)
        assert ((g_fused[n] - g_plain[n]).abs().max() / scale).item() <= gtol, n


def test_fused_path_also_matches_reference_cross_entropy():
    """The plain path of forward is itself F.cross_entropy on full logits: the fused NLL equals it."""
    cfg = tiny(tie_embeddings=False)
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    y = x.roll(-1, 1)
    y[:, -1] = -100
    with torch.no_grad():
        ref = _plain_nll(model, x, y, [2, 4])
        out = model(x, [2, 4], y, readout=NLL)
    for T in (2, 4):  # tolerant (different shapes): the fused path reads out row chunks; NLL ~4.6, d = 32
        torch.testing.assert_close(out.nll_by_depth[T], ref[T], rtol=1e-6, atol=1e-5)


def test_linear_cross_entropy_saves_no_logits():
    """The autograd graph of the fused loss keeps h, W and the targets only (no (N, V) tensor)."""
    from looplm.model.fused import linear_cross_entropy

    N, d, V = 64, 8, 1000
    h = torch.randn(N, d, requires_grad=True)
    W = torch.randn(V, d, requires_grad=True)
    t = torch.randint(0, V, (N,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        nll = linear_cross_entropy(h, W, t, chunk=16)
    assert max(saved) <= V * d  # h, W, targets, G @ W (N, d) and Gᵀh (V, d): never (N, V)
    nll.sum().backward()
    ref_h, ref_W = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    F.cross_entropy(ref_h @ ref_W.T, t, reduction="sum").backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W.grad, ref_W.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ahead", [True, False])
def test_linear_cross_entropy_with_per_token_weights(ahead):
    """Non-uniform upstream weights (the exit_weighted loss) and ignored targets: ∂h from the saved
    rows, ∂W recomputed; ahead=False recomputes both. Against autograd through F.cross_entropy."""
    from looplm.model.fused import linear_cross_entropy

    torch.manual_seed(0)
    N, d, V = 50, 8, 300
    h = torch.randn(N, d, requires_grad=True)
    W = torch.randn(V, d, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::7] = -100
    w = torch.rand(N)
    (linear_cross_entropy(h, W, t, chunk=16, ahead=ahead) * w).sum().backward()
    ref_h, ref_W = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    (F.cross_entropy(ref_h @ ref_W.T, t, reduction="none") * w).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W.grad, ref_W.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- prefill
def test_prefill_last_position_readout_equals_full_logits():
    """A cached prefill that reads out only the last position gives the full readout's last row and
    the same cache; a prefix forward without targets (keep_logits=False) fills the same cache."""
    from looplm.model.kvcache import KVCache

    cfg = tiny(n_prelude=1, n_coda=1, rule="looped")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    caches = [KVCache("per_visit") for _ in range(3)]
    with torch.no_grad():
        full = model.read(model.loop(x, cache=caches[0], attention_mask=mask), 3).logits[:, -1]
        last = model.read(model.loop(x, cache=caches[1], attention_mask=mask), 3,
                          readout=Readout(tokens=(torch.arange(2), torch.full((2,), 8)))).logits
        none = model.read(model.loop(x, cache=caches[2], attention_mask=mask), 3, readout=NLL)
    # tolerant (different shapes): the readout multiplies 2 rows instead of 18, and MKL's kernels for
    # the two shapes sum the d = 32 dot products in different orders; |logits| < 0.5, measured max
    # difference 9e-8 (1 ulp), so 1e-5 leaves a 100x margin
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)
    assert none.logits is None
    for c in caches[1:]:  # exact (same computation): the loop below the readout runs the same shapes
        assert c.banks.keys() == caches[0].banks.keys()
        for key, (k, v) in c.banks.items():
            assert torch.equal(k, caches[0].banks[key][0]) and torch.equal(v, caches[0].banks[key][1])


# ---------------------------------------------------------------------------------------------- static cache
@pytest.mark.parametrize("mode", ["per_visit", "terminal"])
def test_static_cache_decodes_without_concatenation_and_grows(mode, monkeypatch):
    """Decoding writes the preallocated banks in place: no torch.cat over K/V per token; a cache with
    a small max_len grows and gives the same logits; nbytes counts the cached tokens only."""
    from looplm.model.kvcache import KVCache

    cfg = tiny(n_prelude=1, n_coda=1, rule="scse")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        ref = model(x, depth=3).logits
        outs = {}
        for max_len in (None, 5):
            cache = KVCache(mode, max_len=max_len)
            model.read(model.loop(x[:, :8], cache=cache), 3)
            calls = []
            real_cat = torch.cat
            monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: calls.append(len(ts)) or real_cat(ts, *a, **k))
            outs[max_len] = real_cat([model.read(model.loop(x[:, j:j + 1], cache=cache), 3).logits
                                      for j in range(8, 16)], 1)
            monkeypatch.setattr(torch, "cat", real_cat)
            assert not calls  # no concatenation in the decode steps
            assert cache.length == 16 and cache.capacity >= 16
            per_bank = 2 * 2 * cfg.n_heads * 16 * (cfg.d_model // cfg.n_heads) * 4  # K and V, B=2, fp32
            assert cache.nbytes() == cache.n_banks() * per_bank
            assert cache.capacity_nbytes() >= cache.nbytes()
    # tolerant (different memory layout): attention reads K/V as views of buffers whose capacity, and
    # so row stride, differs; logits O(1) through d = 32 sums, float32 rounding ~1e-7
    torch.testing.assert_close(outs[5], outs[None], rtol=1e-5, atol=1e-5)
    if mode == "per_visit":  # tolerant (different shapes) against the full forward
        torch.testing.assert_close(outs[None], ref[:, 8:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("kw", [dict(rule="looped"), dict(rule="scse"),
                                dict(rule="huginn_linear", n_prelude=1, n_core=2, n_coda=1),
                                dict(architecture="unshared", n_layers=3)])
def test_flop_proxy_equals_flop_counter(kw):
    """The FLOP proxy (SCSE eq. 20–21) equals torch's FlopCounterMode on a full-length forward: matmuls
    (q/k/v/proj 8d², gate_up/down 6·d·d_ff, readout 2·d·V) and attention 4·L·d (counted as full, not
    causal, by both; SDPA runs its math backend, whose bmm the counter sees — the CPU flash kernel
    has no FLOP formula); multi-depth adds one coda + readout per extra depth. The rule's own small
    matmuls (SCSE's anchor/initial projections, Huginn's 2d → d adapter) are outside the proxy: they
    are counted apart (module ``LoopLM.rule``) and are all the difference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from looplm.analysis.flops import flops_per_token, multidepth_flops_per_token

    cfg = tiny(**kw)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    B, L = 2, cfg.seq_len
    x = torch.randint(0, cfg.vocab_size, (B, L))
    for depths in ([3], [1, 2, 4]):
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            model(x, depths)
        want = (flops_per_token(cfg, depths[0])["body_head"] if len(depths) == 1
                else multidepth_flops_per_token(cfg, depths))
        counts = fc.get_flop_counts()
        pre = f"{type(model).__name__}.rule"
        leaves = [k for k in counts if (k == pre or k.startswith(pre + ".")) and not any(
            o.startswith(k + ".") for o in counts)]
        rule = sum(sum(counts[k].values()) for k in leaves)  # the rule's own modules (no nesting counted twice)
        assert fc.get_total_flops() - rule == B * L * want, (depths, counts)
        if kw.get("rule") == "huginn_linear":  # the adapter: 2·(2d)·d per token per step
            assert rule == B * L * depths[-1] * 2 * 2 * cfg.d_model * cfg.d_model


def _inductor_available() -> bool:
    try:
        import torch._inductor  # noqa: F401
        return hasattr(torch, "compile")
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_available(), reason="torch.compile (inductor) unavailable")
@pytest.mark.parametrize("mode", ["per_visit"])
def test_compiled_decode_equals_eager_token_for_token(mode):
    """Blocks compiled with inductor (``compile_blocks``; the cache bookkeeping in ``KVVisit.attend``
    stays eager through a graph break) decode the same greedy tokens as the eager model, and the
    cached decode steps do not recompile as the cache grows."""
    import copy

    from looplm.eval.generate import generate
    from looplm.train.trainer import compile_blocks

    cfg = tiny(rule="looped", n_core=1, d_model=16, n_heads=2, d_ff=32, seq_len=32)
    torch.manual_seed(0)
    eager = build_model(cfg).eval()
    compiled = compile_blocks(copy.deepcopy(eager))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    torch._dynamo.reset()
    want = generate(eager, prompts, 8, depth=3, cache_mode=mode)
    got = generate(compiled, prompts, 8, depth=3, cache_mode=mode)  # compiles prefill and decode shapes
    assert got.tokens == want.tokens
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = generate(compiled, [[3, 1, 4, 1, 5], [9, 2, 6]], 10, depth=3, cache_mode=mode)
    assert again.tokens == generate(eager, [[3, 1, 4, 1, 5], [9, 2, 6]], 10, depth=3, cache_mode=mode).tokens


def test_on_depth_hook_keeps_the_fused_readout(monkeypatch):
    """``on_depth`` (validation's state RMS) sees every h_T, with None logits under the fused readout +
    loss; with ``fused_ce=False`` the plain path computes the logits and hands the requested ones over."""
    from looplm.model import looped

    calls = []
    real = looped.linear_cross_entropy
    monkeypatch.setattr(looped, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny(tie_embeddings=False)
    torch.manual_seed(2)
    model = build_model(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    y = x.roll(-1, 1)
    seen = {True: [], False: []}
    with torch.no_grad():
        ref = model(x, [1, 3], y, readout=Readout(logits=False, states=True))
        for hooked in (False, True):
            calls.clear()
            out = model.read(model.loop(x), [1, 3], y, readout=Readout(logits=False, fused_ce=not hooked),
                             on_depth=lambda T, h, lg, s=seen[hooked]: s.append((T, h, lg)))
            assert len(calls) == (0 if hooked else 2)
            for T in (1, 3):
                torch.testing.assert_close(out.nll_by_depth[T], ref.nll_by_depth[T], rtol=1e-6, atol=1e-6)
    assert [T for T, _, _ in seen[False]] == [0, 1, 2, 3]
    for T, h, lg in seen[False]:
        assert lg is None and torch.equal(h, ref.states[T])  # exact: same computation
    assert [lg is None for _, _, lg in seen[True]] == [True, False, True, False]
