"""The GPU path (issue 28 §4), marked ``cuda`` and skipped without a GPU; ``scripts/gpu-check`` runs them
on one. Each check compares the GPU against a second code path: every variant's forward and backward
against the same model on CPU (fp32) and against fp32 on the GPU (bf16 autocast); cached decoding
(eager, static compiled, CUDA graph) against recomputation; the fused readout + loss against the plain
one; ``torch.compile``d training against eager; DDP and FSDP2 under ``torchrun --nproc_per_node=1``
against the unwrapped model; a resumed run against an uninterrupted one.

``LOOPLM_TEST_DEVICE=cpu`` runs the same checks on CPU (how they were checked on a machine without a
GPU; the CPU reference then runs the same computation twice)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from looplm.config import Config, ModelConfig, OptimConfig, TrainConfig, UniformDepthConfig
from looplm.model import build_model
from looplm.model.fused import linear_cross_entropy
from looplm.model.kvcache import KVCache
from looplm.model.static_decode import DecodeStep, StaticKVCache
from looplm.model.cursor import NLL

DEVICE = os.environ.get("LOOPLM_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (scripts/gpu-check runs these on one; LOOPLM_TEST_DEVICE=cpu runs them on CPU)")]


def _variants() -> dict[str, dict]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/, also when run as torchrun's script
    from helpers import VARIANTS

    return VARIANTS


VARIANTS = _variants()
V, L = 97, 12
SHARED = ["scse", "looped-prelude-coda", "huginn-0125", "ouro", "sc_subtract", "deq_qkv-huginn", "looped-rope-mqa"]


def _model(name: str, device, seq_len: int = L) -> torch.nn.Module:
    from helpers import tiny

    torch.manual_seed(0)
    return build_model(tiny(**VARIANTS[name], seq_len=seq_len, init_std=0.1)).to(device).eval()


def _tokens(b: int = 3, n: int = L, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, x: torch.Tensor, dtype: torch.dtype | None = None):
    """Loss (fused readout + loss at depth 3) and every parameter's gradient (fp32, on CPU)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        out = model(x, 3, x, readout=NLL)
    out.loss.backward()
    return out.loss.float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_forward_backward_fp32_and_bf16(name):
    """fp32 on the device equals fp32 on CPU to rounding; bf16 autocast stays near fp32."""
    x = _tokens()
    ref_loss, ref_grads = _loss_and_grads(_model(name, "cpu"), x)
    model = _model(name, DEVICE)
    loss, grads = _loss_and_grads(model, x.to(DEVICE))
    assert grads.keys() == ref_grads.keys()
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    print(f"{name}: fp32 |Δloss| {abs(loss - ref_loss).item():.2e}, worst relative gradient error {worst:.2e}")
    # fp32 matmuls and reductions in another order (GPU kernels, TF32 off by default): ~1e-6 relative
    # per operation, through ≤ 10 blocks and their backward
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert worst < 1e-3, name
    loss16, grads16 = _loss_and_grads(model, x.to(DEVICE), torch.bfloat16)
    cos = F.cosine_similarity(torch.cat([g.flatten() for g in grads16.values()]),
                              torch.cat([g.flatten() for g in grads.values()]), dim=0)
    print(f"{name}: bf16 |Δloss| {abs(loss16 - loss).item():.2e}, gradient cosine {cos.item():.5f}")
    assert torch.isfinite(loss16) and all(torch.isfinite(g).all() for g in grads16.values())
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 0.2% per product); the loss, a mean over
    # 36 tokens of log-softmaxes near ln V ≈ 4.6, moves by far less than 1%
    assert abs(loss16 - loss).item() < 0.01 * loss.item()
    assert cos > 0.99


