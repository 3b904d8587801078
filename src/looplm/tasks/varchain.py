"""Variable-binding chains with a distractor chain: ``a=3;b=a;c=b;…?c`` with k links.

The main chain binds x_1 to a digit and each x_{i+1} to x_i (k statements); the query x_k needs k
look-ups to reach the digit. A distractor chain of k statements over other letters ends in another
digit. The 2k statements are interleaved at random, each chain in its own order (so every variable is
bound before it is read); the 2k letters are distinct, drawn from a … z (hence k ≤ 13). Prompt:
``"s_1;s_2;…;s_2k?x_k="``, each statement ``"x=y"``; answer: the digit, one token.
"""

from __future__ import annotations

import numpy as np

from looplm.tasks.base import Instance, TaskFamily, register_task

LETTERS = "abcdefghijklmnopqrstuvwxyz"


@register_task
class VarChain(TaskFamily):
    name = "varchain"
    max_k = 13

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        names = [LETTERS[i] for i in rng.permutation(26)[: 2 * k]]
        main, other = names[:k], names[k:]
        value, distractor = (int(v) for v in rng.choice(10, 2, replace=False))
        chains = [[f"{c[0]}={v}"] + [f"{c[i]}={c[i - 1]}" for i in range(1, k)]
                  for c, v in ((main, value), (other, distractor))]
        order = rng.permutation([0] * k + [1] * k)  # which chain's next statement comes next
        pos, stmts = [0, 0], []
        for c in order:
            stmts.append(chains[c][pos[c]])
            pos[c] += 1
        return Instance(prompt=";".join(stmts) + f"?{main[-1]}=", answer=str(value), k=k)
