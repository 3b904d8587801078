"""looplm bench (apps/bench.py): the interleaved rounds' call counts and the training-step memory figure.
No timing is asserted: the calls here report their own seconds."""

from __future__ import annotations

from collections import Counter

import torch

from looplm.apps.bench import huginn_config, interleaved, peak_train_memory
from looplm.model import build_model

CPU = torch.device("cpu")


def test_a_short_call_is_repeated_until_its_quarter_lasts_min_s():
    calls = Counter()

    def side(name: str, seconds: float):
        def call() -> float:
            calls[name] += 1
            return seconds  # its own seconds (binary fractions: the counts below are exact)
        return call

    iv = interleaved(side("a", 0.25), side("b", 0.5), rounds=3, repeat=3, device=CPU, min_s=1.0)
    # A: 1 s / 0.25 s = 4 calls a quarter; B: 1 s / 0.5 s = 2, below repeat = 3
    assert iv["calls"] == [4, 3]
    # one warm-up call and a sizing quarter each (4 and 2 calls), then two quarters per round
    assert calls == {"a": 1 + 4 + 3 * 2 * 4, "b": 1 + 2 + 3 * 2 * 3}
    assert iv["rounds"] == [2.0, 2.0, 2.0] and iv["median"] == 2.0 and (iv["a_s"], iv["b_s"]) == (0.25, 0.5)
    # a slow first call in the sizing quarter (a recompilation) costs calls, not the count: 0.75 + 2 × 0.125
    slow_first = iter([2.0, 0.75] + [0.125] * 100)
    assert interleaved(lambda: next(slow_first), side("b", 0.5), rounds=1, repeat=1, device=CPU,
                       min_s=1.0)["calls"] == [3, 2]
    # no floor: repeat calls, and no sizing quarter
    calls.clear()
    assert interleaved(side("a", 0.25), side("b", 0.5), rounds=2, repeat=1, device=CPU)["calls"] == [1, 1]
    assert calls == {"a": 1 + 2 * 2, "b": 1 + 2 * 2}


def test_cpu_training_memory_is_the_same_on_every_call():
    cfg = huginn_config(quick=True)
    fused = [peak_train_memory(cfg, 3, batch_size=2, device=CPU) for _ in range(2)]
    plain = peak_train_memory(cfg, 3, batch_size=2, device=CPU, fused=False)
    print(f"peak training-step bytes: fused {fused}, plain {plain}")
    # more than the fp32 gradients of every parameter (they stay alive after the step); the same on both calls
    grads = sum(p.numel() * 4 for p in build_model(cfg).parameters())
    assert fused[0] == fused[1] > grads and plain > grads
