"""Every mechanism diagnostic of a trained model on a few batches (SPEC §7; SCSE Tables 3, 22, Figures 4–5).

Batch-level values are averaged over batches (R_t as the mean of batch ratios, as the paper; max-abs entries
maxed); scale and convergence pool tokens. Dropout off, on a float64 copy by default (:mod:`.gain` says why).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from looplm.diagnostics.alignment import LOSSES, merge_alignment, merge_batches, visit_alignment
from looplm.diagnostics.convergence import DEFAULT_TAU, ConvergenceAccumulator
from looplm.diagnostics.forcing import DTYPES, check_shared, forcing_profile
from looplm.diagnostics.gain import FD_EPS, N_DIRECTIONS, gain_profile
from looplm.diagnostics.report import markdown_report, plot_anchor_rollouts, plot_forcing_ratio, plot_scale
from looplm.diagnostics.rollout import DOSE_GAINS, anchor_rollouts, pca_views
from looplm.diagnostics.scale import DEFAULT_LOOPS, ScaleAccumulator
from looplm.data.paths import atomic_write
from looplm.run.provenance import provenance, tokens_sha256
from looplm.model import LoopLM
from looplm.model.cursor import Readout


def _check_args(steps: Sequence[int], depth: int, gains: Sequence[float] = DOSE_GAINS, n_directions: int = N_DIRECTIONS,
                eps: float = FD_EPS, scale_loops: int = 1, convergence_tau: float = DEFAULT_TAU,
                alignment_loss: str = "terminal", dtype: str = "float64") -> None:
    if depth < 1:
        raise ValueError(f"depth: need a rollout depth >= 1, got {depth}")
    if not steps or min(steps) < 0 or max(steps) >= depth:
        raise ValueError(f"steps: need loop steps t in 0..depth-1 = 0..{depth - 1}, got {list(steps)}")
    if not gains or min(gains) < 0:
        raise ValueError(f"gains: need injection gains >= 0, got {list(gains)}")
    if n_directions < 1:
        raise ValueError(f"n_directions: need >= 1, got {n_directions}")
    if eps <= 0:
        raise ValueError(f"eps: need > 0, got {eps}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if scale_loops < 1:
        raise ValueError(f"scale_loops: need a loop count K >= 1, got {scale_loops}")
    if convergence_tau <= 0:
        raise ValueError(f"convergence_tau: need a threshold > 0, got {convergence_tau}")
    if alignment_loss not in LOSSES:
        raise ValueError(f"alignment_loss: expected one of {', '.join(LOSSES)}, got {alignment_loss!r}")


Batch = torch.Tensor | tuple[torch.Tensor, ...]


def _unpack(item: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(idx, targets, mask) on ``device`` from (idx, targets[, mask]) or a bare (B, L) idx (targets from the
    window itself, the last position ignored)."""
    if isinstance(item, torch.Tensor):
        targets = torch.full_like(item, -100)
        targets[:, :-1] = item[:, 1:]
        item = (item, targets)
    idx, targets, *mask = (t.to(device) for t in item)
    return idx, targets, mask[0] if mask else None


@torch.no_grad()
def diagnose_model(model: LoopLM, batches: Iterable[Batch], *, steps: Sequence[int] = (0, 47),
                   depth: int = 48, eps: float = FD_EPS, n_directions: int = N_DIRECTIONS, seed: int = 0,
                   gains: Sequence[float] = DOSE_GAINS, dtype: str = "float64", label: str = "model",
                   scale_loops: int = DEFAULT_LOOPS, convergence_tau: float = DEFAULT_TAU,
                   alignment_loss: str = "terminal", progress: bool = False) -> dict[str, Any]:
    """All SPEC §6–7 diagnostics of ``model`` (a copy in ``dtype``, eval mode) on batches (idx or (idx, targets[,
    mask])); batch i's directions are seeded ``seed + n_directions·i``. ``scale_loops``: the K of the scale
    diagnostic and the R of the visit alignment. ValueError: an unshared model or a bad setting."""
    check_shared(model, "mechanism diagnostics")
    steps = sorted({int(t) for t in steps})
    _check_args(steps, depth, gains, n_directions, eps, scale_loops, convergence_tau, alignment_loss, dtype)
    model = copy.deepcopy(model).to(DTYPES[dtype]).eval()
    device = next(model.parameters()).device
    forcing, gain, rollout, dose, views = [], [], [], [], None
    scale, convergence, alignment = ScaleAccumulator(scale_loops), ConvergenceAccumulator(convergence_tau), []
    for i, item in enumerate(tqdm(list(batches), desc="diagnose", unit="batch", disable=not progress)):
        idx, targets, mask = _unpack(item, device)
        forcing.append(forcing_profile(model, idx, steps))
        gain.append(gain_profile(model, idx, steps, eps=eps, n_directions=n_directions, seed=seed + n_directions * i))
        roll = anchor_rollouts(model, idx, depth, gains=gains)
        rollout.append(roll["rollout"])
        dose.append(roll["dose_response"])
        if views is None:
            views = pca_views(roll["paths"], gains)
        # one unroll serves both: the scale diagnostic needs F(H_K) = H_{K+1}
        states = model(idx, max(depth, scale_loops + 1), readout=Readout(logits=False, states=True)).states
        scale.add(model, states[:scale_loops + 2], targets, mask)
        convergence.add(states[:depth + 1], mask)
        alignment.append(visit_alignment(model, idx, targets, scale_loops, loss=alignment_loss))
    if not forcing:
        raise ValueError("batches: no batches to measure")
    result = {
        "steps": steps, "depth": depth, "eps": eps, "n_directions": n_directions, "seed": seed,
        "gains": [float(g) for g in gains], "dtype": dtype, "batches": len(forcing),
        "forcing": [merge_batches([b[j] for b in forcing]) for j in range(len(steps))],
        "gain": [merge_batches([b[j] for b in gain]) for j in range(len(steps))],
        "rollout": {"depth": depth, "start": "anchor (delta_0 = 0)",
                    "bias0_rms": merge_batches([{"v": b["bias0_rms"]} for b in rollout])["v"],
                    "records": [merge_batches([b["records"][j] for b in rollout]) for j in range(depth + 1)],
                    "pca": views["trajectories"]},
        "dose_response": {"gains": [float(g) for g in gains],
                          "push_rms": merge_batches([{"v": b["push_rms"]} for b in dose])["v"],
                          "records": [merge_batches([b["records"][j] for b in dose], labels=("gain",))
                                      for j in range(len(gains))],
                          "pca": views["displacements"]},
        "scale": scale.result(),
        "visit_alignment": merge_alignment(alignment),
        "convergence": convergence.result(),
    }
    result["markdown"] = markdown_report({label: result})
    return result


