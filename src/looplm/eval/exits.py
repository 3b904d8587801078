"""One exit-criterion system: criteria, calibration, offline traces and the early-exit runner (SPEC §6).

- **criteria** (:data:`EXIT_CRITERIA`): a statistic of loop k (vs k − 1) aggregated over a sequence's tokens:
  ``hidden_update`` (SCSE, arXiv:2607.27656 Tables 9–10), ``margin`` (the readout blind spot, Appendix H),
  ``relative``, ``kl``, ``entropy`` (Huginn, arXiv:2502.05171 §6), ``exit_gate`` and ``exit_cdf`` (Ouro,
  arXiv:2510.25741; cumulative, :meth:`ExitCriterion.carry_score`).
- **halting depths** (:func:`halting_depths`): ``D = min({k < C : criterion fires at k} ∪ {C})``.
- **calibration** (:func:`calibrate`): τ to a target mean depth (SCSE) or to a PPL tolerance (the blind spot).
- **the runner** (:func:`exit_loop`): steps a batch, testing after every loop; halted rows are dropped or
  (cached decoding) frozen. :func:`trace` is the offline accounting from one multi-depth forward, :func:`run`
  the runner over evaluation batches; the two agree (tests).

A logits criterion reads loop k with the final norm iff k ≥ the final depth, as ``forward`` does (no KV written).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from looplm.model.cursor import Loop, Readout, select_rows

UPDATE_EPS = 1e-8  # the denominator guard of the relative change (SPEC §6)

Direction = Literal["below", "above"]
#: an evaluation batch: inputs x (B, L) int64, targets y (B, L) int64 with -100 on unscored positions,
#: and the scored-token mask (B, L) bool (the tokens a sequence statistic aggregates over)
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def split_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device | str) -> list[Batch]:
    """(N, L) inputs and targets as :data:`Batch` es of ``batch_size`` rows on ``device`` (scored: y != -100)."""
    return [(xb.to(device), yb.to(device), (yb != -100).to(device))
            for xb, yb in zip(x.split(batch_size), y.split(batch_size))]


# ---------------------------------------------------------------------------------------------- criteria


class ExitCriterion:
    """An exit test: a per-token statistic of loop k, aggregated over a sequence (``aggregate``: "max" or
    "mean"), compared with τ: ``direction="below"`` fires when < τ, ``"above"`` when ≥ τ. Subclasses implement
    :meth:`score`; a cumulative one overrides :meth:`carry_score`."""

    name = ""
    direction: Direction = "below"
    aggregate = "mean"
    needs_logits = False
    needs_gate = False
    needs_previous = True  # the statistic at loop k compares with loop k − 1 (so loop 0 is read out too)
    #: the threshold used when none is given (``looplm generate --exit-tau``)
    default_tau = 0.0

    def __init__(self, tau: float):
        self.tau = float(tau)

    def score(self, prev_h: torch.Tensor | None, h: torch.Tensor | None, prev_logits: torch.Tensor | None = None,
              logits: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Per token: (..., d) hidden states, (..., V) logits, (...) gate logits (None if unneeded) → (...)."""
        raise NotImplementedError

    def carry_score(self, prev_h, h, prev_logits=None, logits=None, gate=None, carry=None
                    ) -> tuple[torch.Tensor, Any]:
        """``(score, carry)`` of loop k; ``carry`` is loop k − 1's (None at loop 1), batch first."""
        return self.score(prev_h, h, prev_logits, logits, gate), None

    def reduce(self, s: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) → (B,) by ``aggregate`` over ``valid`` tokens (a row without one: max 0, mean NaN)."""
        s = s.float()
        if valid is None:
            return s.amax(dim=1) if self.aggregate == "max" else s.mean(dim=1)
        if self.aggregate == "max":
            return s.masked_fill(~valid, 0.0).amax(dim=1)
        return s.masked_fill(~valid, 0.0).sum(dim=1) / valid.sum(dim=1)

    def halts(self, score: torch.Tensor) -> torch.Tensor:
        """Whether the criterion fires for each score (NaN never fires)."""
        return fires(score, self.tau, self.direction)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tau={self.tau})"


def fires(s, tau, direction: Direction):
    """``s < τ`` ("below") or ``s ≥ τ`` ("above"), elementwise on tensors or arrays; NaN never fires."""
    return s < tau if direction == "below" else s >= tau


def relative_change(prev_h: torch.Tensor, h: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """‖h − h_prev‖₂ / (‖h_prev‖₂ + 1e-8) over the last dim, computed in ``dtype``. (..., d) → (...)."""
    prev_h, h = prev_h.to(dtype), h.to(dtype)
    return (h - prev_h).norm(dim=-1) / (prev_h.norm(dim=-1) + UPDATE_EPS)


class HiddenUpdate(ExitCriterion):
    """SCSE's rule (SPEC §6): u_k = max over scored tokens of ‖h_k − h_{k−1}‖₂ / (‖h_{k−1}‖₂ + 1e-8) < τ."""

    name = "hidden_update"
    aggregate = "max"
    default_tau = 0.02  # our choice (the token-convergence threshold of SPEC §6)

    def score(self, prev_h, h, prev_logits=None, logits=None, gate=None):
        return relative_change(prev_h, h)


