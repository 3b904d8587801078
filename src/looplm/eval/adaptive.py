"""Adaptive depth with the hidden-update stopping rule (SCSE, arXiv:2607.27656, appendix Tables 9–10; SPEC §6).

Per window b and step t < C: u_t(b) = max over its scored tokens of ‖h_{t+1} − h_t‖₂ / (‖h_t‖₂ + 1e-8), read
out at ``D = min({t + 1 : u_t < τ} ∪ {C})`` (our choice; any registered exit criterion via ``criterion=``).
:func:`~looplm.eval.exits.trace` runs every window to the ceiling once; τ is calibrated on valid for each target
mean depth (8, 16, 24) and applied to test; :func:`~looplm.eval.exits.run` really drops halted rows (the reported
speedup; a τ that never fires runs every example to the ceiling, its reference).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from looplm.eval.exits import EXIT_CRITERIA, Batch, build_exit_criterion, calibrate, halting_depths, run, trace
from looplm.eval.perplexity import token_batches
from looplm.model import DepthLM, eval_mode
from looplm.run.finite import md_table

DEFAULT_TARGETS: tuple[int, ...] = (8, 16, 24)
DEFAULT_CEILING = 48


def adaptive_depth(model: DepthLM, valid: np.ndarray, test: np.ndarray, *,
                   targets: Sequence[float] = DEFAULT_TARGETS, ceiling: int = DEFAULT_CEILING,
                   max_tokens: int | None = None, batch_size: int = 16, device: str | torch.device = "cpu",
                   progress: bool = True, timed: bool = True, criterion: str = "hidden_update",
                   scale_clamp: bool = False) -> dict[str, Any]:
    """Valid-calibrated adaptive depth (module docstring); ``timed``: also the real early exit on test per
    target and once without halting. ValueError: no targets, one outside [1, ceiling], a split of < 2 tokens."""
    targets = list(dict.fromkeys(targets))
    if not targets:
        raise ValueError("targets: need at least one target mean depth")
    if ceiling < 1:
        raise ValueError(f"ceiling must be >= 1, got {ceiling}")
    for target in targets:
        if not 1 <= target <= ceiling:
            raise ValueError(f"target mean depth {target} outside [1, ceiling={ceiling}]")
    if criterion not in EXIT_CRITERIA:
        raise ValueError(f"criterion: unknown {criterion!r}; known: {', '.join(sorted(EXIT_CRITERIA))}")
    direction = EXIT_CRITERIA[criterion].direction
    never = -math.inf if direction == "below" else math.inf
    valid_b, test_b = (list(token_batches(t, model.cfg.seq_len, batch_size, max_tokens=max_tokens, device=device))
                       for t in (valid, test))

    def measure(fn, batches: list[Batch], tau: float, desc: str):  # exits.trace or exits.run
        return fn(model, batches, build_exit_criterion(criterion, tau), ceiling, progress=progress, desc=desc,
                  scale_clamp=scale_clamp)

    with eval_mode(model):
        tr_valid, tr_test = measure(trace, valid_b, 0.0, "trace valid"), measure(trace, test_b, 0.0, "trace test")
        full = measure(run, test_b, never, "full depth") if timed else None
        res: dict[str, Any] = {
            "criterion": criterion, "scale_clamp": scale_clamp, "ceiling": ceiling, "max_tokens": max_tokens,
            "batch_size": batch_size,
            "examples": {"valid": len(tr_valid.tokens), "test": len(tr_test.tokens)},
            "tokens": {"valid": int(tr_valid.tokens.sum()), "test": int(tr_test.tokens.sum())},
            "static": {str(T): {"valid_ppl": tr_valid.ppl_at(T), "test_ppl": tr_test.ppl_at(T)}
                       for T in range(1, ceiling + 1)},
            "full_depth_seconds": full.seconds if full else None,
            "targets": {},
        }
        for target in targets:
            tau = calibrate(tr_valid.scores, direction, target_depth=target).tau
            d_valid, d_test = (halting_depths(tr.scores, tau, direction) for tr in (tr_valid, tr_test))
            entry: dict[str, Any] = {
                "target": target, "tau": tau,
                "valid_mean_depth": float(d_valid.mean()), "test_mean_depth": float(d_test.mean()),
                "valid_ppl": tr_valid.ppl_at(d_valid), "test_ppl": tr_test.ppl_at(d_test),
                "test_depth_counts": {str(T): int(n) for T, n in zip(*np.unique(d_test, return_counts=True))},
                "early_exit": None,
            }
            if timed:
                ee = measure(run, test_b, tau, f"early exit {target}")
                same = ee.depth == d_test
                ref = tr_test.nll[np.arange(len(d_test)), d_test - 1]
                entry["early_exit"] = {
                    "seconds": ee.seconds, "speedup": full.seconds / ee.seconds if ee.seconds > 0 else None,
                    "row_steps": ee.row_steps, "full_row_steps": full.row_steps, "test_ppl": ee.ppl(),
                    "depth_agreement": float(same.mean()),
                    "max_abs_nll_diff": float(np.abs(ee.nll - ref)[same].max()) if same.any() else None,
                }
            res["targets"][str(target)] = entry
    return res


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown in the paper's Table 9/10 layout (the first result sets the columns), and details per result."""
    first = next(iter(results.values()))
    statics = sorted({min(8, first["ceiling"]), first["ceiling"]})  # T=8 (the training range) and the ceiling
    targets = list(first["targets"])
    cols = ([f"Static T={statics[0]}"] + [f"Adaptive {t}" for t in targets]
            + [f"Static T={T}" for T in statics[1:]])
    rows = [[label, f"{res['static'][str(statics[0])]['test_ppl']:.2f}",
             *(f"{res['targets'][t]['test_ppl']:.2f}" for t in targets),
             *(f"{res['static'][str(T)]['test_ppl']:.2f}" for T in statics[1:])] for label, res in results.items()]
    out = ["\n".join(md_table(["model (test PPL)", *cols], rows, align="l" + "r" * len(cols)))]
    for label, res in results.items():
        rows = []
        for t, e in res["targets"].items():
            ee = e["early_exit"]
            timing = [f"{ee['seconds']:.2f}", f"{ee['speedup']:.2f}×"] if ee and ee["speedup"] else ["–", "–"]
            rows.append([t, f"{e['tau']:.4g}", f"{e['valid_mean_depth']:.2f}", f"{e['test_mean_depth']:.2f}",
                         f"{e['valid_ppl']:.2f}", f"{e['test_ppl']:.2f}", *timing])
        det = [f"{label}: criterion {res.get('criterion', 'hidden_update')}, τ calibrated on valid "
               f"({res['examples']['valid']} windows), applied to test "
               f"({res['examples']['test']} windows), ceiling {res['ceiling']}.", "",
               *md_table(["target", "τ", "valid mean depth", "test mean depth", "valid PPL", "test PPL",
                          "early-exit s", "speedup"], rows, align="r" * 8)]
        if res.get("full_depth_seconds") is not None:
            det.append(f"\nAll examples to the ceiling: {res['full_depth_seconds']:.2f} s.")
        out.append("\n".join(det))
    return "\n\n".join(out)


