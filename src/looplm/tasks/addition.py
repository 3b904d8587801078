"""Multi-digit addition with length generalization: k = the number of digits (the carry chain's length).

Prompt ``"a+b="`` with a, b uniform k-digit numbers; the answer a + b in k + 1 digits, least-significant first,
so each digit follows the carry it needs (our choice; the RL task writes it forwards).
"""

from __future__ import annotations

import numpy as np

from looplm.tasks.base import Instance, TaskFamily, register_task


def _number(k: int, rng: np.random.Generator) -> int:
    """Uniform among the k-digit numbers, digit by digit (10**k overflows int64 past k = 18)."""
    digits = rng.integers(0, 10, k)
    if k > 1:
        digits[0] = rng.integers(1, 10)
    return int("".join(map(str, digits)))


@register_task
class Addition(TaskFamily):
    name = "addition"
    max_k = 30

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        a, b = _number(k, rng), _number(k, rng)
        return Instance(prompt=f"{a}+{b}=", answer=f"{a + b:0{k + 1}d}"[::-1], k=k)


    def space(self, k: int) -> int:
        return min((10**k - (0 if k == 1 else 10 ** (k - 1))) ** 2, 10**9)