class RelativeChange(HiddenUpdate):
    """Huginn's latent-change rule (SPEC §6 ρ): the relative change, mean over tokens, < τ."""

    name = "relative"
    aggregate = "mean"


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), dim=-1)


class KLDivergence(ExitCriterion):
    """Huginn's ``KL(p_r ‖ p_{r−1}) < τ`` (nats), p the readout's softmax at loop r."""

    name = "kl"
    needs_logits = True
    default_tau = 5e-4  # our choice

    def score(self, prev_h, h, prev_logits, logits, gate=None):
        lp, lq = _log_probs(logits), _log_probs(prev_logits)
        return (lp.exp() * (lp - lq)).sum(-1)


class EntropyChange(ExitCriterion):
    """``|H(p_r) − H(p_{r−1})| < τ`` (nats), H the entropy of the readout's distribution."""

    name = "entropy"
    needs_logits = True
    default_tau = 1e-3  # our choice

    def score(self, prev_h, h, prev_logits, logits, gate=None):
        def entropy(z):
            lp = _log_probs(z)
            return -(lp.exp() * lp).sum(-1)

        return (entropy(logits) - entropy(prev_logits)).abs()


class LogitMargin(ExitCriterion):
    """The blind spot's rule (SPEC §6): top-1 − top-2 logit (= log-probability gap), mean over tokens, ≥ τ."""

    name = "margin"
    direction = "above"
    needs_logits = True
    default_tau = 2.0  # our choice

    needs_previous = False
    def score(self, prev_h, h, prev_logits, logits, gate=None):
        top2 = logits.float().topk(2, dim=-1).values  # (..., 2)
        return top2[..., 0] - top2[..., 1]


class ExitGate(ExitCriterion):
    """The learned exit gate (``model.exit_gate``, SPEC §4): λ_k = σ(gate(h_k)), mean over tokens, ≥ τ (our
    choice: each loop's own hazard; Ouro's cumulative rule is :class:`ExitCDF`)."""

    name = "exit_gate"
    direction = "above"
    needs_gate = True
    default_tau = 0.5  # our choice

    needs_previous = False
    def score(self, prev_h, h, prev_logits, logits, gate):
        return torch.sigmoid(gate.float())


class ExitCDF(ExitGate):
    """Ouro's early exit (arXiv:2510.25741, ``early_exit_threshold``): CDF_k = p_1 + … + p_k ≥ τ, with
    p_j = λ_j·S_{j−1}, S_j = S_{j−1}(1 − λ_j), S_0 = 1, summed in Ouro's order; carried (S_k, CDF_k).
    Default τ = 0.5, the exit distribution's median (our choice; Ouro's configs ship 1.0, the last loop)."""

    name = "exit_cdf"

    def carry_score(self, prev_h, h, prev_logits=None, logits=None, gate=None, carry=None):
        lam = self.score(prev_h, h, prev_logits, logits, gate)  # λ_k
        survive, cdf = (torch.ones_like(lam), torch.zeros_like(lam)) if carry is None else carry
        cdf = cdf + lam * survive  # CDF_k = CDF_{k−1} + p_k
        return cdf, (survive * (1.0 - lam), cdf)


