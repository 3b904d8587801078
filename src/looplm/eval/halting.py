"""Adaptive depth with logit-margin halting (the readout-blind-spot paper §6, Appendix H; no arXiv id; SPEC §6).

Per window b and loop k = 1 … K_max: margin_k(b) = mean over its tokens of top-1 − top-2 of the loop-k logits,
halt(b) = min({k < K_max : margin_k(b) ≥ τ} ∪ {K_max}), scored at its halting loop. (1) Calibration
(``n_calib`` windows, :func:`~looplm.eval.exits.trace`): the smallest τ whose dynamic PPL ≤ (1 + tolerance) ×
PPL(K_max). (2) Timed run (``n_timed`` disjoint windows): dynamic batching (:func:`~looplm.eval.exits.run`,
halted rows leave the batch) against every fixed depth (:func:`fixed_depth_run`); speedup = static / dynamic
seconds. (3) Frontier: (tokens/s, PPL) per K.

Choices (ours): full non-overlapping windows (timed after calibration ones on one split); inference mode,
batches prebuilt on the device, one untimed warm-up batch per mode, the median of ``repeats`` interleaved passes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from looplm.data.tokens import eval_windows
from looplm.eval.exits import (EXIT_CRITERIA, Batch, build_exit_criterion, calibrate, run, split_batches,
                               sync_device, trace)
from looplm.model import DepthLM, eval_mode
from looplm.model.cursor import NLL
from looplm.run.finite import md_table, write_json_markdown

DEFAULT_N_CALIB = 160
DEFAULT_N_TIMED = 160
DEFAULT_TOLERANCE = 0.01  # dynamic PPL within 1% of K_max (readout blind spot, Appendix H)


def make_windows(tokens: np.ndarray, seq_len: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full windows ``first … first + n − 1`` as (x, y), each (n, L) int64; ValueError when too few."""
    available = (len(tokens) - 1) // seq_len
    if n < 1 or first + n > available:
        raise ValueError(f"need {n} full windows of {seq_len} tokens from window {first}, but the split holds "
                         f"{available} (lower n_calib / n_timed)")
    part = tokens[first * seq_len: (first + n) * seq_len + 1]
    x, y, mask = next(eval_windows(part, seq_len, n))
    assert x.shape == (n, seq_len) and bool(mask.all())
    return x, y


@torch.inference_mode()
def fixed_depth_run(model: DepthLM, batches: Sequence[Batch], depth: int, *,
                    progress: bool = False, scale_clamp: bool = False) -> tuple[np.ndarray, float]:
    """``(nll, seconds)``: (N,) summed NLL (nats) of every window at depth K, and the wall time."""
    device = batches[0][0].device
    nlls = []
    sync_device(device)
    t0 = time.perf_counter()
    for x, y, _ in tqdm(batches, desc=f"fixed K={depth}", disable=not progress, leave=False, unit="batch"):
        out = model.read(model.loop(x, scale_clamp=scale_clamp), depth, y, readout=NLL)
        nlls.append(out.nll_by_depth[depth].double().sum(dim=1))
    sync_device(device)
    seconds = time.perf_counter() - t0
    return torch.cat(nlls).cpu().numpy(), seconds


