"""Plots (matplotlib, Agg backend): PPL against loop depth on a log2 axis (SCSE Figure 3 style)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_ppl_vs_depth(panels: Mapping[str, Mapping[str, Mapping[int, float]]], path: str | Path, *,
                      train_range: tuple[int, int] | None = None,
                      baselines: Mapping[str, Mapping[str, float]] | None = None, title: str = "") -> Path:
    """One panel per evaluation split, one line per model: PPL against loop depth T (log2 x-axis).

    Args:
        panels: {panel title: {model name: {T: ppl}}}.
        path: output PNG path.
        train_range: (lo, hi) training depths, shaded.
        baselines: {panel title: {label: ppl}} drawn as dashed horizontal lines (e.g. unigram).
    """
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
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("loop depth T (log2)")
        ax.set_ylabel("perplexity")
        ax.set_title(ptitle)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
