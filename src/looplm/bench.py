"""``looplm bench``: throughput and memory measurements with their targets (issue 6), as JSON + Markdown.

Every figure is a ratio taken within the same run, so the machine's speed cancels:

- ``matmul_peak_gflops``: large fp32 and bf16 matmuls (the machine's measured peak; fp32 is the best
  of 1024² and ``matmul_n``²);
- ``train_tokens_per_s`` and ``mfu``: training throughput of the chosen preset at a fixed loop depth,
  and model FLOPs/s (3 × the SCSE forward FLOP proxy, eq. 20–21) over the fp32 matmul peak;
  ``bf16_train_speedup``: bf16-autocast over fp32 training throughput;
- ``loop_overhead_ratio``: a looped model at depth T against an unshared model of T blocks of the same
  width (training tokens/s); ``scse_vs_looped_ratio``: SCSE against the ``looped`` baseline;
- ``multidepth_eval_ratio``: evaluation at the default depth list over one evaluation at its largest
  depth (one unroll reads out at every depth on the way);
- entries for truncated BPTT and KV-cache decoding appear once those parts exist.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from looplm.analysis.flops import flops_per_token
from looplm.config import ModelConfig
from looplm.eval.perplexity import DEFAULT_DEPTHS
from looplm.model import LoopLM
from looplm.presets import get_preset
from looplm.train.trainer import autocast_context

TARGETS = {"mfu": (">=", 0.60), "bf16_train_speedup": (">=", 1.5), "loop_overhead_ratio": (">=", 0.97),
           "scse_vs_looped_ratio": (">=", 0.97), "multidepth_eval_ratio": ("<=", 1.1)}


def _timeit(fn: Callable[[], Any], *, warmup: int, repeat: int, device: torch.device) -> float:
    """Median seconds per call of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def matmul_peak_gflops(dtype: torch.dtype, n: int, device: torch.device, repeat: int = 5, warmup: int = 2) -> float:
    """GFLOP/s of an (n × n) @ (n × n) matmul in ``dtype`` (2n³ FLOPs per call)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sec = _timeit(lambda: a @ b, warmup=warmup, repeat=repeat, device=device)
    return 2 * n ** 3 / sec / 1e9


def train_tokens_per_s(cfg: ModelConfig, depth: int, *, batch_size: int, steps: int, device: torch.device,
                       dtype: str = "float32", warmup: int = 2) -> float:
    """Training tokens/s (forward + backward + AdamW step) of ``cfg`` at loop depth ``depth``."""
    torch.manual_seed(0)
    model = LoopLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), device=device)

    def step() -> None:
        with autocast_context(device, dtype):
            loss = model(x, depth=depth, targets=x, keep_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sec = _timeit(step, warmup=warmup, repeat=steps, device=device)
    return batch_size * cfg.seq_len / sec


@torch.no_grad()
def eval_seconds(model: LoopLM, depths: list[int], *, batch_size: int, repeat: int, device: torch.device) -> float:
    """Seconds per evaluation batch reading out at ``depths`` from one unroll."""
    model.eval()
    x = torch.randint(0, model.cfg.vocab_size, (batch_size, model.cfg.seq_len), device=device)
    return _timeit(lambda: model(x, depth=depths, targets=x, keep_logits=False), warmup=1, repeat=repeat,
                   device=device)


def machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def run_bench(*, preset: str = "cpu", depth: int = 8, batch_size: int = 16, steps: int = 5, matmul_n: int = 2048,
              device: str = "auto", progress: bool = True) -> dict[str, Any]:
    """Run every measurement; returns the JSON-ready results (with ``targets`` and ``markdown``)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    cfg = get_preset(preset).model.replace(dropout=0.0)
    log = print if progress else (lambda *a, **k: None)
    res: dict[str, Any] = {"machine": machine(), "device": str(dev), "preset": preset, "depth": depth,
                           "batch_size": batch_size, "seq_len": cfg.seq_len}
    # the peak is the best of two sizes: one size alone can land on a slow blocking of the BLAS
    peak32 = max(matmul_peak_gflops(torch.float32, n, dev) for n in sorted({min(1024, matmul_n), matmul_n}))
    # CPUs without native bf16 (no AVX512-BF16/AMX) run bf16 matmuls ~100× slower: probe a small one
    # first and keep the bf16 measurements short when it is slow.
    slow_bf16 = dev.type == "cpu" and matmul_peak_gflops(torch.bfloat16, 256, dev, repeat=1, warmup=1) < 0.1 * peak32
    peak16 = matmul_peak_gflops(torch.bfloat16, min(matmul_n, 512) if slow_bf16 else matmul_n, dev,
                                repeat=1 if slow_bf16 else 5, warmup=1 if slow_bf16 else 2)
    res["bf16_native"] = not slow_bf16
    res["matmul_peak_gflops"] = {"float32": peak32, "bfloat16": peak16}
    log(f"matmul peak: fp32 {peak32:.1f} GFLOP/s, bf16 {peak16:.1f} GFLOP/s")

    tps = train_tokens_per_s(cfg, depth, batch_size=batch_size, steps=steps, device=dev)
    model_flops = 3 * flops_per_token(cfg, depth)["body_head"]  # forward + backward ≈ 3 × forward
    res["train_tokens_per_s"] = tps
    res["train_model_flops_per_token"] = model_flops
    res["mfu"] = tps * model_flops / (peak32 * 1e9)
    tps16 = train_tokens_per_s(cfg, depth, batch_size=batch_size, steps=1 if slow_bf16 else steps, device=dev,
                               dtype="bfloat16", warmup=1 if slow_bf16 else 2)
    res["train_tokens_per_s_bf16"] = tps16
    res["bf16_train_speedup"] = tps16 / tps
    log(f"train: {tps:.0f} tok/s fp32 (MFU {res['mfu']:.1%}), {tps16:.0f} tok/s bf16")

    looped = cfg.replace(rule="looped")
    unshared = cfg.replace(architecture="unshared", n_layers=depth)
    t_looped = train_tokens_per_s(looped, depth, batch_size=batch_size, steps=steps, device=dev)
    t_unshared = train_tokens_per_s(unshared, depth, batch_size=batch_size, steps=steps, device=dev)
    res["loop_overhead_ratio"] = t_looped / t_unshared
    res["scse_vs_looped_ratio"] = tps / t_looped
    log(f"looped {t_looped:.0f} vs unshared-{depth} {t_unshared:.0f} tok/s; scse/looped {res['scse_vs_looped_ratio']:.3f}")

    torch.manual_seed(0)
    model = LoopLM(cfg).to(dev)
    depths = list(DEFAULT_DEPTHS)
    multi = eval_seconds(model, depths, batch_size=batch_size, repeat=steps, device=dev)
    single = eval_seconds(model, [max(depths)], batch_size=batch_size, repeat=steps, device=dev)
    separate = sum(eval_seconds(model, [t], batch_size=batch_size, repeat=1, device=dev) for t in depths)
    res["multidepth_eval_ratio"] = multi / single
    res["multidepth_vs_separate_speedup"] = separate / multi
    log(f"multi-depth eval {multi:.3f}s vs deepest only {single:.3f}s vs separate {separate:.3f}s per batch")

    res["targets"] = {k: {"op": op, "target": v, "value": res[k],
                          "met": res[k] >= v if op == ">=" else res[k] <= v} for k, (op, v) in TARGETS.items()}
    res["markdown"] = markdown(res)
    return res


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# looplm bench ({res['device']}, preset `{res['preset']}`, T={res['depth']}, "
             f"batch {res['batch_size']}×{res['seq_len']})", "",
             f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']} "
             f"({m['torch_threads']} threads){', ' + m['cuda_device'] if 'cuda_device' in m else ''}.", "",
             "| measurement | value |", "|---|---:|",
             f"| fp32 matmul peak | {res['matmul_peak_gflops']['float32']:.1f} GFLOP/s |",
             f"| bf16 matmul peak | {res['matmul_peak_gflops']['bfloat16']:.1f} GFLOP/s |",
             f"| training tokens/s (fp32) | {res['train_tokens_per_s']:.0f} |",
             f"| training tokens/s (bf16 autocast) | {res['train_tokens_per_s_bf16']:.0f} |",
             f"| multi-depth eval vs separate runs | {res['multidepth_vs_separate_speedup']:.2f}× faster |",
             "", "| target | value | target | met |", "|---|---:|---:|:---:|"]
    for k, t in res["targets"].items():
        lines.append(f"| `{k}` | {t['value']:.3f} | {t['op']} {t['target']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


def write_results(res: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(res["markdown"] + "\n")
    return out
