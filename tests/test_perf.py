"""Issue 15 performance paths against their plain references: the fused gate+up projection (same
initial values as the separate matrices, old checkpoints load), the fused chunked readout +
cross-entropy (loss and gradients against ``F.cross_entropy`` on full logits for every readout mode,
tied and untied, with ignored targets, fp32 and bf16 autocast), the static KV cache, prefill that
reads out only the last position, compiled decoding and the FLOP proxy against ``FlopCounterMode``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ModelConfig
from looplm.model import build_model
from looplm.model import layers as layers_mod


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_heads=4, d_ff=64, seq_len=24, dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


class _SeparateSwiGLU(nn.Module):
    """The layout before the fusion: separate gate and up matrices (drawn in this order)."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d, d_ff, bias=False)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _old_model(cfg: ModelConfig, seed: int, monkeypatch) -> nn.Module:
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "SwiGLU", _SeparateSwiGLU)
        torch.manual_seed(seed)
        return build_model(cfg)


@pytest.mark.parametrize("kw", [dict(), dict(residual="deeploop", residual_depth=3, n_core=2),
                                dict(n_prelude=1, n_core=2, n_coda=1, rule="looped"),
                                dict(architecture="unshared", n_layers=2)])
def test_fused_gate_up_initializes_as_the_separate_matrices(kw, monkeypatch):
    """A fresh model draws exactly the values of the pre-fusion layout (same seed, same RNG order), so
    committed experiments reproduce bit for bit; Post-LN β scales both halves."""
    cfg = tiny(**kw)
    old = _old_model(cfg, 3, monkeypatch)
    torch.manual_seed(3)
    new = build_model(cfg)
    old_sd, new_sd = old.state_dict(), new.state_dict()
    n_fused = 0
    for k, v in new_sd.items():
        if k.endswith("mlp.gate_up.weight"):
            p = k[: -len("gate_up.weight")]
            assert torch.equal(v, torch.cat([old_sd[p + "gate.weight"], old_sd[p + "up.weight"]]))
            n_fused += 1
        else:
            assert torch.equal(v, old_sd[k]), k
    assert n_fused > 0
    # the outputs agree too (the fused matmul computes the same rows)
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    torch.testing.assert_close(new(x, depth=2).logits, old(x, depth=2).logits, rtol=1e-6, atol=1e-6)


def test_old_checkpoint_layout_loads_strictly(monkeypatch, tmp_path):
    """A state dict (and a safetensors file) with separate gate/up matrices loads into the fused model
    with strict=True; unrelated missing or unexpected keys still fail."""
    from safetensors.torch import load_model, save_model

    cfg = tiny(n_prelude=1, n_coda=1, rule="looped")
    old = _old_model(cfg, 5, monkeypatch)
    torch.manual_seed(0)
    new = build_model(cfg)
    new.load_state_dict(old.state_dict(), strict=True)
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    torch.testing.assert_close(new(x, depth=3).logits, old(x, depth=3).logits, rtol=1e-6, atol=1e-6)
    save_model(old, str(tmp_path / "old.safetensors"))
    again = build_model(cfg)
    load_model(again, str(tmp_path / "old.safetensors"), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), new.state_dict().values()))
    bad = old.state_dict()
    bad.pop("core.blocks.0.mlp.up.weight")  # half of the pair: nothing is migrated, strict loading fails
    with pytest.raises(RuntimeError):
        build_model(cfg).load_state_dict(bad, strict=True)
