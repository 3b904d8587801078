"""``looplm bench``: throughput and memory measurements with their targets (issues 6, 12 §3, 15), as JSON + Markdown.

Every figure is a ratio taken within the same run, so the machine's speed cancels; every timed ratio is
measured in interleaved A/B/B/A rounds (:func:`interleaved`, issue 28 §3), each quarter at least
:data:`MIN_QUARTER_S` of calls, and judged by :func:`judge_targets` (``met`` / ``not met`` / ``undecided`` /
``invalid`` / ``unstable``: the fp32 matmul rate moved by more than :data:`MAX_SPREAD`). Memory figures are byte
counts, the same on every run on CPU. What each key measures: benchmarks/README.md. ``quick=True`` shrinks every
shape (a smoke test; the values mean nothing).
"""
from __future__ import annotations

import copy
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from functools import reduce
from statistics import median_high
from typing import Any, Callable

import torch

from looplm.analysis.flops import flops_per_token, multidepth_flops_per_token
from looplm.analysis.memory import peak_live_bytes
from looplm.config import ModelConfig
from looplm.distill.config import DistillConfig
from looplm.distill.prefill import prefill_paths
from looplm.distill.student import build_student
from looplm.eval.exits import sync_device
from looplm.eval.perplexity import DEFAULT_DEPTHS
from looplm.model import KVCache, LoopLM, build_model
from looplm.model.kvcache import CACHE_MODES
from looplm.model.cursor import BPTT, NLL, Gradient, Readout
from looplm.model.static_decode import DecodeStep, StaticKVCache
from looplm.presets import get_preset
from looplm.run.dist import resolve_device
from looplm.train.trainer import compile_blocks

TARGETS = {"mfu": (">=", 0.80), "bf16_train_speedup": (">=", 1.5), "loop_overhead_ratio": (">=", 0.97),
           "scse_vs_looped_ratio": (">=", 0.97), "multidepth_eval_ratio": ("<=", 1.1),
           "tbptt_peak_mem_ratio": ("<=", 1.3), "decode_cache_speedup": (">=", 20.0),  # issue 15 (was 10)
           "terminal_kv_bytes_ratio": ("==", None),  # None: 1/T of the run, set in run_bench
           # issue 15
           "huginn_shape_mfu": (">=", 0.65), "multidepth_flop_ratio": ("<=", 1.1),
           "multidepth_vs_separate_speedup": (">=", 2.5), "huginn_decode_cache_speedup": (">=", 20.0),
           "peak_train_mem_ratio": ("<=", 0.6),
           # issue 12 §3: LMDR §5.5 reports 1.5–1.8× at R = 5 (8K prompts, batch 8)
           "distilled_prefill_speedup": (">=", 1.5)}
#: targets measured by timing (their status is "unstable" when the machine's speed moved during the run)
TIMED = set(TARGETS) - {"tbptt_peak_mem_ratio", "terminal_kv_bytes_ratio", "peak_train_mem_ratio"}
#: largest relative spread of the fp32 matmul rate (between repeats, and start vs end) of a stable run
MAX_SPREAD = 0.25
#: seconds each quarter of an interleaved round lasts at least (a side whose call is shorter runs more calls):
#: a 10-ms hiccup of the machine then moves a quarter by ≤ 1% (not in ``quick`` runs)
MIN_QUARTER_S = 1.0


def _seconds(fn: Callable[[], Any], device: torch.device, own: bool = False) -> float:
    """Wall seconds of one call of ``fn``, the device synchronized before and after; ``own``: a call may return
    its own seconds (a float)."""
    sync_device(device)
    t0 = time.perf_counter()
    out = fn()
    sync_device(device)
    return out if own and isinstance(out, float) else time.perf_counter() - t0


def _timed_loop(step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor, n: int, device: torch.device
                ) -> float:
    """Wall seconds of ``n`` chained calls ``tok = step(tok)``, the device synchronized before and after."""
    return _seconds(lambda: reduce(lambda t, _: step(t), range(n), tok), device)


