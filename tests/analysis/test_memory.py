"""analysis/memory.py: the live tensor bytes of a computation against counts made by hand."""

from __future__ import annotations

import torch

from looplm.analysis.memory import LiveBytes, peak_live_bytes
from looplm.model import build_model
from looplm.model.cursor import Readout

from helpers import VARIANTS, tiny

F32 = 4  # bytes


def test_an_allocation_pattern_gives_its_byte_peak():
    before = torch.zeros(300)  # created before the count: in-place ops and views of it add nothing
    with LiveBytes() as tally:
        a = torch.empty(1000)
        b = torch.empty(2000)  # 3000 floats live: the peak
        del a
        c = torch.empty(500)
        view = c[10:]  # same storage
        c.add_(1)
        before.mul_(2)
        before.view(3, 100)
        del c  # the view keeps its storage
        live = tally.live
        del view
    print(f"peak {tally.peak} B, live {live} B then {tally.live} B")
    assert tally.peak == 3000 * F32
    assert live == 2500 * F32 and tally.live == 2000 * F32
    del b
    assert tally.live == 0  # released after the count ended too


def test_backward_peaks_counted_by_hand():
    n, k = 1000, 5
    x = torch.randn(n, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(k):
            y = y.exp()  # exp saves its output for backward
        y.sum().backward()

    # k outputs (the last held by `y`, the others saved) and two gradients in flight (ExpBackward reads the
    # next one while writing its own), plus the 4-byte loss and its 4-byte seed
    got = peak_live_bytes(chain)
    print(f"exp chain: {got} B, by hand {(k + 2) * n * F32 + 2 * F32} B")
    assert got == (k + 2) * n * F32 + 2 * F32

    w = torch.randn(64, 32, requires_grad=True)
    inp = torch.randn(16, 64)
    # at mm's backward: w.grad (64·32) while the ReLU gradient (16·32), loss and seed are alive
    got = peak_live_bytes(lambda: (inp @ w).relu().sum().backward())
    print(f"linear + relu: {got} B, by hand {(64 * 32 + 16 * 32 + 2) * F32} B")
    assert got == (64 * 32 + 16 * 32 + 2) * F32


def test_a_training_step_is_counted_the_same_twice_and_leaves_its_gradients():
    cfg = tiny(**VARIANTS["huginn_linear-huginn"])
    counts = []
    for fused in (True, True, False):
        torch.manual_seed(0)
        model = build_model(cfg).train()
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        with LiveBytes() as tally:
            model(x, 3, x, readout=Readout(logits=False, fused_ce=fused)).loss.backward()
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        print(f"fused={fused}: peak {tally.peak} B, live after {tally.live} B, gradients {grads} B")
        # the step's only storages still alive are the parameters' gradients
        assert tally.live == grads > 0 and tally.peak > grads
        counts.append(tally.peak)
    assert counts[0] == counts[1]  # the same operators on the same shapes: the same bytes
