"""Multi-operand modular addition: a running sum mod 10 over k operands (state tracking over k steps).

Prompt ``"d1+d2+…+dk="`` with digits d_i uniform in 0 … 9, answer (d_1 + … + d_k) mod 10, one digit:
the state s ← (s + d_i) mod 10 is updated k times from s = 0 (our choice of modulus; the task family
of arXiv:2502.17416 §2.1's multi-operand addition at CPU scale). There are 10**k instances at k.
"""

from __future__ import annotations

import numpy as np

from looplm.tasks.base import Instance, TaskFamily, register_task


@register_task
class ModSum(TaskFamily):
    name = "modsum"
    max_k = 64

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        digits = rng.integers(0, 10, k)
        return Instance(prompt="+".join(map(str, digits)) + "=", answer=str(int(digits.sum()) % 10), k=k)

    def space(self, k: int) -> int:
        return 10 ** min(k, 9)


@register_task
class ModSumPartial(ModSum):
    """``modsum`` whose training rows also supervise every running sum: the readout at operand i's digit is
    trained to give (d_1 + … + d_i) mod 10, the state after i updates (per-step supervision, as in looped
    models trained for length generalization, arXiv:2409.15647). Held-out instances are plain ``modsum`` prompts."""

    name = "modsum_partial"

    def make_train(self, k: int, k_train: int, rng: np.random.Generator) -> Instance:
        inst = self.make(k, rng)
        sums = np.cumsum([int(c) for c in inst.prompt[::2]]) % 10
        return Instance(inst.prompt, inst.answer, k, targets=tuple((2 * i, str(s)) for i, s in enumerate(sums)))
