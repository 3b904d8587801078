"""Exact-match accuracy by loop depth × difficulty on a synthetic task (``looplm eval tasks``; issue 24 §1).

The held-out instances of each difficulty k are scored at every depth from one unroll per batch; k beyond
``data.task_k`` tests depth extrapolation.

Halting depth per k (:func:`task_halting`): each instance runs the early-exit runner, the statistic over its
answer tokens (teacher-forced), scored at its halting depth D. Per k: mean D̄, exact match at halting, and at
the compute-matched fixed depth acc(⌊D̄⌋) + (D̄ − ⌊D̄⌋)·(acc(⌈D̄⌉) − acc(⌊D̄⌋)) (our choice). τ is given, or
calibrated on the ``valid`` instances of k = 1 … data.task_k: to a target mean depth (SCSE, arXiv:2607.27656,
Tables 9–10) or to an answer-NLL tolerance (the readout blind spot, Appendix H).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from looplm.eval.exits import (EXIT_CRITERIA, ExitCriterion, build_exit_criterion, calibrate, exit_loop,
                               split_batches, trace)
from looplm.model import eval_mode
from looplm.tasks.data import accuracy_by_depth, heldout, rows
from looplm.tasks.base import get_task
from looplm.run.checkpoint import load_checkpoint
from looplm.run.finite import md_table
from looplm.run.provenance import provenance


def task_accuracy(model, data_cfg, ks: Sequence[int], depths: Sequence[int], *, split: str = "test",
                  max_examples: int | None = None, batch_size: int = 64, device: str | torch.device = "cpu",
                  progress: bool = False) -> dict[int, dict[int, dict[str, float]]]:
    """``{k: {T: {"acc", "correct", "n", "nll"}}}`` on the held-out ``split`` instances of each k
    (the first ``max_examples`` of them when given)."""
    out = {}
    for k in tqdm(ks, desc=f"{data_cfg.task} k", disable=not progress, leave=False):
        insts = list(heldout(data_cfg.task, k, split, data_cfg.task_heldout, data_cfg.task_seed))[:max_examples]
        out[k] = accuracy_by_depth(model, *rows(data_cfg.task, insts, model.cfg.seq_len), list(depths),
                                   batch_size=batch_size, device=device)
    return out


HALTING_RULES = ("tau", "target_depth", "tolerance")
HALTING_KEYS = ("criterion", "ceiling", *HALTING_RULES)


def check_halting(halting: Mapping[str, Any], largest_depth: int) -> dict[str, Any]:
    """``{"criterion", "ceiling": C (default ``largest_depth``), and one of "tau", "target_depth" in [1, C],
    "tolerance" ≥ 0}`` checked, the ceiling filled in; ValueError naming the ``halting.<key>``."""
    if not isinstance(halting, Mapping):
        raise ValueError(f"halting: expected a table with keys {', '.join(HALTING_KEYS)}, got {halting!r}")
    bad = [k for k in halting if k not in HALTING_KEYS]
    if bad:
        raise ValueError(f"halting.{bad[0]}: unknown key; allowed: {', '.join(HALTING_KEYS)}")
    if halting.get("criterion") not in EXIT_CRITERIA:
        raise ValueError(f"halting.criterion: got {halting.get('criterion')!r}; "
                         f"allowed: {', '.join(sorted(EXIT_CRITERIA))}")
    rules = [k for k in HALTING_RULES if k in halting]
    if len(rules) != 1:
        raise ValueError(f"halting: give exactly one of {', '.join(HALTING_RULES)}, got {rules or 'none'}")
    out = {"ceiling": largest_depth, **halting}
    C, rule = out["ceiling"], rules[0]
    if not isinstance(C, int) or isinstance(C, bool) or C < 1:
        raise ValueError(f"halting.ceiling: expected an integer >= 1, got {C!r}")
    v = out[rule]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) \
            or (rule == "target_depth" and not 1 <= v <= C) or (rule == "tolerance" and v < 0):
        raise ValueError(f"halting.{rule}: got {v!r}; allowed: " + {"tau": "a number", "target_depth": f"1 … {C}",
                                                                    "tolerance": "a number >= 0"}[rule])
    return out


@torch.no_grad()
def halt_instances(model, x: torch.Tensor, y: torch.Tensor, criterion: ExitCriterion, ceiling: int, *,
                   batch_size: int = 64, device: torch.device | str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """``(depth, correct)``: (N,) halting depths in [1, ceiling] and exact match there of each instance."""
    with eval_mode(model):
        depth, correct = [], []
        for xb, yb, scored in split_batches(x, y, batch_size, device):  # scored: the answer tokens
            hit = torch.zeros(len(xb), dtype=torch.bool, device=xb.device)

            def score(rows_, k, h, logits, yb=yb, scored=scored, hit=hit):  # exit_loop's on_exit hook
                hit[rows_] = ((logits.argmax(-1) == yb[rows_]) | ~scored[rows_]).all(-1)

            res = exit_loop(model.loop(xb), criterion, ceiling, drop=True, valid=scored, on_exit=score)
            depth.append(res.depth.cpu())
            correct.append(hit.cpu())
    return torch.cat(depth).numpy(), torch.cat(correct).numpy()


def calibrate_tau(model, data_cfg, halting: Mapping[str, Any], *, max_examples: int | None = None,
                  batch_size: int = 64, device: torch.device | str = "cpu") -> float:
    """τ of ``halting`` (:func:`check_halting`): its ``tau``, or calibrated on one unroll to the ceiling of
    the ``valid`` instances of k = 1 … data.task_k (the first ``max_examples`` per k)."""
    if "tau" in halting:
        return float(halting["tau"])
    crit = build_exit_criterion(halting["criterion"])
    insts = [i for k in range(1, data_cfg.task_k + 1)
             for i in heldout(data_cfg.task, k, "valid", data_cfg.task_heldout, data_cfg.task_seed)[:max_examples]]
    with eval_mode(model):
        x, y = rows(data_cfg.task, insts, model.cfg.seq_len)
        tr = trace(model, split_batches(x, y, batch_size, device), crit, halting["ceiling"])
    return calibrate(tr.scores, crit.direction, target_depth=halting.get("target_depth"),
                     tolerance=halting.get("tolerance"), nll=tr.nll, tokens=tr.tokens).tau


def task_halting(model, data_cfg, ks: Sequence[int], halting: Mapping[str, Any], *, split: str = "test",
                 max_examples: int | None = None, batch_size: int = 64, device: torch.device | str = "cpu"
                 ) -> dict[str, Any]:
    """``{"tau", "ceiling", "by_k": {k: {"mean_depth", "acc", "acc_matched", "n"}}}`` (module docstring)."""
    C = halting["ceiling"]
    tau = calibrate_tau(model, data_cfg, halting, max_examples=max_examples, batch_size=batch_size, device=device)
    crit = build_exit_criterion(halting["criterion"], tau)
    by_k = {}
    for k in ks:
        insts = list(heldout(data_cfg.task, k, split, data_cfg.task_heldout, data_cfg.task_seed))[:max_examples]
        x, y = rows(data_cfg.task, insts, model.cfg.seq_len)
        depth, correct = halt_instances(model, x, y, crit, C, batch_size=batch_size, device=device)
        fixed = accuracy_by_depth(model, x, y, list(range(1, C + 1)), batch_size=batch_size, device=device)
        m = float(depth.mean())
        lo, hi = math.floor(m), math.ceil(m)
        matched = fixed[lo]["acc"] + (m - lo) * (fixed[hi]["acc"] - fixed[lo]["acc"])
        by_k[k] = {"mean_depth": m, "acc": float(correct.mean()), "acc_matched": matched, "n": len(insts)}
    return {"tau": tau, "ceiling": C, "by_k": by_k}


def default_ks(data_cfg) -> list[int]:
    """Difficulties evaluated by default: 1 … 2 × data.task_k (depth extrapolation), at most the family's max_k."""
    return list(range(1, min(2 * data_cfg.task_k, get_task(data_cfg.task).max_k) + 1))


