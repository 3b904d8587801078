"""GPU measurements of issue 28 §4, one JSON + Markdown pair (``scripts/gpu-check`` runs it on CUDA).

- ``matmul_peak_bf16_tflops``: the same run's bf16 matmul peak (median of the repeats at the best size);
- ``train_mfu_{eager,compiled}``: bf16-autocast training (forward + backward + fused AdamW) of a looped
  model of d = 1,024, 16 heads, SwiGLU 4,096, V = 50,257, 1 prelude + 4-block core + 1 coda at R = 4
  (1 + 4·4 + 1 = 18 block applications: ~350M parameters unrolled, ``params_unrolled``), FLOPs counted
  analytically (3 × :func:`looplm.analysis.flops.flops_per_token`, SCSE eq. 20–21: the fused loss hides
  its matmuls from ``FlopCounterMode``) over that peak; target ``train_mfu`` (the better) ≥ 0.40;
  ``compiled``: every block under ``torch.compile`` (``train.compile``);
- ``train_peak_mem_bytes``: peak allocated memory of the training step (CUDA; on CPU the process's peak RSS);
- ``train_profile_eager``: the 15 operators of one eager training step with the most self device time
  (``torch.profiler``), each with its share: where the step's time goes when the MFU falls short;
- ``decode_b{B}_tokens_per_s``: greedy decoding at batch 1 and 64 after a 512-token prompt: ``kvcache`` (the
  eager path), ``static`` (:class:`looplm.model.static_decode.DecodeStep`, eager), ``cuda_graph`` (the
  static step captured once and replayed) and ``compile_cuda_graph`` (the inductor-compiled static step,
  captured; the last two CUDA only). A path that fails records ``null`` and its error under
  ``decode_errors`` rather than stopping the run.

``--device cpu --tiny`` runs every measurement at toy shapes (seconds; the values mean nothing), which
is how the CPU test suite checks this script end to end.
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys
import time
from pathlib import Path

import torch

from looplm.analysis.flops import flops_per_token
from looplm.apps.bench import machine, matmul_rates
from looplm.config import ModelConfig
from looplm.run.finite import write_json_markdown
from looplm.model import NLL, Readout, build_model
from looplm.model.kvcache import KVCache
from looplm.model.static_decode import DecodeStep, StaticKVCache
from looplm.train.trainer import compile_blocks

MFU_TARGET = 0.40


def bench_config(tiny: bool) -> ModelConfig:
    if tiny:
        return ModelConfig(rule="huginn_linear", vocab_size=512, d_model=64, n_heads=4, d_ff=128, seq_len=64,
                           n_prelude=1, n_core=4, n_coda=1, dropout=0.0)
    return ModelConfig(rule="huginn_linear", vocab_size=50257, d_model=1024, n_heads=16, d_ff=4096, seq_len=1024,
                       n_prelude=1, n_core=4, n_coda=1, dropout=0.0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _peak_mem(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _training(model, cfg: ModelConfig, batch: int, dev: torch.device):
    """``step(depth)``: one bf16-autocast training step (forward, backward, AdamW) on a fixed random batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=dev)

    def step(depth: int) -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(x, depth, x, readout=NLL).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)

    return step


def train_tokens_per_s(model, cfg: ModelConfig, depth: int, batch: int, steps: int, dev: torch.device) -> float:
    """bf16-autocast training tokens/s (median step after 2 warm-up steps, which also compile)."""
    step, times = _training(model, cfg, batch, dev), []
    for i in range(steps + 2):
        _sync(dev)
        t0 = time.perf_counter()
        step(depth)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return batch * cfg.seq_len / sorted(times)[len(times) // 2]


def train_step_profile(model, cfg: ModelConfig, depth: int, batch: int, dev: torch.device, top: int = 15) -> list:
    """The ``top`` operators of one eager bf16 training step by self device time (CUDA; CPU time on CPU), from
    ``torch.profiler``: ``[{"op", "calls", "self_ms", "share"}]``, share of the step's summed self time."""
    from torch.profiler import ProfilerActivity, profile

    step = _training(model, cfg, batch, dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step(depth)

    def self_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) if dev.type == "cuda" else e.self_cpu_time_total)

    events = sorted(prof.key_averages(), key=self_us, reverse=True)
    total = sum(self_us(e) for e in events) or 1.0
    return [{"op": e.key, "calls": e.count, "self_ms": self_us(e) / 1e3, "share": self_us(e) / total}
            for e in events[:top]]