def matmul_rates(dtype: torch.dtype, n: int, device: torch.device, repeat: int = 5, warmup: int = 2) -> list[float]:
    """GFLOP/s of each repeat of an (n × n) @ (n × n) matmul in ``dtype`` (2n³ FLOPs per call)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    for _ in range(warmup):
        a @ b
    return [2 * n ** 3 / _seconds(lambda: a @ b, device) / 1e9 for _ in range(repeat)]


def judge_targets(res: dict[str, Any], targets: dict[str, tuple[str, float]]) -> dict[str, dict[str, Any]]:
    """``name → {"op", "target", "value", "status", "met"}`` for each target ``name → (op, target)``: ``invalid``
    (not finite, MFU > 1), ``unstable`` (timed, unstable run), else ``met`` / ``not met``, and for an interleaved
    ratio ``undecided`` unless every round is on one side."""
    stable = res.get("stability", {}).get("stable", True)
    out = {}
    for k, (op, v) in targets.items():
        x = res[k]
        iv = res.get("intervals", {}).get(k)
        if not math.isfinite(x) or (k in ("mfu", "huginn_shape_mfu") and (iv["max"] if iv else x) > 1):
            status = "invalid"
        elif k in TIMED and not stable:
            status = "unstable"
        elif iv is not None and op in (">=", "<="):  # every round on one side of the target, or undecided
            sides = {(r >= v if op == ">=" else r <= v) for r in iv["rounds"]}
            status = "undecided" if len(sides) == 2 else "met" if sides == {True} else "not met"
        elif op == "==":
            status = "met" if abs(x - v) <= 1e-9 * max(1.0, abs(v)) else "not met"
        else:
            status = "met" if (x >= v if op == ">=" else x <= v) else "not met"
        out[k] = {"op": op, "target": v, "value": x, "status": status, "met": status == "met"}
    return out


def _calls_to_fill(fn: Callable[[], Any], seconds: float, device: torch.device) -> int:
    """How many calls of ``fn``, one after another, it takes to spend ``seconds`` (at least one); a call may
    return its own seconds."""
    n, spent = 0, 0.0
    while spent < seconds or n == 0:
        spent += _seconds(fn, device, own=True)
        n += 1
    return n


def interleaved(a: Callable[[], Any], b: Callable[[], Any], *, rounds: int, repeat: int, device: torch.device,
                scale: float = 1.0, warmup: int = 1, min_s: float = 0.0) -> dict[str, Any]:
    """The ratio ``scale × t_B / t_A`` of the mean seconds per call, in interleaved A/B/B/A rounds (issue 28 §3);
    a call may return its own seconds (a float). Each quarter runs ``repeat`` calls of its side, or more: as
    many as filled ``min_s`` seconds in a sizing quarter after the warm-up (a slow first call, such as a
    recompilation, then costs a few calls, not the count).
    ``{"median", "min", "max", "rounds", "a_s", "b_s", "calls"}`` (``calls``: per quarter, A's and B's)."""
    for _ in range(warmup):
        a(), b()
    calls = [max(repeat, _calls_to_fill(f, min_s, device)) if min_s > 0 else repeat for f in (a, b)]
    ta, tb, ratios = [], [], []
    for _ in range(rounds):
        a1, b1, b2, a2 = [sum(_seconds(f, device, own=True) for _ in range(n)) / n
                          for f, n in ((a, calls[0]), (b, calls[1]), (b, calls[1]), (a, calls[0]))]
        ta.append((a1 + a2) / 2)
        tb.append((b1 + b2) / 2)
        ratios.append(scale * tb[-1] / ta[-1])
    med = statistics.median
    return {"median": med(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios, "a_s": med(ta),
            "b_s": med(tb), "calls": calls}


@dataclass(frozen=True)
class Timing:
    """A run's settings: :func:`interleaved`'s, torch.compile's ``backend``, progress ``log``, ``quick`` toy shapes."""
    device: torch.device
    rounds: int = 3
    repeat: int = 5
    min_s: float = 0.0
    backend: str = "inductor"
    quick: bool = False
    log: Callable[..., None] = print

    def ratio(self, res: dict[str, Any], key: str, a: Callable[[], Any], b: Callable[[], Any],
              **kw: Any) -> dict[str, Any]:
        """:func:`interleaved` ``(a, b)`` with these settings (``kw`` overrides them) into ``res["intervals"][key]``
        and its median into ``res[key]``."""
        iv = res["intervals"][key] = interleaved(a, b, **{"rounds": self.rounds, "repeat": self.repeat,
                                                          "device": self.device, "min_s": self.min_s, **kw})
        res[key] = iv["median"]
        return iv


def _model_batch(cfg: ModelConfig, batch_size: int, device: torch.device) -> tuple[LoopLM, torch.Tensor]:
    """``cfg``'s model (seed 0, train mode) on ``device`` and a random (batch_size, seq_len) token batch."""
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    return model, torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), device=device)