@torch.no_grad()
@pytest.mark.parametrize("name", SHARED)
def test_cached_decoding_equals_recomputation(name):
    """Prefill 4 tokens, then one token per step: eager KVCache, the static step (eager, compiled and,
    on CUDA, graph-captured eager and compiled) — each position's logits equal the full forward's."""
    model = _model(name, DEVICE, seq_len=16)
    x = _tokens(b=2, n=16).to(DEVICE)
    full = model(x, depth=3).logits  # (B, 16, V)
    cache = KVCache("per_visit")
    model.read(model.loop(x[:, :4], cache=cache), 3)
    eager = torch.stack([model.read(model.loop(x[:, j:j + 1], cache=cache), 3).logits[:, -1] for j in range(4, 16)], 1)
    hows = ["eager", "compile"] + (["cuda_graph", "compile_cuda_graph"] if x.device.type == "cuda" else [])
    static = {}
    for how in hows:
        cache = KVCache("per_visit")
        model.read(model.loop(x[:, :4], cache=cache), 3)
        # aot_eager traces the one graph (fullgraph); inductor's code generation only once (compile time)
        step = DecodeStep(model, StaticKVCache(cache, 16, 16), 3, how,
                          backend="inductor" if x.device.type == "cuda" and name == "scse" else "aot_eager")
        static[how] = torch.stack([step(x[:, j]).clone() for j in range(4, 16)], 1)
    for path, logits in {"kvcache": eager, **static}.items():
        err = (logits - full[:, 4:]).abs().max().item()
        print(f"{name} {path}: max |Δlogits| {err:.2e}")
        # attention over a prefix (another kernel and length than the full forward's): fp32 rounding
        assert err < 1e-4, (name, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_equals_plain(dtype):
    """Chunked (5 chunks) readout + cross-entropy with ignored tokens against F.cross_entropy of the
    full logits: per-token NLL and the gradients of h and W."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (0.1 * torch.randn(1000, 64, generator=g)).to(DEVICE, dtype).requires_grad_()
    t = torch.randint(0, 1000, (300,), generator=g).to(DEVICE)
    t[::7] = -100
    nll = linear_cross_entropy(h, w, t, chunk=64)
    gh, gw = torch.autograd.grad(nll.sum() / (t != -100).sum(), (h, w))
    ref = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="none")
    rh, rw = torch.autograd.grad(ref.sum() / (t != -100).sum(), (h, w))
    print(dtype, (nll - ref).abs().max().item(), _rel(gh.float(), rh.float()), _rel(gw.float(), rw.float()))
    # fp32: row blocks of a matmul round like the full one to ~1e-6; bf16: the logits are rounded to
    # bf16 in both paths, but ∂W is summed over chunks in fp32 rather than in one bf16 matmul (2^-8)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(nll, ref, rtol=tol, atol=tol)
    assert _rel(gh.float(), rh.float()) < tol and _rel(gw.float(), rw.float()) < tol


@pytest.mark.parametrize("name", ["scse", "huginn-0125"])
def test_compiled_training_equals_eager(name):
    """Every block under torch.compile (train.compile): loss and gradients of two AdamW steps."""
    from looplm.train.trainer import compile_blocks

    eager = _model(name, DEVICE).train()
    compiled = compile_blocks(copy.deepcopy(eager), backend="inductor" if DEVICE == "cuda" else "aot_eager")
    traces = []
    for model in (eager, compiled):
        torch.manual_seed(1)  # the same draws for both (Huginn's random initial state is drawn per forward)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trace = []
        for step in range(2):
            loss, grads = _loss_and_grads(model, _tokens(seed=step).to(DEVICE))
            opt.step()
            trace.append((loss, grads))
        traces.append(trace)
    for (la, ga), (lb, gb) in zip(*traces):
        worst = max(_rel(gb[n], ga[n]) for n in ga)
        print(f"{name}: |Δloss| {abs(la - lb).item():.2e}, worst relative gradient error {worst:.2e}")
        # inductor fuses the elementwise work and reorders fp32 reductions (RMSNorm, softmax): ~1e-6
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
        assert worst < 1e-3


def _train_config(steps: int = 4, distributed: str = "ddp") -> Config:
    return Config(name="cuda", model=ModelConfig(rule="scse", vocab_size=V, d_model=32, n_heads=2, d_ff=64, seq_len=16,
                                                 dropout=0.0),
                  depth=UniformDepthConfig(lo=1, hi=4), optim=OptimConfig(lr=3e-3, warmup_steps=1),
                  train=TrainConfig(steps=steps, batch_size=4, eval_every=2, eval_batches=1, eval_depth=3, ckpt_every=2,
                                    device=DEVICE, distributed=distributed))


def _synthetic_data():
    from looplm.train.trainer import TrainData

    rng = np.random.default_rng(0)
    return TrainData(train=rng.integers(0, V, 20_000).astype(np.uint16),
                     valid=rng.integers(0, V, 4_000).astype(np.uint16), tokenizer_json="{}", vocab_size=V)


def _trace(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_equals_uninterrupted(tmp_path):
    from looplm.train.trainer import train

    cfg, data = _train_config(), _synthetic_data()
    train(cfg, tmp_path / "whole", data=data, progress=False)
    train(cfg, tmp_path / "split", data=data, progress=False, stop_after=2)
    train(cfg, tmp_path / "split", data=data, progress=False, resume=True)
    whole, split = _trace(tmp_path / "whole"), _trace(tmp_path / "split")
    assert [r["step"] for r in whole] == [r["step"] for r in split] == [1, 2, 3, 4]
    for a, b in zip(whole, split):
        print(a["step"], a["loss"], b["loss"], a.get("val_loss"), b.get("val_loss"))
        assert a["depths"] == b["depths"]
        # the same kernels on the same data; CUDA's atomic adds (embedding backward) may reorder sums
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def _wrapped_training(mode: str, out: str) -> None:
    """torchrun's worker: 3 AdamW steps of the unwrapped model, then of the DDP- or FSDP2-wrapped one
    (wrapped as looplm.run.dist.wrap_model wraps it for several ranks; wrap_model leaves a single
    process unwrapped), losses to ``out``."""
    import torch.distributed as dist

    from looplm.model.layers import Block

    dev = torch.device(DEVICE, int(os.environ["LOCAL_RANK"])) if DEVICE == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    traces = {}
    for wrap in ("none", mode):
        torch.manual_seed(0)
        model = build_model(_train_config().model).to(dev).train()
        if wrap == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.index is not None
                                                              else None)
        elif wrap == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for module in model.modules():
                if isinstance(module, Block):
                    fully_shard(module)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        traces[wrap] = []
        for step in range(3):
            x = _tokens(b=4, n=16, seed=step).to(dev)
            loss = model(x, 3, x, readout=NLL).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            traces[wrap].append(float(loss))
    with open(out, "w") as f:
        json.dump(traces, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_under_torchrun_equal_the_unwrapped_model(tmp_path, mode):
    out = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", __file__, mode,
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LOOPLM_TEST_DEVICE": DEVICE, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = json.loads(out.read_text())
    print(traces)
    # one rank: the wrappers' all-reduce / reduce-scatter of one shard leave the gradients as they are;
    # FSDP2 runs the same kernels on unsharded copies, so only fp32 reordering can differ
    assert traces[mode] == pytest.approx(traces["none"], rel=1e-5)


if __name__ == "__main__":
    _wrapped_training(*sys.argv[1:3])