@torch.no_grad()
def decode_tokens_per_s(model, depth: int, batch: int, context: int, new: int, how: str, dev: torch.device) -> float:
    """Tokens/s (all rows) of ``new`` greedy steps after a ``context − new``-token prompt (prefill untimed)."""
    torch.manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, context - new), device=dev)
    last = (torch.arange(batch, device=dev), torch.full((batch,), prompt.shape[1] - 1, device=dev))
    cache = KVCache("per_visit", max_len=context)
    tok = model.read(model.loop(prompt, cache=cache), depth, readout=Readout(tokens=last)).logits.argmax(-1)  # (B,)
    if how == "kvcache":
        def step(t):
            return model.read(model.loop(t[:, None], cache=cache), depth).logits[:, -1]
    else:
        step = DecodeStep(model, StaticKVCache(cache, context, model.cfg.seq_len), depth,
                          "eager" if how == "static" else how)
    tok = step(tok).argmax(-1)  # warm-up (and capture)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(new - 1):
        tok = step(tok).argmax(-1)
    _sync(dev)
    return batch * (new - 1) / (time.perf_counter() - t0)


def run(device: str, tiny: bool, log=print) -> dict:
    dev = torch.device(device)
    cfg, depth = bench_config(tiny), 4 if not tiny else 2
    batch, steps = (16, 10) if not tiny else (2, 2)
    res: dict = {"machine": machine(), "device": str(dev), "tiny": tiny, "depth": depth, "batch_size": batch,
                 "config": {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_heads", "d_ff", "seq_len",
                                                         "n_prelude", "n_core", "n_coda", "rule")}}
    sizes = (4096, 8192) if not tiny else (128,)
    rates = {n: sorted(matmul_rates(torch.bfloat16, n, dev, repeat=10 if not tiny else 2)) for n in sizes}
    peak = max(r[len(r) // 2] for r in rates.values()) * 1e9  # FLOP/s
    res["matmul_peak_bf16_tflops"] = peak / 1e12
    log(f"bf16 matmul peak {peak / 1e12:.1f} TFLOP/s")

    torch.manual_seed(0)
    model = build_model(cfg).to(dev).train()
    blocks = cfg.n_prelude + depth * cfg.n_core + cfg.n_coda
    block_params = sum(p.numel() for p in model.core.parameters()) // cfg.n_core
    res["params"] = model.num_params()
    res["params_unrolled"] = res["params"] + (blocks - cfg.n_prelude - cfg.n_core - cfg.n_coda) * block_params
    res["train_flops_per_token"] = 3 * flops_per_token(cfg, depth)["body_head"]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for variant in ("eager", "compiled"):
        m = model if variant == "eager" else compile_blocks(copy.deepcopy(model),
                                                            backend="inductor" if dev.type == "cuda" else "aot_eager")
        tps = train_tokens_per_s(m, cfg, depth, batch, steps, dev)
        res[f"train_tokens_per_s_{variant}"] = tps
        res[f"train_mfu_{variant}"] = tps * res["train_flops_per_token"] / peak
        log(f"train ({variant}): {tps:.0f} tok/s, MFU {res[f'train_mfu_{variant}']:.3f}")
        del m
    res["train_peak_mem_bytes"] = _peak_mem(dev)
    try:  # not yet run on a GPU: a profiler failure must not cost the decode measurements
        res["train_profile_eager"] = train_step_profile(model, cfg, depth, batch, dev)
    except Exception as e:
        res["train_profile_eager"], res["train_profile_error"] = [], f"{type(e).__name__}: {e}"[:2000]
    res["train_mfu"] = max(res["train_mfu_eager"], res["train_mfu_compiled"])
    res["targets"] = {"train_mfu": {"op": ">=", "target": MFU_TARGET, "value": res["train_mfu"],
                                    "met": res["train_mfu"] >= MFU_TARGET and res["train_mfu"] <= 1}}

    model.eval()
    context, new = (512, 64) if not tiny else (32, 6)
    hows = ["kvcache", "static"] + (["cuda_graph", "compile_cuda_graph"] if dev.type == "cuda" else [])
    res["decode_errors"] = {}
    for b in (1, 64) if not tiny else (1, 4):
        rates = res[f"decode_b{b}_tokens_per_s"] = {}
        for h in hows:
            try:
                rates[h] = decode_tokens_per_s(model, depth, b, context, new, h, dev)
            except Exception as e:  # a bench records what failed and goes on
                rates[h] = None
                res["decode_errors"][f"b{b}_{h}"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"decode batch {b}: " + ", ".join(f"{h} {_rate(v)}" for h, v in rates.items()))
    res["decode_context"], res["decode_new_tokens"] = context, new
    res["peak_mem_bytes"] = _peak_mem(dev)
    res["markdown"] = markdown(res)
    return res


def _rate(v: float | None) -> str:
    return "failed" if v is None else f"{v:.1f}"


def markdown(res: dict) -> str:
    c, m = res["config"], res["machine"]
    lines = [f"# looplm GPU check ({res['device']}{', tiny shapes: values mean nothing' if res['tiny'] else ''})", "",
             f"Machine: {m.get('cuda_device', m['processor'])}, torch {m['torch']}. Model: d={c['d_model']}, "
             f"{c['n_heads']} heads, d_ff={c['d_ff']}, V={c['vocab_size']}, {c['n_prelude']} + {c['n_core']}×R + "
             f"{c['n_coda']} at R={res['depth']} ({res['params']:,} parameters, {res['params_unrolled']:,} unrolled), "
             f"batch {res['batch_size']}×{c['seq_len']}, bf16 autocast.", "",
             "| measurement | value |", "|---|---:|",
             f"| bf16 matmul peak (same run) | {res['matmul_peak_bf16_tflops']:.1f} TFLOP/s |",
             *[f"| training tokens/s, {v} | {res[f'train_tokens_per_s_{v}']:.0f} (MFU {res[f'train_mfu_{v}']:.3f}) |"
               for v in ("eager", "compiled")],
             f"| peak memory: training / whole run | {res['train_peak_mem_bytes'] / 2**30:.2f} / "
             f"{res['peak_mem_bytes'] / 2**30:.2f} GiB |"]
    for k in sorted(k for k in res if k.startswith("decode_b")):
        lines.append(f"| decode tokens/s, batch {k.split('_')[1][1:]}, {res['decode_context']}-token context: "
                     + " / ".join(res[k]) + " | " + " / ".join(_rate(v) for v in res[k].values()) + " |")
    lines += ["", "One eager training step, top operators by self device time: "
              + ("; ".join(f"`{e['op']}` {100 * e['share']:.1f}%" for e in res["train_profile_eager"][:8])
                 or f"(profile failed: {res.get('train_profile_error', '?').splitlines()[0][:300]})") + "."]
    t = res["targets"]["train_mfu"]
    lines += ["", f"Target `train_mfu` {t['op']} {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'not met'})."]
    lines += [f"Decode path `{k}` failed: {v.splitlines()[0][:300]}" for k, v in res.get("decode_errors", {}).items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="toy shapes (a smoke test: seconds)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-check.json"), metavar="FILE.json",
                   help="results JSON; the Markdown goes to FILE.md (default benchmarks/results/gpu-check.json)")
    args = p.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        p.error(f"--device: got {args.device!r}; allowed: cuda, cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available; use --device cpu --tiny")
    res = run(args.device, args.tiny)
    write_json_markdown(res, args.out)
    print(res["markdown"])
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