EXIT_CRITERIA: dict[str, type[ExitCriterion]] = {c.name: c for c in (
    HiddenUpdate, RelativeChange, KLDivergence, EntropyChange, LogitMargin, ExitGate, ExitCDF)}


def exit_cdf_depths(exit_logits: Sequence[torch.Tensor], tau: float) -> torch.Tensor:
    """Ouro's per-token exit loop from the gate logits of loops 1 … T (T tensors, e.g. (B, L)): the first
    k < T with :class:`ExitCDF` ≥ τ, else T; int64 of a logit tensor's shape. ValueError: no logits."""
    if not exit_logits:
        raise ValueError("exit_cdf_depths: need the exit logits of at least one loop")
    crit, carry = ExitCDF(tau), None
    T = len(exit_logits)
    depth = torch.full(exit_logits[0].shape, T, dtype=torch.int64, device=exit_logits[0].device)
    for k, gate in enumerate(exit_logits[:-1], start=1):  # loop T is not tested: it exits anyway
        cdf, carry = crit.carry_score(None, None, gate=gate, carry=carry)
        depth = torch.where(crit.halts(cdf) & (depth == T), k, depth)  # the first firing loop wins
    return depth


def build_exit_criterion(name: str, tau: float | None = None) -> ExitCriterion:
    """The registered criterion ``name`` with ``tau`` (None: its default); KeyError listing the known ones."""
    if name not in EXIT_CRITERIA:
        raise KeyError(f"exit criterion: unknown {name!r}; known: {', '.join(sorted(EXIT_CRITERIA))}")
    cls = EXIT_CRITERIA[name]
    return cls(cls.default_tau if tau is None else tau)


def check_criterion(model, criterion: ExitCriterion, ceiling: int = 1) -> None:
    """Raise ValueError for a ceiling < 1, or when ``criterion`` needs something ``model`` lacks (an exit gate)."""
    if ceiling < 1:
        raise ValueError(f"ceiling must be >= 1, got {ceiling}")
    if criterion.needs_gate and getattr(model, "exit_gate", None) is None:
        raise ValueError(f"exit criterion {criterion.name!r} needs a model with a learned exit gate "
                         "(model.exit_gate, trained with train.supervision=exit_weighted)")


# ---------------------------------------------------------------------------------------------- halting depths


