"""Task instances as training batches and held-out sets (pure functions of seeds).

Held-out sets: per k, ``data.task_heldout`` distinct instances (at most a quarter of the k's space) seeded by
hash(task, k, split, task_seed); ``valid`` excludes ``test``. Training row r of step s (micro m): k uniform in
1 … task_k, seeded by hash(task, "train", task_seed, seed, s, m, r), redrawn while held out. Rows: one instance
at position 0, prompt then answer, padded with id 0; every target but the answer's (and a training row's
``Instance.targets``) is −100 (the prompts of ``phop`` and ``varchain`` are random symbols: a loss on
them would only add noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from looplm.config import DataConfig
from looplm.model import eval_mode
from looplm.model.cursor import Readout
from looplm.run.dist import unsharded
from looplm.tasks.base import PAD_ID, Instance, get_task, key_hash

HELDOUT_SPLITS = ("valid", "test")


def rng_for(*key: object) -> np.random.Generator:
    """A numpy generator seeded by a hash of ``key`` (a pure function of it)."""
    return np.random.default_rng(key_hash("looplm-task", *key))


@lru_cache(maxsize=256)
def heldout(task: str, k: int, split: str, size: int, seed: int) -> tuple[Instance, ...]:
    """The held-out instances of ``split`` ∈ {valid, test} at difficulty k, distinct by prompt (the answer is a
    function of it); ValueError: bad task, split or k."""
    family = get_task(task)
    family.check_k(k)
    if split not in HELDOUT_SPLITS:
        raise ValueError(f"split: got {split!r}; allowed: {', '.join(HELDOUT_SPLITS)}")
    n = min(size, family.space(k) // 4)
    taken = {i.prompt for i in heldout(task, k, "test", size, seed)} if split == "valid" else set()
    rng, out = rng_for(task, k, split, seed), {}
    while len(out) < n:
        inst = family.make(k, rng)
        if inst.prompt not in taken:
            out.setdefault(inst.prompt, inst)
    return tuple(out.values())


@lru_cache(maxsize=256)
def heldout_keys(task: str, k: int, size: int, seed: int) -> frozenset[str]:
    """Prompts of every held-out instance (valid and test) at difficulty k."""
    return frozenset(i.prompt for s in HELDOUT_SPLITS for i in heldout(task, k, s, size, seed))


def train_instances(cfg: DataConfig, n: int, *key: object) -> list[Instance]:
    """``n`` training instances for ``key`` (e.g. (seed, step, micro)), k uniform in 1 … task_k, none held out."""
    family, out = get_task(cfg.task), []
    for r in range(n):
        rng = rng_for(cfg.task, "train", cfg.task_seed, *key, r)
        k = int(rng.integers(1, cfg.task_k + 1))
        inst = family.make_train(k, cfg.task_k, rng)
        while any(p in heldout_keys(cfg.task, j, cfg.task_heldout, cfg.task_seed) for j, p in family.views(inst)):
            inst = family.make_train(k, cfg.task_k, rng)
        out.append(inst)
    return out


def rows(task: str, instances: list[Instance], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y int64 (N, L) of ``task``'s instances, L the longest instance − 1 (causal: more padding changes no
    score); ValueError when an instance does not fit ``seq_len``."""
    encode = get_task(task).vocab.encode
    enc = [(encode(i.prompt), encode(i.answer), i.k) for i in instances]
    L = max(len(p) + len(a) - 1 for p, a, _ in enc)
    if L > seq_len:
        k = max(k for p, a, k in enc if len(p) + len(a) - 1 == L)
        raise ValueError(f"model.seq_len: {seq_len} is too short for a k={k} instance; need >= {L}")
    x = torch.full((len(instances), L), PAD_ID, dtype=torch.long)
    y = torch.full((len(instances), L), -100, dtype=torch.long)
    for r, (p, a, _) in enumerate(enc):
        ids = p + a
        x[r, : len(ids) - 1] = torch.tensor(ids[:-1])
        y[r, len(p) - 1: len(ids) - 1] = torch.tensor(a)  # target j is token j + 1: the answer's tokens
        for j, c in instances[r].targets:
            (y[r, j],) = encode(c)
    return x, y