def train_step(cfg: ModelConfig, depth: int, *, batch_size: int, device: torch.device,
               dtype: str = "float32", backend: str | None = None) -> Callable[[], None]:
    """One training step (forward + backward + AdamW step) of ``cfg`` at loop depth ``depth``; ``backend``: blocks
    compiled by ``torch.compile`` with it (``train.compile``), compiling on the first call."""
    model, x = _model_batch(cfg, batch_size, device)
    if backend is not None:
        compile_blocks(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(x, depth, x, readout=NLL).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _cuda_peak(fn: Callable[[], Any]) -> int:
    """Peak CUDA bytes allocated during ``fn()`` above the memory before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def training_memory_bytes(model: LoopLM, x: torch.Tensor, depth: int, tbptt: int) -> int:
    """Activation bytes of one training step (TBPTT-``tbptt``; 0 = full): CUDA peak allocated above rest, else
    the unique storages autograd saves for backward."""
    gradient = Gradient("tbptt", tbptt) if tbptt else BPTT
    if x.device.type == "cuda":
        peak = _cuda_peak(lambda: model(x, depth, x, gradient=gradient, readout=NLL).loss.backward())
        model.zero_grad(set_to_none=True)
        return peak
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, depth, x, gradient=gradient, readout=NLL).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def tbptt_measurements(cfg: ModelConfig, *, batch_size: int, device: torch.device, depth: int = 32,
                       window: int = 4, short: int = 4) -> dict[str, float]:
    """Truncated BPTT (b = ``window``) at T = ``depth`` against full BPTT at T = ``short`` (issue 6)."""
    model, x = _model_batch(cfg, batch_size, device)
    trunc = training_memory_bytes(model, x, depth, window)
    full_short = training_memory_bytes(model, x, short, 0)
    full_deep = training_memory_bytes(model, x, depth, 0)
    return {"tbptt_depth": depth, "tbptt_window": window, "tbptt_short_depth": short,
            "tbptt_mem_bytes_truncated": trunc, "tbptt_mem_bytes_full_short": full_short,
            "tbptt_mem_bytes_full_deep": full_deep, "tbptt_peak_mem_ratio": trunc / full_short}


def _prefill(model: LoopLM, prompt: torch.Tensor, cache: KVCache, depth: int) -> torch.Tensor:
    """Greedy next tokens (B, 1) after ``prompt`` (B, n), reading out only the last position, as generate's does."""
    b, n = prompt.shape
    last = (torch.arange(b, device=prompt.device), torch.full((b,), n - 1, device=prompt.device))
    return model.read(model.loop(prompt, cache=cache), depth, readout=Readout(tokens=last)).logits.argmax(-1)[:, None]


def _step(model: LoopLM, tok: torch.Tensor, cache: KVCache, depth: int) -> torch.Tensor:
    return model.read(model.loop(tok, cache=cache), depth).logits[:, -1:].argmax(-1)


def _uncached(model: LoopLM, seq: torch.Tensor, n: int, depth: int) -> None:
    """Greedy decoding of ``n`` tokens after ``seq``, recomputing the whole sequence for each."""
    for _ in range(n):
        seq = torch.cat([seq, model(seq, depth=depth).logits[:, -1:].argmax(-1)], 1)


@torch.no_grad()
def decode_measurements(res: dict[str, Any], cfg: ModelConfig, t: Timing, depth: int, context: int = 512) -> None:
    """Greedy decoding of 32 tokens (8 when quick) after a ``context``-token prompt with the per_visit and
    terminal KV caches and uncached; decode-phase and with-prefill tokens/s, KV bytes, cached over uncached
    (issue 6)."""
    new_tokens, device = 8 if t.quick else 32, t.device
    long = cfg.replace(seq_len=max(cfg.seq_len, context))
    torch.manual_seed(0)
    model = build_model(long).to(device).eval()
    prompt = torch.randint(0, long.vocab_size, (1, context - new_tokens), device=device)
    res.update(decode_depth=depth, decode_context=context, decode_new_tokens=new_tokens)

    def cached(mode: str) -> float:  # the decode phase's seconds
        cache = KVCache(mode)
        t0 = time.perf_counter()
        nxt = _prefill(model, prompt, cache, depth)
        sync_device(device)
        res[f"decode_prefill_s_{mode}"] = time.perf_counter() - t0
        res[f"decode_steps_s_{mode}"] = _timed_loop(lambda t: _step(model, t, cache, depth), nxt, new_tokens - 1,
                                                    device)
        res[f"kv_bytes_{mode}"] = cache.nbytes()
        return res[f"decode_steps_s_{mode}"]

    for mode in CACHE_MODES:
        cached(mode)  # warm-up
        res[f"decode_tokens_per_s_with_prefill_{mode}"] = new_tokens / _seconds(lambda: cached(mode), device)
        # the decode phase: tokens 2..n, each one cached step (the prefill's cost is reported apart)
        res[f"decode_tokens_per_s_{mode}"] = (new_tokens - 1) / res[f"decode_steps_s_{mode}"]
    # decode-phase tokens/s cached over uncached, interleaved: (n − 1) / t_cached over n / t_uncached
    iv = t.ratio(res, "decode_cache_speedup", lambda: cached("per_visit"),
                 lambda: _uncached(model, prompt, new_tokens, depth), repeat=1, scale=(new_tokens - 1) / new_tokens)
    res["decode_tokens_per_s_uncached"] = new_tokens / iv["b_s"]
    res["decode_tokens_per_s_per_visit"] = (new_tokens - 1) / iv["a_s"]
    res["decode_cache_speedup_with_prefill"] = (res["decode_tokens_per_s_with_prefill_per_visit"]
                                                / res["decode_tokens_per_s_uncached"])
    res["terminal_kv_bytes_ratio"] = res["kv_bytes_terminal"] / res["kv_bytes_per_visit"]


def huginn_config(quick: bool = False) -> ModelConfig:
    """The Huginn shape of issue 15 (``huginn_linear``, no dropout); ``quick``: the same layout at toy sizes."""
    sizes = (dict(vocab_size=512, d_model=32, n_heads=2, d_ff=64, seq_len=16) if quick
             else dict(vocab_size=50257, d_model=256, n_heads=4, d_ff=1024, seq_len=128))
    return ModelConfig(rule="huginn_linear", n_prelude=1, n_core=2, n_coda=1, dropout=0.0, **sizes)


def multidepth_measurements(res: dict[str, Any], cfg: ModelConfig, t: Timing, batch_size: int,
                            prefix: str = "") -> None:
    """Multi-depth evaluation against one at the largest depth, its FLOP-predicted time, and separate runs."""
    depths = [1, 2, 4] if t.quick else list(DEFAULT_DEPTHS)
    model, x = _model_batch(cfg, batch_size, t.device)
    model.eval()

    @torch.no_grad()
    def run(ds: list[int]) -> None:
        model(x, ds, x, readout=NLL)

    f_multi, f_single = multidepth_flops_per_token(cfg, depths), flops_per_token(cfg, max(depths))["body_head"]
    single_multi = t.ratio(res, f"{prefix}multidepth_eval_ratio", lambda: run([max(depths)]), lambda: run(depths))
    flop = {k: v * f_single / f_multi if k in ("median", "min", "max") else v for k, v in single_multi.items()}
    flop["rounds"] = [r * f_single / f_multi for r in single_multi["rounds"]]
    res["intervals"][f"{prefix}multidepth_flop_ratio"] = flop
    res[f"{prefix}multidepth_flop_ratio"] = flop["median"]
    multi_sep = t.ratio(res, f"{prefix}multidepth_vs_separate_speedup", lambda: run(depths),
                        lambda: [run([d]) for d in depths], repeat=1)
    res.update({f"{prefix}multidepth_eval_s": single_multi["b_s"], f"{prefix}multidepth_single_s": single_multi["a_s"],
                f"{prefix}multidepth_separate_s": multi_sep["b_s"],
                f"{prefix}multidepth_flops_ratio_predicted": f_multi / f_single})


@torch.no_grad()
def decode_tokens_per_s(model, *, batch_size: int, context: int, new_tokens: int, depth: int,
                        device: torch.device, mode: str = "per_visit") -> float:
    """Decode-phase tokens/s (all rows) of greedy cached decoding after a ``context``-token prompt (prefill untimed)."""
    torch.manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch_size, context - new_tokens), device=device)
    cache = KVCache(mode, max_len=context)
    nxt = _step(model, _prefill(model, prompt, cache, depth), cache, depth)  # the prefill and a warm-up step
    return batch_size * (new_tokens - 2) / _timed_loop(lambda t: _step(model, t, cache, depth), nxt, new_tokens - 2,
                                                       device)


