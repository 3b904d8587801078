"""Exact-match accuracy by loop depth × difficulty on a synthetic task (``looplm eval tasks``; issue 24 §1).

For each difficulty k the held-out instances (:func:`looplm.tasks.data.heldout`) are scored at every
requested depth from one unroll per batch (:func:`looplm.tasks.data.accuracy_by_depth`). k beyond the
training range ``data.task_k`` tests depth extrapolation; k within it, held-out instances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from looplm.tasks.data import accuracy_by_depth, heldout, rows
from looplm.tasks.base import get_task
from looplm.run.checkpoint import load_checkpoint


def task_accuracy(model, data_cfg, ks: Sequence[int], depths: Sequence[int], *, split: str = "test",
                  max_examples: int | None = None, batch_size: int = 64, device: str | torch.device = "cpu",
                  progress: bool = False) -> dict[int, dict[int, dict[str, float]]]:
    """``{k: {T: {"acc", "correct", "n", "nll"}}}`` on the held-out ``split`` instances of each k
    (the first ``max_examples`` of them when given)."""
    out = {}
    for k in tqdm(ks, desc=f"{data_cfg.task} k", disable=not progress, leave=False):
        insts = list(heldout(data_cfg.task, k, split, data_cfg.task_heldout, data_cfg.task_seed))[:max_examples]
        out[k] = accuracy_by_depth(model, *rows(insts, model.cfg.seq_len), list(depths), batch_size=batch_size,
                                   device=device)
    return out


def default_ks(data_cfg) -> list[int]:
    """Difficulties evaluated by default: 1 … 2 × data.task_k (depth extrapolation), at most the family's max_k."""
    return list(range(1, min(2 * data_cfg.task_k, get_task(data_cfg.task).max_k) + 1))


def markdown_table(acc: dict[int, dict[int, dict[str, float]]], k_train: int, title: str = "") -> str:
    """Accuracy (%) with one row per depth T and one column per k (k > k_train marked *)."""
    ks = sorted(acc)
    depths = sorted(next(iter(acc.values())))
    head = "| T \\ k | " + " | ".join(f"{k}{'*' if k > k_train else ''}" for k in ks) + " |"
    lines = [f"**{title}**", ""] if title else []
    lines += [head, "|---|" + "---:|" * len(ks)]
    lines += [f"| {T} | " + " | ".join(f"{100 * acc[k][T]['acc']:.1f}" for k in ks) + " |" for T in depths]
    lines += ["", f"exact-match accuracy (%) on held-out instances; * = k beyond training (k_train = {k_train})"]
    return "\n".join(lines)


def plot_heatmap(acc: dict[int, dict[int, dict[str, float]]], path: str | Path, *, k_train: int,
                 train_depth: int, title: str = "") -> Path:
    """A heatmap PNG of accuracy: depth T (rows) × difficulty k (columns); dashed lines mark k_train and
    the largest training depth."""
    from looplm.analysis.plots import plt, save_figure

    ks, depths = sorted(acc), sorted(next(iter(acc.values())))
    grid = [[100 * acc[k][T]["acc"] for k in ks] for T in depths]
    fig, ax = plt.subplots(figsize=(0.55 * len(ks) + 2.5, 0.4 * len(depths) + 1.8))
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white" if v < 60 else "black")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(depths)), [str(T) for T in depths])
    if k_train in ks:
        ax.axvline(ks.index(k_train) + 0.5, color="red", linestyle="--", linewidth=1)
    if train_depth in depths:
        ax.axhline(depths.index(train_depth) + 0.5, color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("difficulty k (steps)")
    ax.set_ylabel("loop depth T")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="exact match (%)")
    return save_figure(fig, path)


def evaluate_task_checkpoint(checkpoint: str | Path, *, depths: Sequence[int] | None = None,
                             ks: Sequence[int] | None = None, split: str = "test", max_examples: int | None = None,
                             batch_size: int = 64, device: str = "cpu", progress: bool = True,
                             plot: str | Path | None = None) -> dict[str, Any]:
    """Accuracy by depth × k of a checkpoint trained on a task (``data.dataset=task``).

    Args:
        depths: loop depths T (default 1 … 2 × the largest training depth).
        ks: difficulties (default 1 … 2 × data.task_k, at most the family's max_k).
        split: held-out split, test or valid.
        max_examples: instances per k (default: all ``data.task_heldout``).
        plot: also write the heatmap PNG here.

    Returns:
        JSON-ready dict: ``checkpoint``, ``task``, ``k_train``, ``train_depth``, ``split``, ``accuracy``
        → ``{"k": {"T": {"acc", "correct", "n", "nll"}}}``, ``markdown``, and ``plot`` when written.

    Raises:
        CheckpointError: damaged or missing checkpoint. ValueError: a checkpoint not trained on a task,
        a k outside 1 … the family's max_k, or instances longer than model.seq_len.
    """
    model, cfg, _, ckpt = load_checkpoint(checkpoint, device=device)
    data = cfg.data
    if data.dataset != "task":
        raise ValueError(f"--checkpoint: {ckpt} was trained on data.dataset={data.dataset}; this protocol needs "
                         "data.dataset=task")
    family = get_task(data.task)
    ks = list(ks or default_ks(data))
    for k in ks:
        family.check_k(k, "--ks")
    train_depth = cfg.depth.max_depth()
    depths = sorted(set(depths or range(1, 2 * train_depth + 1)))
    acc = task_accuracy(model, data, ks, depths, split=split, max_examples=max_examples, batch_size=batch_size,
                        device=torch.device(device), progress=progress)
    title = f"{cfg.name}: {cfg.model.rule} on {data.task} (train k <= {data.task_k}, T <= {train_depth}; {split})"
    result = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule, "task": data.task,
              "k_train": data.task_k, "train_depth": train_depth, "split": split, "params": model.num_params(),
              "accuracy": {str(k): {str(T): r for T, r in by_T.items()} for k, by_T in acc.items()},
              "markdown": markdown_table(acc, data.task_k, title)}
    if plot is not None:
        result["plot"] = str(plot_heatmap(acc, plot, k_train=data.task_k, train_depth=train_depth, title=title))
    return result