def load_windows(checkpoint, what: str, *, dataset: str | None, split: str, batch_size: int, batches: int,
                 device: str = "cpu"):
    """``(model, cfg, ckpt_dir, data_cfg, windows)``: a shared checkpoint (ValueError naming ``what``) and the
    first ``batches`` (x, y, mask) windows of a split (y = -100 unscored; a task run's held-out instances)."""
    from looplm.data.tokens import eval_windows
    from looplm.eval.runner import open_checkpoint

    if batches < 1 or batch_size < 1:
        raise ValueError(f"batches and batch_size must be >= 1, got {batches} and {batch_size}")
    opened = open_checkpoint(checkpoint, dataset=dataset, device=device)
    model, cfg, ckpt, data_cfg = opened.model, opened.cfg, opened.ckpt, opened.data
    check_shared(model, what)
    if data_cfg.dataset == "task":  # a synthetic task: its held-out instances (split valid or test)
        from looplm.tasks.data import heldout_windows

        return model, cfg, ckpt, data_cfg, heldout_windows(data_cfg, split, cfg.model.seq_len, batch_size, batches)
    tokens = opened.tokens(split)
    if len(tokens) < 2:
        raise ValueError(f"split: {data_cfg.dataset}/{split} has {len(tokens)} tokens; need at least 2")
    windows = [(x, y.masked_fill(~m, -100), m)
               for x, y, m in eval_windows(tokens, cfg.model.seq_len, batch_size, max_batches=batches)]
    return model, cfg, ckpt, data_cfg, windows


def diagnose_checkpoint(checkpoint: str | Path, *, steps: Sequence[int] | None = (0, 47), depth: int = 48,
                        dataset: str | None = None, split: str = "valid", batches: int = 4, batch_size: int = 8,
                        out_dir: str | Path | None = None, device: str = "cpu", progress: bool = True,
                        stem: str = "diagnose", dtype: str = "float64", seed: int = 0,
                        scale_loops: int | None = None, convergence_tau: float = DEFAULT_TAU) -> dict[str, Any]:
    """Mechanism diagnostics (SPEC §6–7) of a checkpoint on the first ``batches`` windows of a split; with
    ``out_dir``, writes ``{stem}.json``, ``{stem}.md`` and the forcing-ratio, rollout and scale plots there.

    Args:
        steps: loop steps t for the forcing bias and gain; None: (0, depth − 1)
        depth: anchor-start rollout depth T (and the unroll the steps live in)
        batches, batch_size: the first BATCHES batches of BATCH_SIZE non-overlapping windows
        dtype: float64 or float32 for the diagnostic computations
        scale_loops: K of the scale diagnostic and R of the visit alignment (default: the nominal training depth)
        convergence_tau: threshold τ of token convergence
    """
    steps = (0, depth - 1) if steps is None else steps
    _check_args(sorted(steps), depth, scale_loops=1 if scale_loops is None else scale_loops,
                convergence_tau=convergence_tau)
    model, cfg, ckpt, data_cfg, xs = load_windows(checkpoint, "looplm diagnose", dataset=dataset, split=split,
                                                  batch_size=batch_size, batches=batches, device=device)
    label = f"{cfg.name} ({cfg.model.rule})"
    loops = cfg.depth.nominal_depth() if scale_loops is None else scale_loops
    res = diagnose_model(model, xs, steps=steps, depth=depth, seed=seed, dtype=dtype, label=label,
                         scale_loops=loops, convergence_tau=convergence_tau,
                         alignment_loss="per_loop" if cfg.train.supervision == "per_loop" else "terminal",
                         progress=progress)
    windows_sha = tokens_sha256(torch.cat([x for x, _, _ in xs]).cpu().numpy())  # the tokens diagnosed
    result = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule, "dataset": data_cfg.dataset,
              "split": split, "batch_size": batch_size, "params": model.num_params(), **res,
              "provenance": provenance(ckpt, windows_sha256=windows_sha)}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md = out / f"{stem}.md"
        md.write_text(result["markdown"] + "\n")
        result["files"] = {
            "markdown": str(md),
            "forcing_ratio_plot": str(plot_forcing_ratio({label: result}, out / f"{stem}_forcing_ratio.png")),
            "rollout_plot": str(plot_anchor_rollouts(result, out / f"{stem}_rollouts.png", label=label,
                                                     train_depth=cfg.depth.nominal_depth())),
            "scale_plot": str(plot_scale(result, out / f"{stem}_scale.png", label=label)),
            "json": str(out / f"{stem}.json")}
        with atomic_write(out / f"{stem}.json") as fh:
            fh.write(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=2,
                                default=float).encode())
    return result