@torch.no_grad()
def prefill_measurements(cfg: ModelConfig, *, depth: int, contexts: tuple[int, ...] = (512, 2048),
                         batch_size: int = 1, early_depths: tuple[int, ...] = (3, 2, 1), n_blocks: int = 2,
                         repeat: int = 5, rounds: int = 3, min_s: float = 0.0, device: torch.device,
                         prefix: str = "") -> dict[str, Any]:
    """Prefill latency of each path of LMDR Table 5 (:func:`looplm.distill.prefill.prefill_paths`) at ``cfg``
    (random weights, ``n_blocks`` student, terminal KV cache, last position read out), paths alternating.

    Returns ``{prefix}prefill_ms_ctx{C}`` → path → {mean, sd, median} (ms), ``{prefix}prefill_blocks`` → path →
    blocks per token, ``{prefix}distilled_prefill_speedup_ctx{C}`` (teacher / distilled, :func:`interleaved`)."""
    long = cfg.replace(seq_len=max(cfg.seq_len, *contexts))
    torch.manual_seed(0)
    teacher = build_model(long).to(device).eval()
    student = build_student(teacher, DistillConfig(n_blocks=n_blocks)).eval()
    paths = prefill_paths(teacher, student, depth, early_depths)
    blocks = {n: long.n_prelude + long.n_coda + (n_blocks + long.n_core if n == "distilled" else r * long.n_core)
              for n, (r, _) in paths.items()}
    res: dict[str, Any] = {f"{prefix}prefill_depth": depth, f"{prefix}prefill_batch_size": batch_size,
                           f"{prefix}prefill_blocks": blocks}
    for c in contexts:
        prompt = torch.randint(0, long.vocab_size, (batch_size, c), device=device)
        last = (torch.arange(batch_size, device=device), torch.full((batch_size,), c - 1, device=device))

        def run(name: str) -> Callable[[], None]:
            return lambda: paths[name][1](prompt, KVCache("terminal", max_len=c), readout=Readout(tokens=last))

        times: dict[str, list[float]] = {n: [] for n in paths}
        for rnd in range(repeat + 1):  # round 0 warms up
            for name in paths:
                sec = _seconds(run(name), device)
                if rnd:
                    times[name].append(1000 * sec)
        res[f"{prefix}prefill_ms_ctx{c}"] = {
            n: {"mean": statistics.fmean(t), "sd": statistics.stdev(t) if len(t) > 1 else 0.0,
                "median": statistics.median(t)} for n, t in times.items()}
        iv = res[f"{prefix}prefill_rounds_ctx{c}"] = interleaved(run("distilled"), run("teacher"), rounds=rounds,
                                                                 repeat=1, device=device, min_s=min_s)
        res[f"{prefix}distilled_prefill_speedup_ctx{c}"] = iv["median"]
    return res


def prefill_markdown(res: dict[str, Any], prefix: str = "") -> list[str]:
    """Table rows (path × context, ms mean ± sd) of :func:`prefill_measurements`' results."""
    ctx = sorted(int(k.rsplit("ctx", 1)[1]) for k in res if k.startswith(f"{prefix}prefill_ms_ctx"))
    if not ctx:
        return []
    blocks = res[f"{prefix}prefill_blocks"]
    lines = [f"| prefill path (R={res[f'{prefix}prefill_depth']}, batch {res[f'{prefix}prefill_batch_size']}) "
             "| blocks per token | " + " | ".join(f"{c}-token prompt (ms)" for c in ctx) + " |",
             "|---|---:|" + "---:|" * len(ctx)]
    for name in blocks:
        cells = [f"{m['mean']:.1f} ± {m['sd']:.1f}" for m in (res[f"{prefix}prefill_ms_ctx{c}"][name] for c in ctx)]
        lines.append(f"| {name} | {blocks[name]} | " + " | ".join(cells) + " |")
    lines.append("| distilled speed-up (teacher / distilled, median of interleaved rounds) | | " + " | ".join(
        f"{res[f'{prefix}distilled_prefill_speedup_ctx{c}']:.2f}×" for c in ctx) + " |")
    return lines


