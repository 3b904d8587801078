"""Plots (matplotlib, Agg backend): PPL against loop depth on a log2 axis (SCSE Figure 3 style),
per model (:func:`plot_ppl_vs_depth`) or as seed mean ± std bands (:func:`plot_mean_std_vs_depth`)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Lay out ``fig``, save it as a 120-dpi PNG at ``path`` (parent folders created), close it; returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _depth_axes(ax, curves: Mapping[str, Mapping[int, object]], ylabel: str, title: str, log_y: bool = True):
    """Log2 x axis ticked at every T of ``curves`` (log y); labels, grid and legend."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    depths = sorted({t for curve in curves.values() for t in curve})
    ax.set_xticks(depths, [str(t) for t in depths])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("loop depth T (log2)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def plot_ppl_vs_depth(panels: Mapping[str, Mapping[str, Mapping[int, float]]], path: str | Path, *,
                      train_range: tuple[int, int] | None = None,
                      baselines: Mapping[str, Mapping[str, float]] | None = None, title: str = "") -> Path:
    """One panel per split ({title: {model: {T: ppl}}}), PPL against T (log2); ``train_range`` shaded,
    ``baselines`` ({title: {label: ppl}}) dashed."""
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.0), squeeze=False)
    for ax, (ptitle, models) in zip(axes[0], panels.items()):
        for name, curve in models.items():
            ts = sorted(curve)
            ax.plot(ts, [curve[t] for t in ts], marker="o", label=name)
        for label, value in (baselines or {}).get(ptitle, {}).items():
            ax.axhline(value, linestyle="--", color="gray", linewidth=1, label=f"{label} ({value:.0f})")
        if train_range:
            ax.axvspan(train_range[0], train_range[1], color="tab:green", alpha=0.08, label="training depths")
        _depth_axes(ax, models, "perplexity", ptitle)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def plot_mean_std_vs_depth(curves: Mapping[str, Mapping[int, tuple[float, float]]], path: str | Path, *,
                           title: str = "", ylabel: str = "perplexity", log_y: bool = True,
                           train_range: tuple[int, int] | None = None) -> Path:
    """One line per variant ({label: {T: (mean, std)}}): the seed mean against T (log2) with a ±std band."""
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    for label, curve in curves.items():
        ts = sorted(curve)
        if not ts:
            continue
        mean = [curve[t][0] for t in ts]
        std = [0.0 if curve[t][1] != curve[t][1] else curve[t][1] for t in ts]  # NaN (one seed) → no band
        (line,) = ax.plot(ts, mean, marker="o", label=label)
        lo = [m - s for m, s in zip(mean, std)]
        if log_y:  # keep the band on the positive axis
            lo = [max(v, m * 1e-3) for v, m in zip(lo, mean)]
        ax.fill_between(ts, lo, [m + s for m, s in zip(mean, std)], color=line.get_color(), alpha=0.2,
                        linewidth=0)
    if train_range:
        ax.axvspan(train_range[0], train_range[1], color="gray", alpha=0.1, label="training depths")
    _depth_axes(ax, curves, ylabel, title, log_y)
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 450, not 4.5×10^2
    ax.yaxis.set_major_formatter(plain)
    lo, hi = ax.get_ylim()
    if log_y and hi / lo < 10:  # within one decade the minor ticks are the only labels
        ax.yaxis.set_minor_formatter(plain)
    return save_figure(fig, path)