def _counts(loops: np.ndarray) -> dict[str, int]:
    return {str(int(k)): int(n) for k, n in zip(*np.unique(loops, return_counts=True))}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def halting_eval(model: DepthLM, calib: tuple[torch.Tensor, torch.Tensor], timed: tuple[torch.Tensor, torch.Tensor],
                 k_max: int, *, batch_size: int = 16, tolerance: float = DEFAULT_TOLERANCE, repeats: int = 3,
                 device: str | torch.device = "cpu", progress: bool = True,
                 criterion: str = "margin", scale_clamp: bool = False) -> dict[str, Any]:
    """Calibrate τ on ``calib`` windows ((x, y), each (N, L)), then time dynamic halting and every fixed depth
    on ``timed``; JSON-ready (τ = ∞ as null). ValueError: k_max, batch_size or repeats < 1, empty windows."""
    if k_max < 1 or batch_size < 1 or repeats < 1:
        raise ValueError(f"k_max, batch_size and repeats must be >= 1, got {k_max}, {batch_size}, {repeats}")
    if len(calib[0]) == 0 or len(timed[0]) == 0:
        raise ValueError("calibration and timed windows must be non-empty")
    if criterion not in EXIT_CRITERIA:
        raise ValueError(f"criterion: unknown {criterion!r}; known: {', '.join(sorted(EXIT_CRITERIA))}")
    direction = EXIT_CRITERIA[criterion].direction
    device = torch.device(device)
    with eval_mode(model):
        tr = trace(model, split_batches(*calib, batch_size, device), build_exit_criterion(criterion, 0.0), k_max,
                   progress=progress, desc="calibration trace", scale_clamp=scale_clamp)
        cal = calibrate(tr.scores, direction, tolerance=tolerance, nll=tr.nll, tokens=tr.tokens)
        batches, crit = split_batches(*timed, batch_size, device), build_exit_criterion(criterion, cal.tau)
        # r = -1: untimed warm-ups on one batch; repeats interleave the modes, so slow drift (clocks, other
        # load) hits them alike
        seconds: dict[int, list[float]] = {K: [] for K in range(k_max + 1)}  # per fixed K; 0: the dynamic run
        fixed_nll: dict[int, np.ndarray] = {}
        for r in range(-1, repeats):
            part, show = (batches if r >= 0 else batches[:1]), progress and r == 0
            dyn = run(model, part, crit, k_max, progress=show, desc="dynamic halting", scale_clamp=scale_clamp)
            seconds[0].append(dyn.seconds)
            for K in range(1, k_max + 1):
                fixed_nll[K], secs = fixed_depth_run(model, part, K, progress=show, scale_clamp=scale_clamp)
                seconds[K].append(secs)
    n_tokens = int(dyn.tokens.sum())
    med = {K: float(np.median(s[1:])) for K, s in seconds.items()}  # median seconds per mode
    dyn_seconds = med[0]
    frontier = [{"k": K, "ppl": math.exp(fixed_nll[K].sum() / n_tokens), "seconds": med[K],
                 "tokens_per_s": n_tokens / med[K]} for K in range(1, k_max + 1)]
    static = frontier[-1]
    dyn_ppl = dyn.ppl()
    N = len(timed[0])
    return {
        "criterion": criterion, "scale_clamp": scale_clamp, "k_max": k_max, "tolerance": tolerance,
        "batch_size": batch_size, "repeats": repeats, "device": str(device), "seq_len": int(calib[0].shape[1]),
        "calibration": {
            "sequences": len(tr.tokens), "tokens": int(tr.tokens.sum()), "tau": _finite(cal.tau),
            "halts_early": math.isfinite(cal.tau), "candidates": len(cal.taus),
            "mean_loops": cal.mean_depth, "ppl_dynamic": cal.ppl, "ppl_kmax": cal.ppl_max,
            "ppl_ratio": cal.ppl / cal.ppl_max, "ppl_budget": (1.0 + tolerance) * cal.ppl_max,
            "ppl_by_k": {str(k): math.exp(tr.nll[:, k - 1].sum() / tr.tokens.sum()) for k in range(1, k_max + 1)},
            "loop_counts": _counts(cal.depths),
            "sweep": {"tau": [_finite(float(t)) for t in cal.taus], "ppl": cal.ppl_by_tau.tolist(),
                      "mean_loops": cal.mean_depth_by_tau.tolist()},
        },
        "timed": {
            "sequences": N, "tokens": n_tokens,
            "dynamic": {"seconds": dyn_seconds, "tokens_per_s": n_tokens / dyn_seconds, "ppl": dyn_ppl,
                        "mean_loops": float(dyn.depth.mean()), "row_loops": dyn.row_steps,
                        "loop_counts": _counts(dyn.depth)},
            "static": {"k": k_max, "seconds": static["seconds"], "tokens_per_s": static["tokens_per_s"],
                       "ppl": static["ppl"], "mean_loops": float(k_max), "row_loops": N * k_max},
            "speedup": static["seconds"] / dyn_seconds, "ppl_ratio": dyn_ppl / static["ppl"],
        },
        "frontier": frontier,
    }


def markdown_report(res: dict[str, Any], label: str = "model") -> str:
    """Markdown: calibration summary and the timed table (dynamic, then fixed K = 1 … K_max)."""
    cal, tm = res["calibration"], res["timed"]
    tau = "∞ (never halts early)" if cal["tau"] is None else f"{cal['tau']:.4g}"
    dyn, static_s = tm["dynamic"], tm["static"]["seconds"]
    lines = [
        ("## Logit-margin halting" if res.get("criterion", "margin") == "margin"
         else f"## Halting ({res['criterion']} criterion)") + f": {label}", "",
        f"K_max = {res['k_max']}, tolerance {100 * res['tolerance']:.3g}%, batch {res['batch_size']}, "
        f"L = {res['seq_len']}, device {res['device']}, median of {res['repeats']} timed passes.", "",
        f"Calibration ({res.get('split_calib', 'calib')}, {cal['sequences']} sequences, {cal['tokens']} tokens): "
        f"τ = {tau}; mean loops {cal['mean_loops']:.2f}; dynamic PPL {cal['ppl_dynamic']:.3f} vs "
        f"K_max PPL {cal['ppl_kmax']:.3f} (ratio {cal['ppl_ratio']:.4f}).", "",
        f"Timed ({res.get('split_timed', 'timed')}, {tm['sequences']} sequences, {tm['tokens']} tokens): "
        f"speedup {tm['speedup']:.2f}× over always K_max; PPL ratio {tm['ppl_ratio']:.4f}.", "",
    ]

    def cells(p: dict[str, Any]) -> list[str]:
        return [f"{p['ppl']:.3f}", f"{p['seconds']:.3f}", f"{p['tokens_per_s']:.0f}",
                f"{static_s / p['seconds']:.2f}×"]

    rows = [[f"dynamic (τ = {tau})", f"{dyn['mean_loops']:.2f}", *cells(dyn)],
            *([f"fixed K = {p['k']}", str(p["k"]), *cells(p)] for p in res["frontier"])]
    return "\n".join(lines + md_table(["run", "mean loops", "PPL", "seconds", "tokens/s", "speedup vs K_max"], rows,
                                      align="l" + "r" * 5))