def peak_train_memory(cfg: ModelConfig, depth: int, *, batch_size: int, device: torch.device,
                      fused: bool = True) -> int:
    """Peak bytes of one training step's forward + backward above the memory before it: on CUDA the peak
    allocated (``max_memory_allocated``), else the peak of the live tensor bytes the step creates
    (:func:`looplm.analysis.memory.peak_live_bytes`: exact, the same on every run); ``fused=False``: the plain
    readout + loss."""
    model, x = _model_batch(cfg, batch_size, device)

    def step() -> None:
        model(x, depth, x, readout=Readout(logits=False, fused_ce=fused)).loss.backward()

    return _cuda_peak(step) if device.type == "cuda" else peak_live_bytes(step)


@torch.no_grad()
def huginn_decode_measurements(res: dict[str, Any], hcfg: ModelConfig, t: Timing, depth: int,
                               contexts: tuple[int, int]) -> None:
    """Decoding at the Huginn shape: tokens/s at batch 1, 8 per context; at batch 1, compiled blocks and the
    compiled static step over eager, cached over uncached."""
    new, device, log = 4 if t.quick else 16, t.device, t.log
    long = hcfg.replace(seq_len=max(contexts))
    torch.manual_seed(0)
    dec = build_model(long).to(device).eval()
    for b in (1, 8):
        for c in contexts:
            key = f"huginn_decode_b{b}_ctx{c}_tokens_per_s"
            res[key] = decode_tokens_per_s(dec, batch_size=b, context=c, new_tokens=new, depth=depth, device=device)
            log(f"huginn shape: decode batch {b}, {c}-token context: {res[key]:.1f} tok/s")
    res["decode_b1_tokens_per_s"] = res[f"huginn_decode_b1_ctx{contexts[0]}_tokens_per_s"]
    # blocks compiled by torch.compile (the cache bookkeeping stays eager at a graph break)
    compiled = compile_blocks(copy.deepcopy(dec), backend=t.backend)

    def b1(model=dec, how: str | None = None) -> Callable[[], float]:  # seconds of new − 2 batch-1 steps
        if how is not None:  # one static step (compiled once), rewound to the prompt before every run
            prompt = torch.randint(0, long.vocab_size, (1, contexts[0] - new), device=device)
            cache = KVCache("per_visit")
            first = model.read(model.loop(prompt, cache=cache), depth).logits[:, -1].argmax(-1)
            step = DecodeStep(model, StaticKVCache(cache, contexts[0], long.seq_len), depth, how, t.backend)
            start = step.state()
            step(first)  # compiles
            def run() -> float:
                step.rewind(start)
                return _timed_loop(lambda tok: step(tok).argmax(-1), step(first).argmax(-1), new - 2, device)
            return run
        return lambda: (new - 2) / decode_tokens_per_s(model, batch_size=1, context=contexts[0], new_tokens=new,
                                                       depth=depth, device=device)

    for key, a in (("decode_compile_speedup", b1(compiled)), ("decode_static_compile_speedup", b1(how="compile"))):
        iv = t.ratio(res, key, a, b1(), repeat=1)
        log(f"huginn shape: decode batch 1, {key} ×{iv['median']:.2f} [{iv['min']:.2f}, {iv['max']:.2f}] of eager")
    res["decode_b1_compiled_tokens_per_s"] = (new - 2) / res["intervals"]["decode_compile_speedup"]["a_s"]
    res["decode_b1_static_compiled_tokens_per_s"] = (new - 2) / res["intervals"]["decode_static_compile_speedup"]["a_s"]
    del compiled
    n_unc = 2 if t.quick else 4
    iv = t.ratio(res, "huginn_decode_cache_speedup", b1(),
                 lambda: _uncached(dec, torch.randint(0, long.vocab_size, (1, contexts[0] - n_unc), device=device),
                                   n_unc, depth), repeat=1, scale=(new - 2) / n_unc)
    res["huginn_decode_b1_uncached_tokens_per_s"] = n_unc / iv["b_s"]
    log(f"huginn shape: cached decoding {res['huginn_decode_cache_speedup']:.1f}× uncached recompute")


