"""The task family interface, the registry and the one character vocabulary all families share (id 0 is
``<|endoftext|>``, the padding; ids 1 … len(CHARS) the characters)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from looplm.data.tokenizer import CharVocab

EOT = "<|endoftext|>"
#: the characters of every task (ids 1 … len(CHARS)); id 0 is <|endoftext|>, the padding
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+=;?:"
_VOCAB = CharVocab(CHARS, EOT)
PAD_ID = 0
encode, decode = _VOCAB.encode, _VOCAB.decode


def key_hash(*key: object) -> int:
    """A 64-bit integer hash of ``key`` (BLAKE2b of its ``|``-joined strings): a seed that is a pure function of it."""
    return int.from_bytes(hashlib.blake2b("|".join(map(str, key)).encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Instance:
    """One problem: ``prompt`` (text the model reads), ``answer`` (the text scored by exact match), ``k``;
    ``targets``: extra training targets ``(j, c)``, the readout at prompt token j trained to give the one token
    c (an earlier query's answer, a running sum)."""

    prompt: str
    answer: str
    k: int
    targets: tuple[tuple[int, str], ...] = ()


class TaskFamily:
    """Problems with a difficulty k ≥ 1: :meth:`make` one instance, :meth:`space` the number of distinct
    instances at k, capped at 10**9 (the default: every family whose prompt orders or draws many symbols)."""

    name: str = ""
    max_k: int = 64
    #: the family's tokens (the shared character vocabulary unless a family needs more)
    vocab: CharVocab = _VOCAB

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        raise NotImplementedError

    def make_train(self, k: int, k_train: int, rng: np.random.Generator) -> Instance:
        """A training instance whose scored answers each need ≤ k_train steps; by default :meth:`make`."""
        return self.make(k, rng)

    def views(self, inst: Instance) -> list[tuple[int, str]]:
        """``(k, prompt)`` of each held-out-form instance a training instance holds (all must stay unseen)."""
        return [(inst.k, inst.prompt)]

    def space(self, k: int) -> int:
        return 10**9

    def check_k(self, k: int, field: str = "k") -> None:
        """ValueError naming ``field`` unless 1 ≤ k ≤ max_k."""
        if not 1 <= k <= self.max_k:
            raise ValueError(f"{field}: task {self.name} needs 1 <= k <= {self.max_k}, got {k}")


TASKS: dict[str, TaskFamily] = {}


def register_task(cls: type[TaskFamily]) -> type[TaskFamily]:
    """Class decorator: an instance of ``cls`` into :data:`TASKS` under its name (ValueError if the name is taken)."""
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} is already registered")
    TASKS[cls.name] = cls()
    return cls


def get_task(name: str) -> TaskFamily:
    """The registered family ``name``; ValueError listing the known ones otherwise."""
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]