def markdown_table(acc: dict[int, dict[int, dict[str, float]]], k_train: int, title: str = "") -> str:
    """Accuracy (%) with one row per depth T and one column per k (k > k_train marked *)."""
    ks = sorted(acc)
    head = ["T \\ k", *(f"{k}{'*' if k > k_train else ''}" for k in ks)]
    rows = [[str(T), *(f"{100 * acc[k][T]['acc']:.1f}" for k in ks)] for T in sorted(next(iter(acc.values())))]
    return "\n".join([*([f"**{title}**", ""] if title else []), *md_table(head, rows, align="l" + "r" * len(ks)), "",
                      f"exact-match accuracy (%) on held-out instances; * = k beyond training (k_train = {k_train})"])


def halting_table(by_k: Mapping[int, Mapping[str, float]], k_train: int, criterion: str, tau: float) -> str:
    """Markdown: per k the mean halting depth, exact match (%) at halting and at the matched fixed depth."""
    rows = [[f"{k}{'*' if k > k_train else ''}", f"{r['mean_depth']:.2f}", f"{100 * r['acc']:.1f}",
             f"{100 * r['acc_matched']:.1f}", str(r["n"])] for k, r in sorted(by_k.items())]
    return "\n".join([f"halting ({criterion}, τ = {tau:.4g})", "", *md_table(
        ["k", "mean halting depth", "acc at halting", "acc at matched fixed depth", "n"], rows, align="rrrrr")])


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
    ax.set(xlabel="difficulty k (steps)", ylabel="loop depth T")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="exact match (%)")
    return save_figure(fig, path)


