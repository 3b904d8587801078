"""looplm bench (apps/bench.py): the training-step memory figure."""

from __future__ import annotations

import torch

from looplm.apps.bench import huginn_config, peak_train_memory
from looplm.model import build_model

CPU = torch.device("cpu")


def test_cpu_training_memory_is_the_same_on_every_call():
    cfg = huginn_config(quick=True)
    fused = [peak_train_memory(cfg, 3, batch_size=2, device=CPU) for _ in range(2)]
    plain = peak_train_memory(cfg, 3, batch_size=2, device=CPU, fused=False)
    print(f"peak training-step bytes: fused {fused}, plain {plain}")
    # more than the fp32 gradients of every parameter (they stay alive after the step); the same on both calls
    grads = sum(p.numel() * 4 for p in build_model(cfg).parameters())
    assert fused[0] == fused[1] > grads and plain > grads
