"""p-hop induction (Sanford et al. 2024; a looped-model benchmark of Saunshi et al., arXiv:2502.17416 §2.1;
the paper is not in our shared copies, so this is the standard definition, not checked against its text).

One hop from position i goes to j + 1, j < i the last earlier position with v_j = v_i; the answer is v at
σ^p(n), k = p. Sequences never repeat a symbol at once (every hop moves back) and are redrawn until all p hops
exist. Prompt ``"pp:" + v_1 … v_n + "="``; our sizes: 64 positions over 4 symbols.
"""

from __future__ import annotations

import numpy as np

from looplm.tasks.base import Instance, TaskFamily, register_task

ALPHABET = "abcd"
N_SYMBOLS = 64


def hop_chain(seq: str, p: int) -> list[int] | None:
    """Positions visited by p hops from the last one (0-based, p + 1 entries), None where a hop has no
    earlier occurrence to follow."""
    i, path = len(seq) - 1, [len(seq) - 1]
    for _ in range(p):
        j = seq.rfind(seq[i], 0, i)
        if j < 0:
            return None
        i = j + 1
        path.append(i)
    return path


@register_task
class PHop(TaskFamily):
    name = "phop"
    max_k = 24  # draws redrawn for a missing hop: ~79% at k = 24, ~97% at k = 28 (64 symbols over 4)

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        while True:
            steps = rng.integers(1, len(ALPHABET), N_SYMBOLS)  # a nonzero shift: never the previous symbol
            seq = "".join(ALPHABET[i] for i in np.cumsum(steps) % len(ALPHABET))
            path = hop_chain(seq, k)
            if path is not None:
                return Instance(prompt=f"{k:02d}:{seq}=", answer=seq[path[-1]], k=k)
