"""Adaptive depth with the hidden-update stopping rule (SPEC §6; SCSE appendix, Tables 9–10).

Per example b (one evaluation window of L tokens) and loop step t = 0 … C−1 (C = the ceiling, 48):

    u_t(b) = max over the window's scored tokens i of ‖h_{t+1,i} − h_{t,i}‖₂ / (‖h_{t,i}‖₂ + 1e-8)

with h in readout coordinates (what :meth:`LoopLM.unroll` yields; h = h* + Δ for SCSE).

**Depth convention (our choice).** Step t maps h_t to h_{t+1}, so u_t is known once h_{t+1} has
been computed. The example stops at the first t with ``u_t < τ`` and is read out at the state it
has just computed, h_{t+1}: its *active depth* is ``D = t + 1``, the number of loop steps it ran.
Without such a t it runs to the ceiling, ``D = C``. So ``D = min({t + 1 : u_t < τ} ∪ {C})`` ∈
[1, C]; a larger τ never gives a larger depth, τ ≤ 0 gives D = C for every example (u_t ≥ 0), and
the mean active depth is the plain mean of D over examples (windows).

**Protocol (full-trace, offline accounting).** :func:`trace_depths` runs every window once to the
ceiling and records u_t and the per-example NLL sum at every depth 1 … C (a readout at every depth;
only (N, C) sums are kept). :func:`calibrate_threshold` picks τ on the validation trace so that the
mean active depth is closest to each target (8, 16, 24); that τ is applied unchanged to the test
trace, whose PPL is token-weighted over examples each read out at its own depth D_b.

**Real early exit.** :func:`early_exit_eval` runs the loop and drops halted examples from the batch
(``index_select``), so later steps process fewer rows. It gives the same depths and NLL as the
offline accounting (to float rounding) and its wall time against running every example to the
ceiling is the reported speedup.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from looplm.data.paths import resolve_cache_dir, resolve_data_root
from looplm.data.tokens import eval_windows, load_tokens
from looplm.model import LoopLM

DEFAULT_TARGETS: tuple[int, ...] = (8, 16, 24)
DEFAULT_CEILING = 48
UPDATE_EPS = 1e-8  # the denominator guard of u_t (SPEC §6)


@dataclass
class DepthTrace:
    """Full trace of one split to the ceiling C (N examples = evaluation windows, file order).

    Attributes:
        update: (N, C) float64, column t = u_t (step t → t+1), dimensionless.
        nll: (N, C) float64, column T−1 = the example's summed NLL (nats) read out at depth T.
        tokens: (N,) int64, scored targets per example (the same at every depth).
    """

    update: np.ndarray
    nll: np.ndarray
    tokens: np.ndarray

    @property
    def ceiling(self) -> int:
        return self.update.shape[1]

    def ppl_at(self, depths: np.ndarray | int) -> float:
        """Token-weighted PPL with example b read out at ``depths[b]`` (or one depth for all)."""
        d = np.broadcast_to(np.asarray(depths, dtype=np.int64), self.tokens.shape)
        nll = self.nll[np.arange(len(d)), d - 1].sum()
        return math.exp(nll / self.tokens.sum())


@dataclass
class EarlyExitResult:
    """Per-example outcome of :func:`early_exit_eval` (same order as :class:`DepthTrace`).

    Attributes:
        depth: (N,) int64 active depth D_b. nll: (N,) float64 summed NLL (nats) at D_b.
        tokens: (N,) int64 scored targets. seconds: wall time of the compute (batches prebuilt).
        row_steps: total rows × loop steps processed (N·C when nothing halts).
    """

    depth: np.ndarray
    nll: np.ndarray
    tokens: np.ndarray
    seconds: float
    row_steps: int

    def ppl(self) -> float:
        return math.exp(self.nll.sum() / self.tokens.sum())


# ------------------------------------------------------------------ the stop rule


def hidden_update(h_next: torch.Tensor, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """u_t per example: max over valid tokens of ‖h_{t+1} − h_t‖₂ / (‖h_t‖₂ + 1e-8) (SPEC §6).

    Args:
        h_next, h: (B, L, d) states after and before one loop step (readout coordinates).
        valid: (B, L) bool, the tokens that take part in the max (the scored positions).

    Returns:
        (B,) float32; 0 for an example without valid tokens.
    """
    h_next, h = h_next.float(), h.float()
    rel = (h_next - h).norm(dim=-1) / (h.norm(dim=-1) + UPDATE_EPS)  # (B, L)
    return rel.masked_fill(~valid, 0.0).amax(dim=1)


def stop_depths(update: np.ndarray, tau: float) -> np.ndarray:
    """Active depth per example under threshold τ: ``min({t + 1 : u_t < τ} ∪ {C})``.

    Args:
        update: (N, C) u_t traces. tau: the threshold.

    Returns:
        (N,) int64 depths in [1, C].
    """
    update = np.asarray(update)
    C = update.shape[1]
    below = update < tau  # (N, C)
    first = below.argmax(axis=1) + 1
    return np.where(below.any(axis=1), first, C).astype(np.int64)


def calibrate_threshold(update: np.ndarray, target: float) -> tuple[float, float]:
    """The τ whose mean active depth on ``update`` is closest to ``target`` (SCSE adaptive depth).

    The mean depth is a non-increasing step function of τ that changes only where τ crosses an
    observed u_t. Candidates are the smallest observed value (every example at the ceiling), the
    midpoints between consecutive distinct observed values, and one value above the largest (every
    example at depth 1); a bisection over them finds the first candidate with mean depth ≤ target,
    and the closer of it and its predecessor wins (ties go to the one not above the target).

    Args:
        update: (N, C) validation traces. target: mean depth wanted, in [1, C].

    Returns:
        ``(tau, mean_depth)`` with the achieved mean depth on ``update``.

    Raises:
        ValueError: empty trace or target outside [1, C].
    """
    update = np.asarray(update, dtype=np.float64)
    N, C = update.shape
    if N == 0:
        raise ValueError("calibrate_threshold: empty trace")
    if not 1 <= target <= C:
        raise ValueError(f"target mean depth {target} outside [1, ceiling={C}]")
    # u_{C-1} cannot change a depth (stopping after the last step is the ceiling anyway)
    v = np.unique(update[:, : C - 1]) if C > 1 else np.zeros(1)
    cands = np.concatenate([v[:1], (v[:-1] + v[1:]) / 2, [2 * abs(v[-1]) + 1.0]])

    def mean_depth(i: int) -> float:
        return float(stop_depths(update, cands[i]).mean())

    lo, hi = 0, len(cands) - 1  # mean_depth(hi) == 1 <= target
    while lo < hi:
        mid = (lo + hi) // 2
        if mean_depth(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    best, best_depth = lo, mean_depth(lo)
    if lo > 0:
        prev = mean_depth(lo - 1)
        if abs(prev - target) < abs(best_depth - target):
            best, best_depth = lo - 1, prev
    return float(cands[best]), best_depth


# ------------------------------------------------------------------ full trace (offline accounting)


def _example_nll(model: LoopLM, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Readout of h (B, L, d) → summed NLL per example (B,) float64 over targets y != -100."""
    logits = model.readout(h)  # (B, L, V)
    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                          reduction="none").view_as(y)  # (B, L)
    return nll.double().sum(dim=1)