def halting_depths(scores: np.ndarray, tau: float, direction: Direction) -> np.ndarray:
    """(N,) int64 halting depths in [1, C]: the first loop k < C whose score (column k − 1 of (N, C)) fires,
    else C. ValueError for scores not (N, C ≥ 1) or a bad direction."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[1] < 1:
        raise ValueError(f"scores: expected shape (N, C) with C >= 1, got {s.shape}")
    if direction not in ("below", "above"):
        raise ValueError(f"direction: expected 'below' or 'above', got {direction!r}")
    return _depths_all(s, np.array([tau], dtype=np.float64), direction)[0]


# ---------------------------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """Outcome of :func:`calibrate`: τ (±∞: never halts early), (N,) depths under it, PPLs (None without NLL),
    and per candidate τ (M,), ascending."""

    tau: float
    depths: np.ndarray
    mean_depth: float
    ppl: float | None
    ppl_max: float | None
    taus: np.ndarray
    mean_depth_by_tau: np.ndarray
    ppl_by_tau: np.ndarray | None


def _candidates(scores: np.ndarray, direction: Direction) -> np.ndarray:
    """Ascending thresholds, one per distinct halting pattern: "above", every distinct finite score of loops
    1 … C−1 and +∞; "below", the smallest score, the midpoints (float noise cannot flip a halt) and one above all."""
    C = scores.shape[1]
    decide = scores[:, : C - 1]
    v = np.unique(decide[np.isfinite(decide)])
    if direction == "above":
        return np.append(v, np.inf)
    if len(v) == 0:
        return np.zeros(1)
    return np.concatenate([v[:1], (v[:-1] + v[1:]) / 2, [2 * abs(v[-1]) + 1.0]])


def _depths_all(scores: np.ndarray, taus: np.ndarray, direction: Direction) -> np.ndarray:
    """(M, N) halting depths of every candidate: 1 + #{k < C : the running max ("above") / min of the scores up
    to k does not fire} (the running statistic skips NaN; a leading NaN stays NaN and never fires)."""
    N, C = scores.shape
    depths = np.ones((len(taus), N), dtype=np.int64)
    running = (np.fmin if direction == "below" else np.fmax).accumulate(scores[:, : C - 1], axis=1)
    with np.errstate(invalid="ignore"):
        for k in range(C - 1):
            depths += ~fires(running[None, :, k], taus[:, None], direction)
    return depths


def calibrate(scores: np.ndarray, direction: Direction, *, target_depth: float | None = None,
              tolerance: float | None = None, nll: np.ndarray | None = None,
              tokens: np.ndarray | None = None) -> Calibration:
    """τ from a trace (``scores`` (N, C)), every candidate evaluated at once, by one objective:

    - ``target_depth``: mean halting depth closest to the target (SCSE; ties: the one not above it);
    - ``tolerance``: the earliest-halting τ whose dynamic PPL = exp(Σ_b nll[b, D_b − 1] / Σ_b tokens[b]) ≤
      (1 + tolerance) × the PPL at the ceiling (the blind spot, Appendix H); needs ``nll`` (N, C), ``tokens`` (N,).

    ValueError: not exactly one objective, an empty trace, a target outside [1, C], a negative tolerance, or
    mismatched shapes.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] == 0 or s.shape[1] == 0:
        raise ValueError(f"calibrate: need scores of shape (N, C) with N, C >= 1, got {s.shape}")
    if (target_depth is None) == (tolerance is None):
        raise ValueError("calibrate: give exactly one of target_depth and tolerance")
    N, C = s.shape
    if nll is not None or tokens is not None or tolerance is not None:
        if nll is None or tokens is None:
            raise ValueError("calibrate: need nll (N, C) and tokens (N,) for a PPL tolerance")
        nll = np.asarray(nll, dtype=np.float64)
        tokens = np.asarray(tokens, dtype=np.int64)
        if nll.shape != s.shape or tokens.shape != (N,):
            raise ValueError(f"calibrate: need scores (N, C), nll (N, C), tokens (N,); got {s.shape}, "
                             f"{nll.shape}, {tokens.shape}")
        if tokens.sum() <= 0:
            raise ValueError("calibrate: need at least one scored token")
    taus = _candidates(s, direction)
    depths = _depths_all(s, taus, direction)  # (M, N)
    mean_depth = depths.mean(axis=1)
    ppl_by_tau = ppl_max = None
    if nll is not None:
        total = float(tokens.sum())
        ppl_by_tau = np.exp(nll[np.arange(N)[None, :], depths - 1].sum(axis=1) / total)
        ppl_max = math.exp(nll[:, C - 1].sum() / total)
    if tolerance is not None:
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        ok = np.flatnonzero(ppl_by_tau <= (1.0 + tolerance) * ppl_max)
        best = int(ok[0] if direction == "above" else ok[-1])
    else:
        if not 1 <= target_depth <= C:
            raise ValueError(f"target mean depth {target_depth} outside [1, ceiling={C}]")
        # order the candidates by non-increasing mean depth: ascending τ for "below", descending for "above"
        order = np.arange(len(taus)) if direction == "below" else np.arange(len(taus))[::-1]
        # the first candidate not above the target (else the last, the shallowest)
        lo = min(int(np.searchsorted(-mean_depth[order], -target_depth)), len(order) - 1)
        best = int(order[lo])
        if lo > 0 and abs(mean_depth[order[lo - 1]] - target_depth) < abs(mean_depth[best] - target_depth):
            best = int(order[lo - 1])
    return Calibration(tau=float(taus[best]), depths=depths[best], mean_depth=float(mean_depth[best]),
                       ppl=None if ppl_by_tau is None else float(ppl_by_tau[best]), ppl_max=ppl_max,
                       taus=taus, mean_depth_by_tau=mean_depth, ppl_by_tau=ppl_by_tau)


# ---------------------------------------------------------------------------------------------- model runs


def _sequence_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed NLL (nats) per sequence over targets != -100: logits (B, L, V), y (B, L) → (B,) float64."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                          reduction="none").view_as(y)  # (B, L)
    return nll.double().sum(dim=1)


