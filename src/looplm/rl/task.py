"""Verifiable synthetic tasks for RL post-training, with their character-level vocabulary.

**Addition** (our choice; the paper's GSM8K and MBPP+ are out of a CPU model's reach): ``"\na+b="`` with
operands of 1 … D digits written with D digits, answer the sum with D + 1 digits (D = 3: ``"\n012+345="`` →
``"0357"``), the response ending in a newline (RL's EOS). A record ``"\n" + "a+b=" + answer`` has 3D + 4
tokens; the pretraining stream concatenates records and training windows start at multiples of
:attr:`AdditionTask.record_len` (``window_stride``), so prompts sit at fixed positions as in RL: with
learned positions this alignment makes the task learnable at CPU scale (``experiments/lmdr-rl/README.md``).
Held-out set, streams and RL prompts are pure functions of a seed and disjoint by construction. The
vocabulary is one token per character plus ``<|endoftext|>`` at id 0; :func:`tokenizer` is the same map as a
``tokenizers.Tokenizer`` (saved with each checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from looplm.data.tokenizer import CharVocab
from looplm.tasks.base import key_hash

EOT = "<|endoftext|>"
#: the characters of the task vocabulary, ids 1 … len(CHARS) (id 0 is <|endoftext|>)
CHARS = "\n0123456789+="
_VOCAB = CharVocab(CHARS, EOT)
VOCAB: dict[str, int] = _VOCAB.vocab
NEWLINE_ID = VOCAB["\n"]
encode, decode, tokenizer = _VOCAB.encode, _VOCAB.decode, _VOCAB.tokenizer


def _rng(*key: object) -> np.random.Generator:
    """A numpy generator seeded by a hash of ``key`` (a pure function of it)."""
    return np.random.default_rng(key_hash("looplm-rl", *key))


@dataclass(frozen=True)
class Problem:
    """One verifiable example: the ``prompt`` to continue and the reference ``answer`` (no trailing newline)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class AdditionTask:
    """Fixed-width D = ``digits`` addition ``a+b=`` → ``a+b`` (module docstring). Raises ValueError for digits < 1
    or a held-out set larger than half the problem space."""

    digits: int = 3
    heldout_size: int = 500
    seed: int = 0

    name = "addition"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits: need >= 1, got {self.digits}")
        if self.heldout_size * 2 > self.space:
            raise ValueError(f"heldout_size: {self.heldout_size} is more than half of the {self.space} problems "
                             f"with {self.digits} digits")

    @property
    def space(self) -> int:
        """Number of distinct problems (ordered pairs of operands)."""
        return (10 ** self.digits) ** 2

    @property
    def record_len(self) -> int:
        """Tokens of one record ``"\na+b=c"``: 3D + 4 (the response budget is D + 2: the sum and the newline)."""
        return 3 * self.digits + 4

    def _operands(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n, 2) int64 operands: digit count uniform in 1 … D, then the value uniform among those numbers."""
        nd = rng.integers(1, self.digits + 1, size=(n, 2))
        lo = np.where(nd == 1, 0, 10 ** (nd - 1))
        return lo + (rng.random((n, 2)) * (10 ** nd - lo)).astype(np.int64)

    @cached_property
    def _heldout(self) -> np.ndarray:
        """(heldout_size, 2) distinct held-out operand pairs."""
        rng, pairs = _rng(self.name, self.digits, self.seed, "heldout"), {}  # a dict: distinct, in draw order
        while len(pairs) < self.heldout_size:
            pairs.update(dict.fromkeys(map(tuple, self._operands(rng, self.heldout_size).tolist())))
        return np.asarray(list(pairs)[:self.heldout_size], dtype=np.int64).reshape(-1, 2)

    @cached_property
    def _heldout_set(self) -> set[tuple[int, int]]:
        return {tuple(p) for p in self._heldout.tolist()}

    def _training_pairs(self, n: int, *key: object) -> np.ndarray:
        """(n, 2) operands drawn for ``key``, none of them in the held-out set."""
        rng, out = _rng(self.name, self.digits, self.seed, *key), []
        while len(out) < n:
            out += [p for p in map(tuple, self._operands(rng, n).tolist()) if p not in self._heldout_set]
        return np.asarray(out[:n], dtype=np.int64)

    def _problem(self, a: int, b: int) -> Problem:
        D = self.digits
        return Problem(prompt=f"\n{a:0{D}d}+{b:0{D}d}=", answer=f"{a + b:0{D + 1}d}")

    def heldout(self) -> list[Problem]:
        """The held-out evaluation problems (distinct; never in a stream or an RL batch)."""
        return [self._problem(a, b) for a, b in self._heldout.tolist()]

    def problems(self, n: int, *key: object) -> list[Problem]:
        """``n`` training problems drawn for ``key`` (e.g. ``("rl", seed, update)``)."""
        return [self._problem(a, b) for a, b in self._training_pairs(n, *key).tolist()]

    def stream(self, n_records: int, split: str = "train") -> np.ndarray:
        """``n_records`` records (module docstring) concatenated: ``n_records · record_len`` ids (uint8),
        drawn for ``split`` (train and valid streams differ; neither holds a held-out problem)."""
        pairs = self._training_pairs(n_records, "stream", split)
        text = "".join(self._problem(a, b).prompt + self._problem(a, b).answer for a, b in pairs.tolist())
        return np.asarray(encode(text), dtype=np.uint8)


TASKS = {"addition": AdditionTask}


def build_task(name: str, **kw) -> AdditionTask:
    """The task registered as ``name`` with its options; ValueError (listing the known ones) for an unknown name."""
    if name not in TASKS:
        raise ValueError(f"task: unknown {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name](**kw)
