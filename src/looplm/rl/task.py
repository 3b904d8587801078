"""Verifiable synthetic tasks for RL post-training, with their character-level vocabulary.

**Addition** (our choice of task; the paper trains on GSM8K and MBPP+, which a CPU model cannot learn):
D-digit addition at fixed width. A problem is ``"\na+b="`` with operands of 1 … D digits (the digit
count of each uniform, then the value uniform among the numbers with that count) written with D digits
(leading zeros), and its answer is the sum with D + 1 digits, e.g. for D = 3 ``"\n012+345="`` →
``"0357"``; the model's response ends with a newline (the EOS of RL sampling).

A **record** is one example, ``"\n" + "a+b=" + answer``: 3D + 4 tokens, all of the same length, so a
prompt always sits at positions 0 … 2D + 2 of its record. The pretraining **token stream**
(:meth:`AdditionTask.stream`) is records concatenated (each record's leading newline is the previous
answer's end); training windows start at multiples of the record length
(:attr:`AdditionTask.record_len`, the trainer's ``window_stride``), so every window holds whole records
at fixed positions, as the RL prompts are (position 0). With learned absolute positions this
alignment is what makes the task learnable at CPU scale: in a 2-digit pilot the same model reached 3%
greedy accuracy after 500 steps on windows at random offsets, 89% after 400 steps with one example per
row at position 0 (``experiments/lmdr-rl/README.md``). The pretraining config puts one record in each
window.

Data, all pure functions of a seed (so runs and resumes are reproducible):

- a **held-out set** (:meth:`AdditionTask.heldout`) of distinct problems that no training stream or RL
  batch ever contains (pretraining, RL prompts and evaluation are disjoint by construction);
- the **token stream** for supervised pretraining (train and valid streams differ);
- **RL prompts** (:meth:`AdditionTask.problems`): problems drawn for a key such as (seed, update).

The vocabulary is one token per character (``CHARS``) plus ``<|endoftext|>`` at id 0 (the padding id
of :func:`looplm.eval.generate.generate`); :func:`tokenizer` is the same map as a Hugging Face
``tokenizers.Tokenizer``, saved with every checkpoint as ``tokenizer.json`` (so ``looplm generate``
reads it like any other).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from looplm.data.tokenizer import CharVocab

EOT = "<|endoftext|>"
#: the characters of the task vocabulary, ids 1 … len(CHARS) (id 0 is <|endoftext|>)
CHARS = "\n0123456789+="
_VOCAB = CharVocab(CHARS, EOT)
VOCAB: dict[str, int] = _VOCAB.vocab
ID_TO_CHAR: dict[int, str] = _VOCAB.id_to_char
NEWLINE_ID = VOCAB["\n"]
encode, decode, tokenizer = _VOCAB.encode, _VOCAB.decode, _VOCAB.tokenizer


def _rng(*key: object) -> np.random.Generator:
    """A numpy generator seeded by a hash of ``key`` (a pure function of it)."""
    h = hashlib.blake2b("|".join(map(str, ("looplm-rl", *key))).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(h, "little"))


@dataclass(frozen=True)
class Problem:
    """One verifiable example: ``prompt`` (text the model continues) and ``answer`` (the reference text
    the reward compares the response with, without the trailing newline)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class AdditionTask:
    """Fixed-width D-digit addition ``a+b=`` → ``a+b`` (module docstring).

    Args:
        digits: D, the operand width.
        heldout_size: problems in the held-out set.
        seed: the task seed (held-out set and streams).

    Raises:
        ValueError: digits < 1, or a held-out set larger than half the problem space.
    """

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
        """(n, 2) int64 operands: each one's digit count uniform in 1 … D, then its value uniform among
        the numbers with that many digits (so short operands are as common as long ones)."""
        nd = rng.integers(1, self.digits + 1, size=(n, 2))
        lo = np.where(nd == 1, 0, 10 ** (nd - 1))
        return lo + (rng.random((n, 2)) * (10 ** nd - lo)).astype(np.int64)

    @cached_property
    def _heldout(self) -> np.ndarray:
        """(heldout_size, 2) distinct held-out operand pairs."""
        rng, seen, out = _rng(self.name, self.digits, self.seed, "heldout"), set(), []
        while len(out) < self.heldout_size:
            for a, b in self._operands(rng, self.heldout_size).tolist():
                if (a, b) not in seen and len(out) < self.heldout_size:
                    seen.add((a, b))
                    out.append((a, b))
        return np.asarray(out, dtype=np.int64).reshape(-1, 2)

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
    """The task registered as ``name`` with its options.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in TASKS:
        raise ValueError(f"task: unknown {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name](**kw)