def _gate(model, h: torch.Tensor, criterion: ExitCriterion) -> torch.Tensor | None:
    return model.exit_gate(h).squeeze(-1) if criterion.needs_gate else None  # (B, L)


@dataclass
class LoopExit:
    """:func:`exit_loop` of B rows: (B,) halting depths, (B, C) float64 scores (NaN where not computed),
    Σ over loops of the rows stepped, and (``drop=False``) each row's (B, L, d) state at its exit."""

    depth: torch.Tensor
    scores: torch.Tensor
    row_steps: int
    h: torch.Tensor | None = None


def exit_loop(loop: Loop, criterion: ExitCriterion, ceiling: int, *, drop: bool = True,
              valid: torch.Tensor | None = None,
              on_exit: Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor | None], None] | None = None
              ) -> LoopExit:
    """The early-exit runner: advance ``loop`` (at t = 0, eval mode) through loops 1 … ``ceiling``, testing
    ``criterion`` after every loop k < ceiling.

    ``drop``: remove halted rows (:meth:`Loop.select`), else freeze them (:meth:`Loop.freeze`: copy-forward
    K/V) until all exited. ``valid``: (B, L) tokens a statistic aggregates over. ``on_exit(rows, k, h, logits)``
    when rows halt at loop k (input-batch indices, (n, L, d), and their (n, L, V) readout at k: the criterion's,
    else one without the cache, final iff k ≥ the final depth).
    ValueError: ceiling < 1, or the criterion needs an exit gate the model lacks.
    """
    model = loop.model
    check_criterion(model, criterion, ceiling)
    B, device = loop.state.shape[0], loop.state.device
    final_from = model.resolve_final_depth(None, ceiling)

    def read(h: torch.Tensor, k: int) -> torch.Tensor:  # an extra readout: leaves no trace in a cache
        return model.readout(h, final=k >= final_from, scope=loop.scope, record=False)

    fires = criterion.tau != (-math.inf if criterion.direction == "below" else math.inf)  # else skip the statistic
    use_logits = fires and criterion.needs_logits
    rows = torch.arange(B, device=device)  # input row of each running row
    depth = torch.full((B,), ceiling, dtype=torch.int64, device=device)
    scores = torch.full((B, ceiling), math.nan, dtype=torch.float64, device=device)
    exited = torch.zeros(B, dtype=torch.bool, device=device)
    logits = read(loop.h, 0) if use_logits and criterion.needs_previous else None
    carry = None  # a cumulative criterion's per-token state (ExitCriterion.carry_score)
    row_steps = 0
    for k in range(1, ceiling + 1):
        row_steps += len(rows)
        prev_h, h = loop.h, loop.advance()
        prev_logits, logits = logits, (read(h, k) if use_logits and k < ceiling else None)
        if k == ceiling:
            halt = ~exited
        elif not fires:
            halt = torch.zeros(len(rows), dtype=torch.bool, device=device)
        else:
            tok, carry = criterion.carry_score(prev_h, h, prev_logits, logits, _gate(model, h, criterion), carry)
            s = criterion.reduce(tok, valid)
            scores[rows, k - 1] = s.double()
            halt = criterion.halts(s) & ~exited
        if bool(halt.any()):
            done = halt.nonzero().squeeze(1)
            depth[rows[done]] = k
            if on_exit is not None:
                h_done = h.index_select(0, done)
                on_exit(rows[done], k, h_done, model.readout(h_done, final=k >= final_from) if logits is None
                        else logits.index_select(0, done))
            if drop:
                keep = (~halt).nonzero().squeeze(1)
                if len(keep) == 0:
                    break
                logits, valid, rows, carry = select_rows((logits, valid, rows, carry), keep, len(rows))
                loop.select(keep)
                exited = exited.index_select(0, keep)
            else:
                exited = exited | halt
                loop.freeze(exited)  # later visits of exited rows write their exit visit's K/V
                if bool(exited.all()):
                    break
    return LoopExit(depth=depth, scores=scores, row_steps=row_steps, h=None if drop else loop.h)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ExitRun:
    """Per example of :func:`run` (batch order): halting depth, summed NLL (nats) there, (N, C) scores and
    scored tokens; the compute's wall time and Σ over loops of the running rows."""

    depth: np.ndarray
    nll: np.ndarray
    scores: np.ndarray
    tokens: np.ndarray
    seconds: float
    row_steps: int

    def ppl(self) -> float:
        return math.exp(self.nll.sum() / self.tokens.sum())