def adaptive_depth_checkpoint(checkpoint: str | Path, *, targets: Sequence[float] = DEFAULT_TARGETS,
                              ceiling: int = DEFAULT_CEILING, dataset: str | None = None,
                              max_tokens: int | None = None, batch_size: int = 16, device: str = "cpu",
                              progress: bool = True, timed: bool = True,
                              criterion: str = "hidden_update", scale_clamp: bool = False) -> dict[str, Any]:
    """Adaptive depth of a checkpoint on the valid/test splits of its corpus (or ``dataset``), each cut to
    ``max_tokens`` + 1 tokens: τ per target on valid; test PPL, mean depths and (``timed``) early-exit speedups."""
    from looplm.eval.runner import open_checkpoint
    from looplm.run.provenance import tokens_sha256

    opened = open_checkpoint(checkpoint, dataset=dataset, device=device)
    model, cfg, ckpt, data_cfg = opened.model, opened.cfg, opened.ckpt, opened.data
    valid, test = opened.tokens("valid"), opened.tokens("test")
    res = adaptive_depth(model, valid, test, targets=targets, ceiling=ceiling, max_tokens=max_tokens,
                         batch_size=batch_size, device=device, progress=progress, timed=timed,
                         criterion=criterion, scale_clamp=scale_clamp)
    res = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
           "architecture": cfg.model.architecture, "dataset": data_cfg.dataset, "params": model.num_params(),
           **res, "provenance": opened.provenance(test, valid_tokens_sha256=tokens_sha256(valid))}
    res["markdown"] = markdown_table({f"{cfg.name} ({data_cfg.dataset})": res})
    return res