def heldout_windows(cfg: DataConfig, split: str, seq_len: int, batch_size: int, batches: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``batches`` (x, y, mask of real tokens) batches of held-out rows, as many of each k ≤ task_k (diagnostics)."""
    per_k = -(-batches * batch_size // cfg.task_k)
    insts = [i for k in range(1, cfg.task_k + 1) for i in heldout(cfg.task, k, split, cfg.task_heldout, cfg.task_seed)[:per_k]]
    x, y = rows(cfg.task, insts, seq_len)
    return [(x[i:i + batch_size], y[i:i + batch_size], x[i:i + batch_size] != PAD_ID)
            for i in range(0, min(len(x), batches * batch_size), batch_size)]


@torch.no_grad()
def accuracy_by_depth(model, x: torch.Tensor, y: torch.Tensor, depths: list[int], *, batch_size: int = 64,
                      device: torch.device | str = "cpu") -> dict[int, dict[str, float]]:
    """``{T: {"acc", "correct", "n", "nll" (per answer token)}}`` from one unroll per batch: correct iff the
    argmax at every answer target is right (teacher-forced, = greedy decoding returns the answer)."""
    with eval_mode(model):
        depths = sorted(set(depths))
        correct = {T: 0 for T in depths}
        nll = {T: 0.0 for T in depths}
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
            scored = yb != -100

            def read(T: int, _h, logits, yb=yb, scored=scored) -> None:  # read's on_depth hook
                if logits is not None:
                    hit = (logits.argmax(-1) == yb) | ~scored  # (B, L)
                    correct[T] += int(hit.all(-1).sum())

            with unsharded(model):  # validation of an FSDP-wrapped model bypasses its forward
                out = model.read(model.loop(xb), depths, yb, readout=Readout(logits=False, fused_ce=False),
                                 on_depth=read)
            for T in depths:
                nll[T] += float(out.nll_by_depth[T][scored].double().sum())
    n, n_tok = len(x), int((y != -100).sum())
    return {T: {"acc": correct[T] / n, "correct": correct[T], "n": n, "nll": nll[T] / n_tok} for T in depths}


@dataclass
class TaskData:
    """The data of a task run, with the trainer's :class:`~looplm.train.trainer.TrainData` interface."""

    cfg: DataConfig
    tokenizer_json: str
    vocab_size: int

    def batch(self, batch_size: int, seq_len: int, *, seed: int, step: int, micro: int = 0):
        """Training rows (module docstring): x, y int64 (B, L)."""
        return rows(self.cfg.task, train_instances(self.cfg, batch_size, seed, step, micro), seq_len)

    def validate(self, model, depth: int, *, batch_size: int, batches: int, device) -> dict[str, Any]:
        """``val_loss`` (answer NLL), ``val_ppl``, ``val_acc`` on ~batches × batch_size valid instances, even in k."""
        per_k = max(1, batches * batch_size // self.cfg.task_k)
        insts = [i for k in range(1, self.cfg.task_k + 1)
                 for i in heldout(self.cfg.task, k, "valid", self.cfg.task_heldout, self.cfg.task_seed)[:per_k]]
        r = accuracy_by_depth(model, *rows(self.cfg.task, insts, model.cfg.seq_len), [depth],
                              batch_size=batch_size, device=device)[depth]
        return {"val_loss": r["nll"], "val_ppl": math.exp(min(r["nll"], 700.0)), "val_acc": r["acc"]}


def task_data(cfg: DataConfig) -> TaskData:
    """The :class:`TaskData` of ``cfg`` (``dataset == "task"``)."""
    family = get_task(cfg.task)
    family.check_k(cfg.task_k, "data.task_k")
    tok = family.vocab.tokenizer()
    return TaskData(cfg=cfg, tokenizer_json=tok.to_str(), vocab_size=tok.get_vocab_size())