@torch.inference_mode()
def run(model, batches: Sequence[Batch], criterion: ExitCriterion, ceiling: int, *, progress: bool = False,
        desc: str = "early exit", scale_clamp: bool = False) -> ExitRun:
    """Real early exit (:func:`exit_loop`, ``drop=True``, eval mode), each example's NLL at its halting depth;
    equals :func:`trace` + :func:`halting_depths` up to float rounding."""
    device = batches[0][0].device
    parts, row_steps = [], 0  # per batch: depth, nll, scores, tokens
    sync_device(device)
    t0 = time.perf_counter()
    for x, y, mask in tqdm(batches, desc=desc, disable=not progress, leave=False, unit="batch"):
        nll = torch.zeros(len(x), dtype=torch.float64, device=device)

        def score(rows, k, h, logits, y=y):
            nll[rows] = _sequence_nll(logits, y.index_select(0, rows))

        res = exit_loop(model.loop(x, scale_clamp=scale_clamp), criterion, ceiling, drop=True, valid=mask,
                        on_exit=score)
        row_steps += res.row_steps
        parts.append((res.depth, nll, res.scores, mask.sum(dim=1)))
    sync_device(device)
    seconds = time.perf_counter() - t0
    depth, nll, scores, tokens = (torch.cat(p).cpu().numpy() for p in zip(*parts))
    return ExitRun(depth=depth, nll=nll, scores=scores, tokens=tokens.astype(np.int64), seconds=seconds,
                   row_steps=row_steps)


@dataclass
class Trace:
    """Offline accounting of N examples to the ceiling C: (N, C) statistics and summed NLLs, (N,) tokens."""

    scores: np.ndarray
    nll: np.ndarray
    tokens: np.ndarray

    def ppl_at(self, depths: np.ndarray | int) -> float:
        """Token-weighted PPL with example b read out at ``depths[b]`` (or one depth for all)."""
        d = np.broadcast_to(np.asarray(depths, dtype=np.int64), self.tokens.shape)
        return math.exp(self.nll[np.arange(len(d)), d - 1].sum() / self.tokens.sum())


@torch.inference_mode()
def trace(model, batches: Sequence[Batch], criterion: ExitCriterion, ceiling: int, *, progress: bool = False,
          desc: str = "trace", scale_clamp: bool = False) -> Trace:
    """One multi-depth forward per batch (depths 1 … C, and 0 for a logits criterion comparing with loop 0),
    recording the statistic and NLL per depth through ``on_depth``. ValueError as :func:`exit_loop`."""
    check_criterion(model, criterion, ceiling)
    depths = list(range(0 if criterion.needs_logits and criterion.needs_previous else 1, ceiling + 1))
    parts = []  # per batch: scores, nll, tokens
    for x, y, mask in tqdm(batches, desc=desc, disable=not progress, leave=False, unit="batch"):
        s = torch.zeros(len(x), ceiling, dtype=torch.float64)
        prev: dict[str, Any] = {}

        def on_depth(T, h, logits, s=s, prev=prev, mask=mask):
            if T > 0:
                tok, prev["carry"] = criterion.carry_score(prev.get("h"), h, prev.get("logits"), logits,
                                                           _gate(model, h, criterion), prev.get("carry"))
                s[:, T - 1] = criterion.reduce(tok, mask).double().cpu()
            prev["h"], prev["logits"] = h, logits

        # the plain readout: the hook reads every requested depth's logits
        out = model.read(model.loop(x, scale_clamp=scale_clamp), depths, y,
                         readout=Readout(logits=False, fused_ce=False), on_depth=on_depth)
        nll = torch.stack([out.nll_by_depth[T].double().sum(1) for T in range(1, ceiling + 1)], 1)  # (B, C)
        parts.append((s, nll.cpu(), mask.sum(dim=1).cpu()))
    scores, nll, tokens = (torch.cat(p).numpy() for p in zip(*parts))
    return Trace(scores=scores, nll=nll, tokens=tokens.astype(np.int64))