def _batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int | None,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows as (x, y with -100 on unscored targets, mask), on ``device``."""
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    if len(tokens) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(tokens)}")
    out = []
    for x, y, mask in eval_windows(tokens, seq_len, batch_size):
        out.append((x.to(device), y.masked_fill(~mask, -100).to(device), mask.to(device)))
    return out


@torch.no_grad()
def trace_depths(model: LoopLM, tokens: np.ndarray, ceiling: int = DEFAULT_CEILING, *, batch_size: int = 16,
                 max_tokens: int | None = None, device: str | torch.device = "cpu", progress: bool = True,
                 desc: str = "trace") -> DepthTrace:
    """One unroll to ``ceiling`` per batch of windows, recording u_t and the NLL at every depth.

    Windows are the non-overlapping ``seq_len`` windows of :func:`~looplm.data.tokens.eval_windows`
    (the last may be partial); u_t is the max over each window's scored positions.

    Args:
        model: put in eval mode here (dropout off). tokens: 1-D token stream.
        ceiling: C ≥ 1 loop steps. max_tokens: use only ``tokens[: max_tokens + 1]``.

    Returns:
        :class:`DepthTrace` with N = number of windows.

    Raises:
        ValueError: ceiling < 1 or fewer than two tokens.
    """
    if ceiling < 1:
        raise ValueError(f"ceiling must be >= 1, got {ceiling}")
    was_training = model.training
    model.eval()
    batches = _batches(tokens, model.cfg.seq_len, batch_size, max_tokens, torch.device(device))
    updates, nlls, counts = [], [], []
    for x, y, mask in tqdm(batches, desc=desc, disable=not progress, leave=False, unit="batch"):
        u = torch.zeros(len(x), ceiling, dtype=torch.float64)
        nll = torch.zeros(len(x), ceiling, dtype=torch.float64)
        prev = None
        for T, h, _ in model.unroll(x, ceiling):
            if T > 0:
                u[:, T - 1] = hidden_update(h, prev, mask).double().cpu()
                nll[:, T - 1] = _example_nll(model, h, y).cpu()
            prev = h
        updates.append(u)
        nlls.append(nll)
        counts.append(mask.sum(dim=1).cpu())
    model.train(was_training)
    return DepthTrace(update=torch.cat(updates).numpy(), nll=torch.cat(nlls).numpy(),
                      tokens=torch.cat(counts).numpy().astype(np.int64))


# ------------------------------------------------------------------ real early exit


def _select_rows(obj: Any, keep: torch.Tensor, batch: int) -> Any:
    """``index_select(0, keep)`` on every batch-first tensor inside obj (tensor, tuple/list,
    dataclass such as :class:`~looplm.model.LoopContext`, or None); other values pass through."""
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, keep) if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_select_rows(o, keep, batch) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _select_rows(getattr(obj, f.name), keep, batch)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _start(model: LoopLM, x: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
    """(loop state, context, h_0) for the shared and the unshared architecture."""
    e = model.embed(x)
    if not model.shared:
        return e, None, e
    state, ctx = model.start(e)
    return state, ctx, model.rule.hidden(state, ctx)


def _step(model: LoopLM, state: Any, t: int, ctx: Any) -> tuple[Any, torch.Tensor]:
    """One loop step t → t+1; returns (state, h_{t+1}) as :meth:`LoopLM.unroll` computes them."""
    if not model.shared:
        h = state + model.layers[t](state) if t < len(model.layers) else state
        return h, h
    state = model.rule.step(model.core, state, t, ctx)
    return state, model.rule.hidden(state, ctx)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def early_exit_eval(model: LoopLM, tokens: np.ndarray, tau: float, ceiling: int = DEFAULT_CEILING, *,
                    batch_size: int = 16, max_tokens: int | None = None, device: str | torch.device = "cpu",
                    progress: bool = True, desc: str = "early exit") -> EarlyExitResult:
    """Per-example early exit under the hidden-update rule, halted examples leaving the batch.

    At each step the rows still running are advanced; rows with ``u_t < τ`` (all rows at the last
    step) are read out at depth t + 1 and removed with ``index_select`` from the state, the loop
    context, the targets and the masks, so later steps process fewer rows. ``tau=-inf`` never
    halts: every example runs to the ceiling and is read out once (the reference for the speedup).

    Same windows, depths and NLL as :func:`trace_depths` + :func:`stop_depths` (the offline
    accounting), up to float rounding from the smaller batches.

    Returns:
        :class:`EarlyExitResult`; ``seconds`` times the compute only (windows are built first).

    Raises:
        ValueError: ceiling < 1 or fewer than two tokens.
    """
    if ceiling < 1:
        raise ValueError(f"ceiling must be >= 1, got {ceiling}")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    batches = _batches(tokens, model.cfg.seq_len, batch_size, max_tokens, device)
    depths, nlls, counts = [], [], []
    row_steps = 0
    _sync(device)
    t0 = time.perf_counter()
    for x, y, mask in tqdm(batches, desc=desc, disable=not progress, leave=False, unit="batch"):
        B = len(x)
        depth = torch.zeros(B, dtype=torch.int64, device=device)
        nll = torch.zeros(B, dtype=torch.float64, device=device)
        counts.append(mask.sum(dim=1))
        rows = torch.arange(B, device=device)  # original row of each running row
        state, ctx, h = _start(model, x)
        for t in range(ceiling):
            row_steps += len(rows)
            state, h_next = _step(model, state, t, ctx)
            if t + 1 == ceiling:
                halt = torch.ones(len(rows), dtype=torch.bool, device=device)
            elif tau == -math.inf:  # the no-halting reference skips the u_t it would never use
                halt = torch.zeros(len(rows), dtype=torch.bool, device=device)
            else:
                halt = hidden_update(h_next, h, mask) < tau  # (b,)
            if bool(halt.any()):
                done = halt.nonzero().squeeze(1)
                depth[rows[done]] = t + 1
                nll[rows[done]] = _example_nll(model, h_next.index_select(0, done), y.index_select(0, done))
                keep = (~halt).nonzero().squeeze(1)
                if len(keep) == 0:
                    break
                b = len(rows)
                state, ctx, h_next, y, mask, rows = (_select_rows(o, keep, b)
                                                     for o in (state, ctx, h_next, y, mask, rows))
            h = h_next
        depths.append(depth)
        nlls.append(nll)
    _sync(device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    return EarlyExitResult(depth=torch.cat(depths).cpu().numpy(), nll=torch.cat(nlls).cpu().numpy(),
                           tokens=torch.cat(counts).cpu().numpy().astype(np.int64), seconds=seconds,
                           row_steps=row_steps)


# ------------------------------------------------------------------ protocol and report


def _static_depths(ceiling: int) -> list[int]:
    """The static columns of the paper's Table 9 layout: T=8 (training range) and T=ceiling."""
    return sorted({min(8, ceiling), ceiling})