def evaluate_task_checkpoint(checkpoint: str | Path, *, depths: Sequence[int] | None = None,
                             ks: Sequence[int] | None = None, split: str = "test", max_examples: int | None = None,
                             batch_size: int = 64, device: str = "cpu", progress: bool = True,
                             plot: str | Path | None = None, halting: Mapping[str, Any] | None = None
                             ) -> dict[str, Any]:
    """Accuracy by depth × k of a checkpoint trained on a task (``data.dataset=task``).

    Args:
        depths: loop depths T (default 1 … 2 × the largest training depth).
        ks: difficulties (default 1 … 2 × data.task_k, at most the family's max_k).
        max_examples: instances per k (default: all ``data.task_heldout``).
        halting: also the halting depth per k: ``{"criterion": an exit criterion, "ceiling": C (default
            max(depths)), and one of "tau", "target_depth", "tolerance"}``.
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
    if depths[0] < 1:
        raise ValueError(f"--depths: loop depths must be >= 1, got {depths[0]}")
    halting = None if halting is None else check_halting(halting, depths[-1])
    acc = task_accuracy(model, data, ks, depths, split=split, max_examples=max_examples, batch_size=batch_size,
                        device=torch.device(device), progress=progress)
    title = f"{cfg.name}: {cfg.model.rule} on {data.task} (train k <= {data.task_k}, T <= {train_depth}; {split})"
    result = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule, "task": data.task,
              "k_train": data.task_k, "train_depth": train_depth, "split": split, "params": model.num_params(),
              "accuracy": {str(k): {str(T): r for T, r in by_T.items()} for k, by_T in acc.items()},
              "markdown": markdown_table(acc, data.task_k, title),
              "provenance": provenance(ckpt, task=data.task, task_seed=data.task_seed, task_heldout=data.task_heldout)}
    if halting is not None:
        h = task_halting(model, data, ks, halting, split=split, max_examples=max_examples, batch_size=batch_size,
                         device=torch.device(device))
        result["halting"] = {"criterion": halting["criterion"], "tau": h["tau"], "ceiling": h["ceiling"],
                             "by_k": {str(k): r for k, r in h["by_k"].items()}}
        result["markdown"] += "\n\n" + halting_table(h["by_k"], data.task_k, halting["criterion"], h["tau"])
    if plot is not None:
        result["plot"] = str(plot_heatmap(acc, plot, k_train=data.task_k, train_depth=train_depth, title=title))
    return result
