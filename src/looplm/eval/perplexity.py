"""Multi-depth perplexity in one unroll (SPEC §6): equal, to float rounding, to one fixed-depth run per depth."""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from looplm.data.tokens import eval_windows
from looplm.eval.exits import Batch
from looplm.model import LoopLM, eval_mode
from looplm.model.cursor import NLL
from looplm.run.dist import unsharded
from looplm.run.finite import md_table

DEFAULT_DEPTHS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48)


def token_batches(tokens: np.ndarray, seq_len: int, batch_size: int, *, max_tokens: int | None = None,
                  stride: int | None = None, device: str | torch.device = "cpu") -> Iterator[Batch]:
    """The windows (:func:`eval_windows`) of ``tokens[: max_tokens + 1]`` as :data:`~looplm.eval.exits.Batch` es
    on ``device`` (y = -100 on unscored targets); ValueError: fewer than two tokens."""
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    if len(tokens) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(tokens)}")
    return ((x.to(device), y.masked_fill(~mask, -100).to(device), mask.to(device))
            for x, y, mask in eval_windows(tokens, seq_len, batch_size, stride=stride))


@torch.no_grad()
def evaluate_depths(model: LoopLM, tokens: np.ndarray, depths: Sequence[int] = DEFAULT_DEPTHS, *,
                    batch_size: int = 16, max_tokens: int | None = None, stride: int | None = None,
                    device: str | torch.device = "cpu", progress: bool = True,
                    desc: str = "eval", scale_clamp: bool = False,
                    state_rms: bool = False) -> dict[int, dict[str, float]]:
    """``{T: {"nll": mean nats/token, "ppl", "tokens"}}`` over ``tokens[: max_tokens + 1]`` (NaN/inf kept: see
    :func:`nonfinite_depths`). ``stride``: sliding windows; ``state_rms``: also the mean and max per-token RMS
    of the read-out h_T (the blind spot's drift). ValueError: no depths or fewer than two tokens."""
    depths = sorted({int(t) for t in depths})
    if not depths:
        raise ValueError("depths: need at least one loop depth")
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    seq_len = model.cfg.seq_len
    batches = token_batches(tokens, seq_len, batch_size, stride=stride, device=device)
    with eval_mode(model):
        total_nll, rms_sum, rms_max = ({T: 0.0 for T in depths} for _ in range(3))
        count = 0
        n_windows = math.ceil((len(tokens) - 1) / (stride or seq_len))
        for x, y, mask in tqdm(batches, desc=desc, unit="batch", total=math.ceil(n_windows / batch_size),
                               disable=not progress, leave=False):

            def measure(T: int, h: torch.Tensor, _logits, mask=mask) -> None:  # read's on_depth hook
                if T in rms_sum:  # reduce h_T at once: no state is kept past its step
                    rms = h.double().pow(2).mean(-1).sqrt()[mask]
                    rms_sum[T] += float(rms.sum())
                    rms_max[T] = max(rms_max[T], float(rms.max()))

            with unsharded(model):  # an FSDP-wrapped model (validation during training) bypasses its forward here
                out = model.read(model.loop(x, scale_clamp=scale_clamp), depths, y, readout=NLL,
                                 on_depth=measure if state_rms else None)
            for T in depths:
                total_nll[T] += float(out.nll_by_depth[T][mask].double().sum())
            count += int(mask.sum())
    return {T: {"nll": total_nll[T] / count, "ppl": _exp(total_nll[T] / count), "tokens": count,
                **({"state_rms": rms_sum[T] / count, "state_rms_max": rms_max[T]} if state_rms else {})}
            for T in depths}


def _exp(nll: float) -> float:
    """exp(nll), inf past float range (math.exp raises OverflowError there)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


def nonfinite_depths(results: dict[int, dict[str, float]]) -> list[int]:
    """Depths of :func:`evaluate_depths` results whose NLL is NaN or ±inf."""
    return [T for T, r in results.items() if not math.isfinite(r["nll"])]


def markdown_table(results: dict[str, dict[int, dict[str, float]]], depths: Sequence[int]) -> str:
    """A Markdown table of PPL by depth: one row per named result, one column per depth."""
    rows = [[name, *(f"{res[T]['ppl']:.2f}" for T in depths)] for name, res in results.items()]
    return "\n".join(md_table(["model", *(f"T={T}" for T in depths)], rows, align="l" + "r" * len(depths)))