def adaptive_depth(model: LoopLM, valid: np.ndarray, test: np.ndarray, *,
                   targets: Sequence[float] = DEFAULT_TARGETS, ceiling: int = DEFAULT_CEILING,
                   max_tokens: int | None = None, batch_size: int = 16, device: str | torch.device = "cpu",
                   progress: bool = True, timed: bool = True) -> dict[str, Any]:
    """Validation-calibrated adaptive depth on token streams (SPEC §6; SCSE Tables 9–10).

    Traces both splits to the ceiling, calibrates τ per target mean depth on valid, applies it to
    test; with ``timed``, also runs the real early exit on test per target and once without halting.

    Returns:
        JSON-ready dict (see :func:`adaptive_depth_checkpoint`, without the checkpoint fields).

    Raises:
        ValueError: no targets, a target outside [1, ceiling], ceiling < 1, or a split with < 2 tokens.
    """
    targets = list(dict.fromkeys(targets))
    if not targets:
        raise ValueError("targets: need at least one target mean depth")
    if ceiling < 1:
        raise ValueError(f"ceiling must be >= 1, got {ceiling}")
    for target in targets:
        if not 1 <= target <= ceiling:
            raise ValueError(f"target mean depth {target} outside [1, ceiling={ceiling}]")
    kw = dict(batch_size=batch_size, max_tokens=max_tokens, device=device, progress=progress)
    tr_valid = trace_depths(model, valid, ceiling, desc="trace valid", **kw)
    tr_test = trace_depths(model, test, ceiling, desc="trace test", **kw)
    full = early_exit_eval(model, test, -math.inf, ceiling, desc="full depth", **kw) if timed else None
    res: dict[str, Any] = {
        "ceiling": ceiling, "max_tokens": max_tokens, "batch_size": batch_size,
        "examples": {"valid": len(tr_valid.tokens), "test": len(tr_test.tokens)},
        "tokens": {"valid": int(tr_valid.tokens.sum()), "test": int(tr_test.tokens.sum())},
        "static": {str(T): {"valid_ppl": tr_valid.ppl_at(T), "test_ppl": tr_test.ppl_at(T)}
                   for T in range(1, ceiling + 1)},
        "full_depth_seconds": full.seconds if full else None,
        "targets": {},
    }
    for target in targets:
        tau, valid_depth = calibrate_threshold(tr_valid.update, target)
        d_valid, d_test = stop_depths(tr_valid.update, tau), stop_depths(tr_test.update, tau)
        entry: dict[str, Any] = {
            "target": target, "tau": tau,
            "valid_mean_depth": float(d_valid.mean()), "test_mean_depth": float(d_test.mean()),
            "valid_ppl": tr_valid.ppl_at(d_valid), "test_ppl": tr_test.ppl_at(d_test),
            "test_depth_counts": {str(T): int(n) for T, n in zip(*np.unique(d_test, return_counts=True))},
            "early_exit": None,
        }
        if timed:
            ee = early_exit_eval(model, test, tau, ceiling, desc=f"early exit {target}", **kw)
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
    """Markdown in the paper's Table 9/10 layout, plus a details table per result.

    Args:
        results: {label: result of :func:`adaptive_depth` / :func:`adaptive_depth_checkpoint`};
            all results should share targets and ceiling (the first one sets the columns).
    """
    first = next(iter(results.values()))
    statics = _static_depths(first["ceiling"])
    targets = list(first["targets"])
    cols = ([f"Static T={statics[0]}"] + [f"Adaptive {t}" for t in targets]
            + [f"Static T={T}" for T in statics[1:]])
    rows = ["| model (test PPL) | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, res in results.items():
        cells = ([f"{res['static'][str(statics[0])]['test_ppl']:.2f}"]
                 + [f"{res['targets'][t]['test_ppl']:.2f}" for t in targets]
                 + [f"{res['static'][str(T)]['test_ppl']:.2f}" for T in statics[1:]])
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    out = ["\n".join(rows)]
    for label, res in results.items():
        det = [f"{label}: τ calibrated on valid ({res['examples']['valid']} windows), applied to test "
               f"({res['examples']['test']} windows), ceiling {res['ceiling']}.", "",
               "| target | τ | valid mean depth | test mean depth | valid PPL | test PPL | early-exit s | speedup |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for t, e in res["targets"].items():
            ee = e["early_exit"]
            timing = (f"{ee['seconds']:.2f} | {ee['speedup']:.2f}×" if ee and ee["speedup"] else "– | –")
            det.append(f"| {t} | {e['tau']:.4g} | {e['valid_mean_depth']:.2f} | {e['test_mean_depth']:.2f} | "
                       f"{e['valid_ppl']:.2f} | {e['test_ppl']:.2f} | {timing} |")
        if res.get("full_depth_seconds") is not None:
            det.append(f"\nAll examples to the ceiling: {res['full_depth_seconds']:.2f} s.")
        out.append("\n".join(det))
    return "\n\n".join(out)


def adaptive_depth_checkpoint(checkpoint: str | Path, *, targets: Sequence[float] = DEFAULT_TARGETS,
                              ceiling: int = DEFAULT_CEILING, dataset: str | None = None,
                              max_tokens: int | None = None, batch_size: int = 16, device: str = "cpu",
                              progress: bool = True, timed: bool = True) -> dict[str, Any]:
    """Adaptive depth of a checkpoint: τ calibrated on valid, test PPL and mean depths (SPEC §6).

    Uses the checkpoint's own tokenizer and the valid/test splits of its corpus (or ``dataset``),
    each cut to ``max_tokens`` + 1 tokens when given.

    Returns:
        JSON-ready dict::

            checkpoint, name, rule, architecture, dataset, params, ceiling, max_tokens, batch_size,
            examples: {valid, test}              windows (examples) per split
            tokens: {valid, test}                scored targets per split
            static: {"T": {valid_ppl, test_ppl}} fixed depth T = 1 … ceiling, from the same traces
            full_depth_seconds                   every test example to the ceiling (None untimed)
            targets: {"8": {target, tau, valid_mean_depth, test_mean_depth, valid_ppl, test_ppl,
                            test_depth_counts: {"T": examples stopping at T},
                            early_exit: None | {seconds, speedup, row_steps, full_row_steps,
                                                test_ppl, depth_agreement, max_abs_nll_diff}}}
            markdown                             Table 9 layout + details

    Raises:
        CheckpointError: damaged or missing checkpoint. FileNotFoundError: missing data split.
        ValueError: as :func:`adaptive_depth`.
    """
    from looplm.eval.runner import load_tokenizer_for
    from looplm.train.checkpoint import load_checkpoint

    model, cfg, _, ckpt = load_checkpoint(checkpoint, device=device)
    data_cfg = cfg.data if dataset is None else cfg.data.replace(dataset=dataset)
    tok = load_tokenizer_for(ckpt)
    root, cache = resolve_data_root(data_cfg.data_root), resolve_cache_dir(data_cfg.cache_dir)
    valid = load_tokens(data_cfg, "valid", tok, root, cache)
    test = load_tokens(data_cfg, "test", tok, root, cache)
    res = adaptive_depth(model, valid, test, targets=targets, ceiling=ceiling, max_tokens=max_tokens,
                         batch_size=batch_size, device=device, progress=progress, timed=timed)
    res = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
           "architecture": cfg.model.architecture, "dataset": data_cfg.dataset, "params": model.num_params(),
           **res}
    res["markdown"] = markdown_table({f"{cfg.name} ({data_cfg.dataset})": res})
    return res