def huginn_measurements(res: dict[str, Any], t: Timing, depth: int, matmul: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Issue 15's workloads at the Huginn shape: training MFU, multi-depth evaluation, decoding, prefill, memory."""
    hcfg, device, log = huginn_config(t.quick), t.device, t.log
    B = 2 if t.quick else 16
    res.update(huginn_config={k: getattr(hcfg, k) for k in (
        "vocab_size", "d_model", "n_heads", "d_ff", "n_prelude", "n_core", "n_coda", "seq_len", "rule")},
        huginn_batch_size=B, huginn_depth=depth)
    ma, mb = matmul
    flops = B * hcfg.seq_len * 3 * flops_per_token(hcfg, depth)["body_head"]
    iv = t.ratio(res, "huginn_shape_mfu", train_step(hcfg, depth, batch_size=B, device=device), lambda: ma @ mb,
                 scale=flops / (2 * ma.shape[0] ** 3))
    res["huginn_train_tokens_per_s"] = B * hcfg.seq_len / iv["a_s"]
    log(f"huginn shape: train {res['huginn_train_tokens_per_s']:.0f} tok/s (MFU {res['huginn_shape_mfu']:.1%})")

    multidepth_measurements(res, hcfg, t, B, prefix="huginn_")
    log(f"huginn shape: multi-depth eval / FLOP-predicted {res['huginn_multidepth_flop_ratio']:.3f}, "
        f"{res['huginn_multidepth_vs_separate_speedup']:.2f}× faster than separate runs")

    contexts = (12, 16) if t.quick else (512, 2048)
    huginn_decode_measurements(res, hcfg, t, depth, contexts)
    res.update(prefill_measurements(hcfg, depth=depth, contexts=contexts, repeat=t.repeat, rounds=t.rounds,
                                    min_s=t.min_s, device=device, prefix="huginn_"))
    res["distilled_prefill_speedup"] = res[f"huginn_distilled_prefill_speedup_ctx{contexts[-1]}"]
    res["intervals"]["distilled_prefill_speedup"] = res.pop(f"huginn_prefill_rounds_ctx{contexts[-1]}")
    log(f"huginn shape: distilled prefill {res['distilled_prefill_speedup']:.2f}× faster than the teacher's at "
        f"R={depth} ({contexts[-1]}-token prompt)")

    res["peak_train_mem_bytes"] = peak_train_memory(hcfg, depth, batch_size=B, device=device)
    res["peak_train_mem_bytes_plain"] = peak_train_memory(hcfg, depth, batch_size=B, device=device, fused=False)
    res["peak_train_mem_ratio"] = res["peak_train_mem_bytes"] / max(1, res["peak_train_mem_bytes_plain"])
    res["peak_train_mem_measure"] = "max_memory_allocated" if device.type == "cuda" else "live_tensor_bytes"
    log(f"huginn shape: peak training memory {res['peak_train_mem_bytes'] / 2**20:.0f} MiB fused vs "
        f"{res['peak_train_mem_bytes_plain'] / 2**20:.0f} MiB plain readout + loss")


def machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def matmul_peaks(res: dict[str, Any], dev: torch.device, matmul_n: int) -> tuple[dict[int, list[float]], int, bool]:
    """The fp32 and bf16 matmul peaks into ``res``; returns (fp32 rates per size, peak size, slow bf16)."""
    # the peak is the best of two sizes: one size alone can land on a slow blocking of the BLAS
    rates32 = {n: matmul_rates(torch.float32, n, dev) for n in sorted({min(1024, matmul_n), matmul_n})}
    peak_n = max(rates32, key=lambda n: median_high(rates32[n]))
    peak32 = median_high(rates32[peak_n])
    # CPUs without native bf16 (no AVX512-BF16/AMX) run bf16 matmuls ~100× slower: probe a small one
    # first and keep the bf16 measurements short when it is slow.
    slow_bf16 = (dev.type == "cpu"
                 and median_high(matmul_rates(torch.bfloat16, 256, dev, repeat=1, warmup=1)) < 0.1 * peak32)
    peak16 = median_high(matmul_rates(torch.bfloat16, min(matmul_n, 512) if slow_bf16 else matmul_n, dev,
                               repeat=1 if slow_bf16 else 5, warmup=1 if slow_bf16 else 2))
    res["bf16_native"] = not slow_bf16
    res["matmul_peak_gflops"] = {"float32": peak32, "bfloat16": peak16}
    return rates32, peak_n, slow_bf16


def stability(rates: list[float], end: float, n: int) -> dict[str, Any]:
    """Whether the fp32 matmul rate held: its spread at the start and its drift to ``end`` within :data:`MAX_SPREAD`."""
    start = median_high(rates)
    drift = abs(end - start) / max(end, start)
    spread = (max(rates) - min(rates)) / start if start > 0 else math.inf  # (max − min) / median
    return {"matmul_n": n, "matmul_fp32_rates_gflops": rates, "matmul_fp32_spread": spread,
            "matmul_fp32_peak_end_gflops": end, "matmul_fp32_drift": drift, "max_spread": MAX_SPREAD,
            "stable": spread <= MAX_SPREAD and drift <= MAX_SPREAD}


def training_ratios(res: dict[str, Any], cfg: ModelConfig, t: Timing, depth: int, *, batch_size: int,
                    matmul: tuple[torch.Tensor, torch.Tensor], slow_bf16: bool) -> None:
    """``mfu``, ``bf16_train_speedup``, ``train_compile_speedup`` (compiled blocks, ``backend``, over eager; its MFU
    ``mfu_compiled`` = ``mfu`` × the speed-up), ``loop_overhead_ratio``, ``scse_vs_looped_ratio`` into ``res``
    (interleaved)."""
    device, log = t.device, t.log
    # MFU: training FLOP rate over the matmul's, A/B/B/A: (F_train / F_matmul) × t_matmul / t_train
    ma, mb = matmul
    tokens = batch_size * cfg.seq_len
    model_flops = 3 * flops_per_token(cfg, depth)["body_head"]  # forward + backward ≈ 3 × forward
    fp32 = train_step(cfg, depth, batch_size=batch_size, device=device)
    iv = t.ratio(res, "mfu", fp32, lambda: ma @ mb, scale=tokens * model_flops / (2 * ma.shape[0] ** 3))
    res["train_tokens_per_s"] = tokens / iv["a_s"]
    res["train_model_flops_per_token"] = model_flops
    bf16 = train_step(cfg, depth, batch_size=batch_size, device=device, dtype="bfloat16")
    iv = t.ratio(res, "bf16_train_speedup", bf16, fp32, repeat=1 if slow_bf16 else t.repeat)
    res["train_tokens_per_s_bf16"] = tokens / iv["a_s"]
    log(f"train: {res['train_tokens_per_s']:.0f} tok/s fp32 (MFU {res['mfu']:.1%}), "
        f"{res['train_tokens_per_s_bf16']:.0f} tok/s bf16")
    iv = t.ratio(res, "train_compile_speedup",
                 train_step(cfg, depth, batch_size=batch_size, device=device, backend=t.backend),
                 fp32)  # the untimed warm-up call compiles
    res["train_tokens_per_s_compiled"] = tokens / iv["a_s"]
    res["mfu_compiled"] = res["mfu"] * iv["median"]
    log(f"train: compiled blocks ×{iv['median']:.2f} of eager (MFU {res['mfu_compiled']:.1%})")

    looped = train_step(cfg.replace(rule="looped"), depth, batch_size=batch_size, device=device)
    unshared = train_step(cfg.replace(architecture="unshared", n_layers=depth), depth, batch_size=batch_size,
                          device=device)
    t.ratio(res, "loop_overhead_ratio", looped, unshared)
    t.ratio(res, "scse_vs_looped_ratio", fp32, looped)
    log(f"looped / unshared-{depth} {res['loop_overhead_ratio']:.3f}; scse/looped {res['scse_vs_looped_ratio']:.3f}")


def run_bench(*, preset: str = "cpu", depth: int = 8, batch_size: int = 16, steps: int = 5, matmul_n: int = 2048,
              device: str = "auto", quick: bool = False, rounds: int = 3, progress: bool = True) -> dict[str, Any]:
    """Run every measurement; returns the JSON-ready results (with ``targets`` and ``markdown``).

    Args:
        preset: the model measured (a preset name: its model section)
        depth: the loop depth T of the training, overhead and decoding figures
        batch_size: rows per step of the preset's training, multi-depth and TBPTT-memory figures (the Huginn-shape
            figures use 16)
        steps: calls per variant in each quarter of an interleaved round of the training and multi-depth ratios
            (decoding, prefill and multi-depth against separate runs: 1); a side whose calls are short runs more,
            as many as last 1 s (MIN_QUARTER_S; not with quick)
        matmul_n: side of the square matmuls that measure the fp32 and bf16 peaks (fp32: also 1024 when larger,
            the best kept)
        device: cpu, cuda or auto
        quick: toy shapes, one round (a smoke test; its values mean nothing)
        rounds: interleaved A/B/B/A rounds per timed ratio
    """
    if quick:
        preset, depth, batch_size, steps, matmul_n, rounds = "debug", min(depth, 2), 2, 1, 64, 1
    dev = resolve_device(device, "--device")
    cfg = get_preset(preset).model.replace(dropout=0.0)
    t = Timing(dev, rounds, steps, min_s=0.0 if quick else MIN_QUARTER_S,
               backend="aot_eager" if quick else "inductor", quick=quick,
               log=print if progress else (lambda *a, **k: None))
    log = t.log
    res: dict[str, Any] = {"machine": machine(), "device": str(dev), "preset": preset, "depth": depth,
                           "batch_size": batch_size, "seq_len": cfg.seq_len, "min_quarter_s": t.min_s}
    rates32, peak_n, slow_bf16 = matmul_peaks(res, dev, matmul_n)
    log(f"matmul peak: fp32 {res['matmul_peak_gflops']['float32']:.1f} GFLOP/s, bf16 "
        f"{res['matmul_peak_gflops']['bfloat16']:.1f} GFLOP/s")

    res["intervals"] = {}
    ma, mb = torch.randn(peak_n, peak_n, device=dev), torch.randn(peak_n, peak_n, device=dev)
    training_ratios(res, cfg, t, depth, batch_size=batch_size, matmul=(ma, mb), slow_bf16=slow_bf16)
    multidepth_measurements(res, cfg, t, batch_size)
    log(f"multi-depth eval {res['multidepth_eval_s']:.3f}s vs deepest only {res['multidepth_single_s']:.3f}s vs "
        f"separate {res['multidepth_separate_s']:.3f}s per batch; vs its FLOP-predicted time "
        f"×{res['multidepth_flop_ratio']:.3f}")

    res.update(tbptt_measurements(cfg, batch_size=batch_size, device=dev))
    log(f"TBPTT b={res['tbptt_window']} at T={res['tbptt_depth']} vs full at T={res['tbptt_short_depth']}: "
        f"memory ×{res['tbptt_peak_mem_ratio']:.3f}")
    decode_measurements(res, cfg, t, depth)
    log(f"decode T={depth}, 512 context: per_visit {res['decode_tokens_per_s_per_visit']:.1f} tok/s, terminal "
        f"{res['decode_tokens_per_s_terminal']:.1f} tok/s, uncached {res['decode_tokens_per_s_uncached']:.1f} tok/s; "
        f"KV bytes terminal/per_visit {res['terminal_kv_bytes_ratio']:.4f}")
    huginn_measurements(res, t, depth, (ma, mb))

    st = res["stability"] = stability(rates32[peak_n], median_high(matmul_rates(torch.float32, peak_n, dev)), peak_n)
    log(f"fp32 matmul rate: spread {st['matmul_fp32_spread']:.1%} between repeats, "
        f"{st['matmul_fp32_drift']:.1%} start vs end ({'stable' if st['stable'] else 'UNSTABLE'})")

    expected = {"terminal_kv_bytes_ratio": 1.0 / depth if cfg.n_prelude == cfg.n_coda == 0 else None}
    wanted = {k: (op, expected.get(k, v)) for k, (op, v) in TARGETS.items()}
    res["targets"] = judge_targets(res, {k: t for k, t in wanted.items() if t[1] is not None})
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
             f"| training tokens/s (fp32, compiled blocks) and its MFU | {res['train_tokens_per_s_compiled']:.0f}; "
             f"{res['mfu_compiled']:.1%} |",
             f"| multi-depth eval vs separate runs | {res['multidepth_vs_separate_speedup']:.2f}× faster |",
             f"| activation bytes: TBPTT T={res['tbptt_depth']} b={res['tbptt_window']} / full T="
             f"{res['tbptt_short_depth']} / full T={res['tbptt_depth']} | {res['tbptt_mem_bytes_truncated']:,} / "
             f"{res['tbptt_mem_bytes_full_short']:,} / {res['tbptt_mem_bytes_full_deep']:,} |",
             f"| decoding tokens/s (decode phase) at T={res['decode_depth']}, {res['decode_context']}-token context: "
             f"per_visit / terminal / uncached | {res['decode_tokens_per_s_per_visit']:.1f} / "
             f"{res['decode_tokens_per_s_terminal']:.1f} / {res['decode_tokens_per_s_uncached']:.1f} |",
             f"| the same with the prompt's prefill counted (per_visit / terminal); cached vs uncached | "
             f"{res['decode_tokens_per_s_with_prefill_per_visit']:.1f} / "
             f"{res['decode_tokens_per_s_with_prefill_terminal']:.1f}; "
             f"{res['decode_cache_speedup_with_prefill']:.2f}× |",
             f"| KV bytes per_visit / terminal | {res['kv_bytes_per_visit']:,} / {res['kv_bytes_terminal']:,} |",
             f"| multi-depth eval: measured / FLOP-predicted time (preset; Huginn shape) | "
             f"{res['multidepth_flop_ratio']:.3f}; {res['huginn_multidepth_flop_ratio']:.3f} |",
             f"| Huginn shape: training tokens/s (fp32, B={res['huginn_batch_size']}, T={res['huginn_depth']}) | "
             f"{res['huginn_train_tokens_per_s']:.0f} |",
             f"| Huginn shape: peak training-step bytes ({res['peak_train_mem_measure']}) fused / plain readout + "
             f"loss | {res['peak_train_mem_bytes']:,} / {res['peak_train_mem_bytes_plain']:,} |",
             *[f"| Huginn shape: decode tokens/s, batch {g[1]}, {g[2]}-token context | {res[k]:.1f} |"
               for k in sorted(res) if (g := re.fullmatch(r"huginn_decode_b(\d+)_ctx(\d+)_tokens_per_s", k))],
             f"| Huginn shape: decode batch 1 with compiled blocks (torch.compile) tokens/s | "
             f"{res['decode_b1_compiled_tokens_per_s']:.1f} |",
             f"| Huginn shape: decode batch 1 with the compiled static step (DecodeStep) tokens/s | "
             f"{res['decode_b1_static_compiled_tokens_per_s']:.1f} |",
             f"| Huginn shape: decode batch 1 uncached recompute tokens/s | "
             f"{res['huginn_decode_b1_uncached_tokens_per_s']:.2f} |",
             "", *prefill_markdown(res, "huginn_"),
             "", "| target | median [min, max] of the interleaved rounds | per-round ratios | calls per quarter A / B "
             "| target | status |", "|---|---:|---|---:|---:|:---:|"]
    for k, t in res["targets"].items():
        iv = res.get("intervals", {}).get(k)
        span = f" [{iv['min']:.3f}, {iv['max']:.3f}]" if iv else ""
        per_round = ", ".join(f"{r:.3f}" for r in iv["rounds"]) if iv else "(not timed)"
        calls = " / ".join(map(str, iv["calls"])) if iv and "calls" in iv else ""
        lines.append(f"| `{k}` | {t['value']:.3f}{span} | {per_round} | {calls} | {t['op']} {t['target']} | "
                     f"{t['status']} |")
    if (st := res.get("stability")) is not None:
        lines += ["", "Status rule: a ratio measured in interleaved A/B/B/A rounds is `met` only when every round's "
                  "ratio is on the target's side, `not met` when every one is on the other side, `undecided` "
                  f"otherwise; `invalid` = impossible value (MFU > 1, or not finite); `unstable` = a timed "
                  f"target of a run whose fp32 matmul rate moved by more than {st['max_spread']:.0%} (max − min "
                  f"over the median of the {len(st['matmul_fp32_rates_gflops'])} repeats: "
                  f"{st['matmul_fp32_spread']:.1%}; peak at the end vs the start: {st['matmul_fp32_drift']:.1%}) — "
                  f"rerun on a quiet machine. This run: {'stable' if st['stable'] else 'unstable'}."]
    return "\n".join(lines)

