"""Distilled prefill (LMDR §3.2 Figure 3c, §5.5; arXiv:2610.06833; SPEC §8), and the teacher's targets.

**Prefill path.** The teacher's prelude computes e = P_θ(x); the student predicts ẑ = S_ψ(e) ≈ z^R; one
teacher recurrence from ẑ and the coda follow, and each physical attention layer's K/V of that pass
fill a ``terminal`` :class:`~looplm.model.kvcache.KVCache` (prelude and coda: their only visit; core:
the one recurrence). Decoding is unchanged: the teacher runs at its depth R and reads those banks
through terminal KV sharing. This is one read of the one loop: the cursor
``teacher.loop(x, cache=...)`` resumes at depth R from ẑ (:meth:`~looplm.model.cursor.Loop.resume`; the
student is called on e after the prelude) and runs loop step t = R, the recurrence that follows z^R.
So a student that returns the teacher's exact z^R gives exactly the banks and logits of the
teacher's terminal-sharing prefill with R + 1 recurrences, which at a fixed point (z^{R+1} = z^R) is the
prefill with R (tests/distill/test_distill.py). Cost: prelude + n_blocks + n_core + coda blocks, against
prelude + R·n_core + coda for the teacher.
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

    Args:
        teacher: the looped teacher. student: its student (:func:`~looplm.distill.student.load_student`).
        idx: (B, L) int64 prompt ids (left-padded with ``attention_mask``).
        depth: the teacher depth R the student stands for (its ẑ ≈ z^R); the pass runs recurrence R + 1.
        cache: an empty ``terminal`` KV cache; filled here.
        targets, readout: as for :meth:`looplm.model.DepthLM.read`; attention_mask: as for
            :meth:`looplm.model.DepthLM.loop`.

    Returns:
        The forward's :class:`~looplm.model.LoopOutput` (its readout at depth R + 1, the one recurrence).

    Raises:
        ValueError: a cache that is not ``terminal`` (the student predicts the endpoint only, so only
            terminal banks can be rebuilt from it) or not empty (the student sees only this chunk); a
            depth < 1.
    """
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


def teacher_prefill(teacher: LoopLM, idx: torch.Tensor, depth: int, cache: KVCache,
                    targets: torch.Tensor | None = None, *, readout: Readout = Readout()) -> LoopOutput:
    """The teacher's own prefill at ``depth`` recurrences (R, or fewer: early-stopped) into ``cache``;
    ``targets``, ``readout`` as for :meth:`looplm.model.DepthLM.read`."""
    return teacher.read(teacher.loop(idx, cache=cache), depth, targets, readout=readout)


def prefill_paths(teacher: LoopLM, student: Student | None, depth: int, early_depths: tuple[int, ...] = (3, 2, 1)
                  ) -> dict[str, tuple[int, Callable[..., LoopOutput]]]:
    """The prefill paths of LMDR Table 5, in its row order: ``{name: (teacher recurrences in the prefill,
    prefill(idx, cache, **kw))}``: ``teacher`` (R), ``teacher_r{r}`` for each early-stopped depth r < R
    (largest first) and ``distilled`` (one recurrence after the student; only with a student)."""
    paths: dict[str, tuple[int, Callable[..., LoopOutput]]] = {
        "teacher": (depth, lambda idx, cache, **kw: teacher_prefill(teacher, idx, depth, cache, **kw))}
    for r in sorted({int(r) for r in early_depths if 1 <= int(r) < depth}, reverse=True):
        paths[f"teacher_r{r}"] = (r, lambda idx, cache, r=r, **kw: teacher_prefill(teacher, idx, r, cache, **kw))
    if student is not None:
        paths["distilled"] = (1, lambda idx, cache, **kw: distilled_prefill(teacher, student, idx, depth, cache, **kw))
    return paths


@torch.no_grad()
def teacher_targets(teacher: LoopLM, x: torch.Tensor, depth: int, *, logits: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the student learns from, for windows x (B, L): (e, z^R, teacher logits at R or None), e and z^R
    (B, L, d), logits (B, L, V). e is the prelude output (:meth:`~looplm.model.DepthLM.embed`), z^R the
    hidden state at depth R (readout coordinates) of the teacher's forward; the teacher is used as is
    (put it in eval mode: dropout off, and the Huginn family's fixed evaluation noise table)."""
    loop = teacher.loop(x)
    out = teacher.read(loop, depth, readout=Readout(logits=logits))
    return loop.e, loop.h, out.logits if logits else None


def student_readout(teacher: LoopLM, z_hat: torch.Tensor, depth: int) -> torch.Tensor:
    """The teacher's coda + readout applied to ẑ as to a state at depth R: (B, L, d) → (B, L, V) logits
    (p̂ of eq. 4; the final norm of a ``final_only_norm`` readout as at depth R)."""
    final = depth >= teacher.resolve_final_depth(None, depth)
    return teacher.readout(z_hat, final=final)