def plot_frontier(res: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Two panels: PPL vs tokens/s (fixed K and dynamic), and dynamic PPL vs mean loops over the τ candidates."""
    from looplm.analysis.plots import plt, save_figure

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.4, 4.0))
    fr = res["frontier"]
    ax.plot([p["tokens_per_s"] for p in fr], [p["ppl"] for p in fr], marker="o", label="fixed K")
    for p in fr:
        ax.annotate(f"K={p['k']}", (p["tokens_per_s"], p["ppl"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    dyn = res["timed"]["dynamic"]
    ax.scatter([dyn["tokens_per_s"]], [dyn["ppl"]], marker="*", s=160, color="tab:red", zorder=3,
               label=f"dynamic (mean loops {dyn['mean_loops']:.2f})")
    ax.set(xlabel="measured throughput (tokens/s)", ylabel="perplexity (timed slice)", title="PPL–throughput frontier")
    cal = res["calibration"]
    ax2.plot(cal["sweep"]["mean_loops"], cal["sweep"]["ppl"], marker=".", linestyle="-", label="τ sweep")
    ax2.axhline(cal["ppl_budget"], linestyle="--", color="gray", linewidth=1,
                label=f"budget {1 + res['tolerance']:.3g}× PPL(K_max)")
    ax2.scatter([cal["mean_loops"]], [cal["ppl_dynamic"]], marker="*", s=160, color="tab:red", zorder=3,
                label="chosen τ")
    ax2.set(xlabel="mean loops (calibration slice)", ylabel="dynamic perplexity (calibration slice)",
            title="τ calibration")
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def evaluate_halting_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, *, k_max: int | None = None,
                                split_calib: str = "valid", split_timed: str = "test",
                                n_calib: int = DEFAULT_N_CALIB, n_timed: int = DEFAULT_N_TIMED,
                                batch_size: int = 16, tolerance: float = DEFAULT_TOLERANCE, repeats: int = 3,
                                dataset: str | None = None, device: str = "cpu",
                                progress: bool = True, criterion: str = "margin",
                                scale_clamp: bool = False) -> dict[str, Any]:
    """Halting of a checkpoint by ``criterion`` (module docstring): the first ``n_calib`` full windows of
    ``split_calib`` calibrate, the first ``n_timed`` of ``split_timed`` (after those on one split) are timed.
    Writes ``out_dir/halting.json``, ``halting.md`` and ``halting_frontier.png``.

    Args:
        k_max: the deepest loop (default: the checkpoint's training depth)
        split_calib: the split that calibrates τ
        split_timed: the split that is timed
        tolerance: τ is the earliest-halting threshold whose calibration PPL is ≤ (1 + tolerance) × the PPL at k_max
        n_calib: windows of the calibration split
        n_timed: windows of the timed split
        repeats: interleaved timed passes per mode (the median is kept)
    """
    from looplm.eval.runner import open_checkpoint
    from looplm.run.provenance import tokens_sha256

    opened = open_checkpoint(ckpt_dir, dataset=dataset, device=device)
    model, cfg, ckpt, data_cfg = opened.model, opened.cfg, opened.ckpt, opened.data
    k_max = cfg.depth.nominal_depth() if k_max is None else int(k_max)
    L = cfg.model.seq_len
    calib_tokens, timed_tokens = opened.tokens(split_calib), opened.tokens(split_timed)
    calib = make_windows(calib_tokens, L, 0, n_calib)
    first_timed = n_calib if split_timed == split_calib else 0
    timed = make_windows(timed_tokens, L, first_timed, n_timed)
    res = halting_eval(model, calib, timed, k_max, batch_size=batch_size, tolerance=tolerance, repeats=repeats,
                       device=device, progress=progress, criterion=criterion, scale_clamp=scale_clamp)
    res = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
           "architecture": cfg.model.architecture, "readout": cfg.model.readout,
           "dataset": data_cfg.dataset, "params": model.num_params(), "split_calib": split_calib,
           "split_timed": split_timed, "first_timed_window": first_timed, **res,
           "provenance": opened.provenance(timed_tokens, calib_tokens_sha256=tokens_sha256(calib_tokens))}
    label = f"{cfg.name} ({res['rule']}, readout {res['readout']}, {data_cfg.dataset})"
    res["markdown"] = markdown_report(res, label)
    out = Path(out_dir)  # created by save_figure
    files = {"json": out / "halting.json", "markdown": out / "halting.md", "plot": out / "halting_frontier.png"}
    plot_frontier(res, files["plot"], title=label)
    res["files"] = {k: str(v) for k, v in files.items()}
    write_json_markdown(res, files["json"])
    return res
