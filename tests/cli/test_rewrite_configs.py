"""``scripts/rewrite_configs.py``: config format 2 (one flat ``train`` section) → format 3 (the typed
sections ``depth``, ``optim`` and ``train.gradient``). The format-2 configs in
``fixtures/format2/configs.json`` are stored ones, verbatim, from commit dae641b (the lmdr-ablation
sweep: fixed / pln / learned samplers with bptt and tbptt; a depth-testbed run that predates
``train.prior_init`` and ``model.block_init``). Each rewritten config must equal the one built here by
hand from the format-3 sections, and rewriting again changes nothing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from looplm.config import (BPTTConfig, Config, DataConfig, FixedDepthConfig, LearnedDepthConfig, ModelConfig,
                           OptimConfig, PLNDepthConfig, TBPTTConfig, TrainConfig, UniformDepthConfig)

ROOT = Path(__file__).resolve().parents[2]
FORMAT2 = json.loads((ROOT / "tests" / "fixtures" / "format2" / "configs.json").read_text())


def _script():
    spec = importlib.util.spec_from_file_location("rewrite_configs", ROOT / "scripts" / "rewrite_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rewrite_configs = _script()

# the lmdr-ablation base: preset huginn-cpu, 1,000 steps, warm-up 50
HUGINN = ModelConfig(rule="huginn_linear", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=128,
                     dropout=0.0, n_prelude=1, n_core=2, n_coda=1)
BROWN = DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=8192)
LMDR_OPTIM = OptimConfig(lr=2e-3, warmup_steps=50, schedule="wsd", beta2=0.98)


def _lmdr(name: str, depth, gradient) -> Config:
    return Config(name=name, model=HUGINN, data=BROWN, depth=depth, optim=LMDR_OPTIM,
                  train=TrainConfig(steps=1000, batch_size=16, gradient=gradient, eval_every=100, eval_batches=4,
                                    eval_depth=5, ckpt_every=100, device="cpu", num_threads=1))


EXPECTED = {
    "depth-testbed/looped-s0": Config(
        name="looped-s0",
        model=ModelConfig(rule="looped", vocab_size=64, d_model=128, n_heads=4, d_ff=512, seq_len=32, dropout=0.0,
                          n_prelude=0, n_core=1, n_coda=0, position_embedding="rope"),
        data=DataConfig(dataset="task", task="addition", task_k=3, tokenizer="gpt2"),
        depth=UniformDepthConfig(lo=1, hi=8), optim=OptimConfig(lr=2e-3, warmup_steps=100),
        train=TrainConfig(steps=2500, batch_size=64, eval_every=100, eval_batches=2, eval_depth=8, ckpt_every=250,
                          device="cpu", num_threads=1)),
    "lmdr-ablation/fixed5_bptt-s0": _lmdr("fixed5_bptt-s0", FixedDepthConfig(depth=5), BPTTConfig()),
    "lmdr-ablation/fixed5_tbptt2-s0": _lmdr("fixed5_tbptt2-s0", FixedDepthConfig(depth=5), TBPTTConfig(steps=2)),
    "lmdr-ablation/pln5_tbptt2-s0": _lmdr("pln5_tbptt2-s0", PLNDepthConfig(mean=5.0, sigma=0.5, cap=64),
                                          TBPTTConfig(steps=2)),
    "lmdr-ablation/learned_tbptt2-s0": _lmdr(
        "learned_tbptt2-s0", LearnedDepthConfig(mean=5.0, sigma=0.5, cap=64, reward="inv_ppl", scale=True,
                                                scale_window=8), TBPTTConfig(steps=2)),
}


@pytest.mark.parametrize("key", sorted(FORMAT2))
def test_format2_config_rewrites_to_the_hand_built_format3_config(key):
    old = FORMAT2[key]
    assert old["format_version"] == 2
    new = rewrite_configs.rewrite(old)
    assert new == EXPECTED[key].to_dict()
    assert Config.from_dict(new) == EXPECTED[key]  # strict format-3 load: every field, nothing extra
    assert rewrite_configs.rewrite(new) == new  # idempotent


def test_sweep_keys_are_renamed_once():
    """Override keys (sweep files, run grids): the variants of lmdr-ablation/sweep.toml at commit dae641b;
    ``train.gradient_steps = 0`` of bptt is dropped (bptt has no steps)."""
    old = ('[base]\n"train.warmup_steps" = 50\n"train.num_threads" = 1\n[variants]\n'
           'a = {"train.depth_sampler" = "fixed", "train.depth" = 5, "train.gradient" = "bptt", '
           '"train.gradient_steps" = 0}\n'
           'b = {"train.depth_sampler" = "learned", "train.depth_mean" = 5.0, "train.pln_sigma" = 0.5, '
           '"train.gradient" = "tbptt", "train.gradient_steps" = 2, "train.prior_lr" = 5e-3}\n')
    new = ('[base]\n"optim.warmup_steps" = 50\n"train.num_threads" = 1\n[variants]\n'
           'a = {"depth.sampler" = "fixed", "depth.depth" = 5, "train.gradient.kind" = "bptt"}\n'
           'b = {"depth.sampler" = "learned", "depth.mean" = 5.0, "depth.sigma" = 0.5, '
           '"train.gradient.kind" = "tbptt", "train.gradient.steps" = 2, "depth.lr" = 5e-3}\n')
    assert rewrite_configs.rewrite_toml(old) == new
    assert rewrite_configs.rewrite_toml(new) == new
    grid = {"train.gradient": "bptt", "train.gradient_steps": 0, "train.lr": 1e-3, "train.seed": 1}
    rekeyed = rewrite_configs.rekey(grid)
    assert rekeyed == {"train.gradient.kind": "bptt", "optim.lr": 1e-3, "train.seed": 1}
    assert rewrite_configs.rekey(rekeyed) == rekeyed
