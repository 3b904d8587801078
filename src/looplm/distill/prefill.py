"""Distilled prefill (LMDR §3.2 Figure 3c, §5.5; arXiv:2610.06833; SPEC §8), and the teacher's targets.

The cursor ``teacher.loop(x, cache=...)`` resumes at depth R from ẑ = S_ψ(e) and runs the one recurrence
t = R and the coda into a ``terminal`` cache; decoding then runs the teacher at R with terminal KV sharing.
A student returning the exact z^R gives the teacher's terminal prefill with R + 1 recurrences
(tests/distill/test_distill.py). Cost: prelude + n_blocks + n_core + coda blocks, against prelude + R·n_core + coda.
"""

from __future__ import annotations

from typing import Callable

import torch

from looplm.distill.student import Student
from looplm.model import KVCache, LoopLM, LoopOutput
from looplm.model.cursor import Readout


def distilled_prefill(teacher: LoopLM, student: Student, idx: torch.Tensor, depth: int, cache: KVCache,
                      targets: torch.Tensor | None = None, *, attention_mask: torch.Tensor | None = None,
                      readout: Readout = Readout()) -> LoopOutput:
    """Prefill ``idx`` into the empty terminal ``cache`` through the student (module docstring).

    idx (B, L) int64 (left-padded with ``attention_mask``); ``depth`` the R of ẑ ≈ z^R (the pass runs recurrence
    R + 1 and reads out there); ``targets``, ``readout`` as for :meth:`~looplm.model.DepthLM.read`.
    ValueError: a cache that is not ``terminal`` or not empty (the student predicts only this chunk's endpoint), or
    depth < 1."""
    if cache.mode != "terminal":
        raise ValueError(f"distilled prefill: needs a terminal KV cache (terminal KV sharing), got {cache.mode!r}; "
                         "the student predicts only the endpoint z^R, not every recurrence's K/V")
    if cache.length:
        raise ValueError(f"distilled prefill: the cache already holds {cache.length} positions; the student "
                         "prefills a whole prompt into an empty cache")
    if depth < 1:
        raise ValueError(f"distilled prefill: depth R must be >= 1, got {depth}")
    key_valid = None if attention_mask is None else attention_mask.bool()
    loop = teacher.loop(idx, cache=cache, attention_mask=attention_mask)
    loop.resume(depth, student(loop.e, key_valid))  # ẑ (B, L, d) from the prelude output, which runs once
    return teacher.read(loop, depth + 1, targets, readout=readout)


def prefill_paths(teacher: LoopLM, student: Student | None, depth: int, early_depths: tuple[int, ...] = (3, 2, 1)
                  ) -> dict[str, tuple[int, Callable[..., LoopOutput]]]:
    """The prefill paths of LMDR Table 5, in its row order: ``{name: (teacher recurrences in the prefill,
    prefill(idx, cache, **kw))}``: ``teacher`` (R), ``teacher_r{r}`` for each early-stopped depth r < R
    (largest first) and ``distilled`` (one recurrence after the student; only with a student). A teacher path
    takes ``targets`` and ``readout`` as :meth:`looplm.model.DepthLM.read` does."""
    def teacher_prefill(r: int) -> tuple[int, Callable[..., LoopOutput]]:  # the teacher's own, at r recurrences
        return r, lambda idx, cache, **kw: teacher.read(teacher.loop(idx, cache=cache), r, **kw)

    paths = {"teacher": teacher_prefill(depth)}
    for r in sorted({int(r) for r in early_depths if 1 <= int(r) < depth}, reverse=True):
        paths[f"teacher_r{r}"] = teacher_prefill(r)
    if student is not None:
        paths["distilled"] = (1, lambda idx, cache, **kw: distilled_prefill(teacher, student, idx, depth, cache, **kw))
    return paths


@torch.no_grad()
def teacher_targets(teacher: LoopLM, x: torch.Tensor, depth: int, *, logits: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e, z^R, logits at R or None) of the teacher (used as is: put it in eval mode) on windows x (B, L):
    e and z^R (B, L, d), logits (B, L, V)."""
    loop = teacher.loop(x)
    out = teacher.read(loop, depth, readout=Readout(logits=logits))
    return loop.e, loop.h, out.logits if logits else None
