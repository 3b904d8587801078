"""A run folder and the step loop that ``train``, ``distill`` and ``rl`` share (issue 26 §3).

A run folder holds ``.lock`` (:mod:`looplm.run.lock`), ``metrics.jsonl`` (one strict-JSON record per step),
``checkpoints/`` and ``latest`` (:mod:`looplm.run.checkpoint`) and, once finished, ``summary.json``.

Exact resume: a loop whose batches and draws are pure functions of (seed, step), and whose checkpoints keep the
optimizer, the schedule and :func:`rng_state`, continues from checkpoint k as if never stopped; :class:`Fit`
drops the metrics records logged after k, which the resumed run logs again.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from looplm.run.finite import clean, dumps
from looplm.run.checkpoint import CheckpointError, checkpoint_problems, list_checkpoints
from looplm.run.lock import RunLock

METRICS_FILE, SUMMARY_FILE = "metrics.jsonl", "summary.json"
RUN_FILES = (METRICS_FILE, SUMMARY_FILE, "checkpoints", "latest")  #: what every run writes into its folder


def run_state(step: int, seed: int, **more: Any) -> dict[str, Any]:
    """What every run's ``train_state.pt`` holds besides ``more``: the step, :func:`rng_state` and the data
    position (batches are functions of (seed, step))."""
    return {"step": step, "rng": rng_state(), "data_position": {"seed": seed, "step": step}, **more}


def rng_state() -> dict[str, Any]:
    """Every global RNG state (torch, CUDA, numpy, Python) as tensors, numbers and lists, so
    ``train_state.pt`` loads with ``torch.load(weights_only=True)`` (no pickled objects)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
                             "python": {"version": version, "state": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output (CUDA's where both the saving and this process have CUDA)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n, p = state["numpy"], state["python"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


class RunFolder:
    """The run folder ``path``: its lock, the checkpoint a resume starts from, and its summary."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metrics = self.path / METRICS_FILE

    @contextlib.contextmanager
    def start(self, *, resume: bool, what: str = "a run", hold: bool = True, writes: tuple[str, ...] = (),
              overwrite: bool | None = None) -> Iterator[Path | None]:
        """Hold the folder's lock for the block (RunLockedError if another process does; ``hold=False``: rank 0
        holds it for this process under torchrun), yielding the checkpoint to resume from
        (:meth:`resume_checkpoint`), or None for a fresh run. A block that fails before writing anything leaves
        no trace (no ``.lock`` either).

        A fresh run refuses (ValueError naming --out) a folder that holds checkpoints, and one that holds any
        file it would write (:data:`RUN_FILES` and ``writes``, e.g. a user's config.json, or a run that wrote no
        checkpoint) unless ``overwrite``; ``overwrite=None``: the command has no --overwrite."""
        existed = self.path.exists()
        before = {p.name for p in self.path.iterdir()} if existed else set()
        lock = RunLock(self.path).acquire() if hold else None
        ok = False
        try:
            if not resume and list_checkpoints(self.path):
                raise ValueError(f"--out {self.path} already holds {what}; continue it with --resume or choose "
                                 "another --out")
            found = [n for n in (*RUN_FILES, *writes) if (self.path / n).exists()] if not resume else []
            if found and not overwrite:
                raise ValueError(f"--out {self.path} already holds {', '.join(found)}, which a new run writes (the "
                                 "folder is not a looplm run, or its run wrote no checkpoint); " +
                                 ("choose another --out, or move them away" if overwrite is None else
                                  "pass --overwrite to replace them, or choose another --out"))
            yield self.resume_checkpoint() if resume else None
            ok = True
        finally:
            if lock is not None:
                lock.release()
                if not ok and lock.path.name not in before and \
                        {p.name for p in self.path.iterdir()} == before | {lock.path.name}:
                    lock.path.unlink()  # failed before writing anything (unreadable data, a refused folder)
                    if not existed:
                        self.path.rmdir()

    def resume_checkpoint(self) -> Path:
        """The newest checkpoint that passes verification, newer damaged ones skipped with a warning;
        CheckpointError (each one's reason) when none does."""
        problems = dict(checkpoint_problems(self.path))
        valid = [c for c in list_checkpoints(self.path) if c not in problems]
        if not valid:
            reasons = "; ".join(f"{c.name}: {e}" for c, e in problems.items()) or "none written yet"
            raise CheckpointError(f"--resume: no valid checkpoint under {self.path / 'checkpoints'} ({reasons})")
        for bad, err in problems.items():
            if bad.name > valid[-1].name:
                print(f"looplm: warning: skipping damaged checkpoint {bad.name} ({err}); resuming from "
                      f"{valid[-1].name}", file=sys.stderr)
        return valid[-1]


class Fit:
    """Steps ``start`` … ``end − 1`` of a run of ``total`` steps (``end``: ``total``, or ``start + stop_after``
    when given), as a context manager to iterate: each step's body reports its record with :meth:`log` (one
    line of ``metrics.jsonl`` and the progress bar); after the body, ``save(done)`` writes a checkpoint every
    ``ckpt_every`` steps and at ``end``; :meth:`evaluating` says when to validate. Entering truncates
    ``metrics.jsonl`` to the records of steps ≤ ``start`` (a resume; ``key`` names the step field) or deletes it
    (a fresh run, ``start`` = 0) and starts the clock ``t_start``; ``last`` is the latest record logged.
    ``write=False`` (ranks other than 0) leaves the files alone."""

    def __init__(self, folder: RunFolder, *, start: int, total: int, stop_after: int | None, ckpt_every: int,
                 save: Callable[[int], None], desc: str, eval_every: int = 0, unit: str = "step", key: str = "step",
                 progress: bool = True, write: bool = True):
        self.folder, self.start, self.total, self.ckpt_every, self.save = folder, start, total, ckpt_every, save
        self.eval_every = eval_every
        self.end = total if stop_after is None else min(total, start + stop_after)
        self.desc, self.unit, self.key, self.progress, self.write = desc, unit, key, progress, write

    def __enter__(self) -> "Fit":
        path = self.folder.metrics
        if self.write and path.exists():
            if self.start:
                keep = [line for line in path.read_text().splitlines()
                        if line.strip() and (json.loads(line).get(self.key) or 0) <= self.start]
                path.write_text("".join(line + "\n" for line in keep))
            else:
                path.unlink()
        self._log = path.open("a") if self.write else None
        self._bar = tqdm(total=self.total, initial=self.start, desc=self.desc, disable=not self.progress,
                         unit=self.unit, dynamic_ncols=True)
        self.t_start, self.last = time.time(), {}
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
        if self._log is not None:
            self._log.close()

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start, self.end):
            yield step
            done = step + 1
            if self.ckpt_every and done % self.ckpt_every == 0 or done == self.end:
                self.save(done)

    def evaluating(self, done: int) -> bool:
        """Whether to validate after ``done`` steps: every ``eval_every`` (0: never) and after the run's last."""
        return bool(self.eval_every and done % self.eval_every == 0 or done == self.total)

    def log(self, record: dict[str, Any], **postfix: Any) -> None:
        """Append ``record`` to ``metrics.jsonl`` (strict JSON) and advance the bar, showing ``postfix``."""
        self.last = record
        if self._log is not None:
            self._log.write(dumps(record) + "\n")
            self._log.flush()
        self._bar.update(1)
        self._bar.set_postfix(**postfix)

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """``summary`` as strict JSON (a NaN becomes null, listed in ``"nonfinite"``), written to ``summary.json``
        when this invocation finished the run (``end == total > start``); the stored one when the run had
        finished before (nothing left to do)."""
        path = self.folder.path / SUMMARY_FILE
        if self.write and self.end == self.total > self.start:
            path.write_text(dumps(summary, indent=2) + "\n")
        elif self.end == self.total and path.exists():
            return json.loads(path.read_text())
        return clean(summary)
