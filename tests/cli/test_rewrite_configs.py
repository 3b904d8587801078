"""``scripts/rewrite_configs.py``: config format 2 (one flat ``train`` section) and format 3 (the typed
sections ``depth``, ``optim`` and ``train.gradient``; flat position and scale-control fields) → format 4
(also ``model.position`` and ``model.scale_control``). The format-2 configs in
``fixtures/format2/configs.json`` are stored ones, verbatim, from commit dae641b (the lmdr-ablation
sweep: fixed / pln / learned samplers with bptt and tbptt; a depth-testbed run that predates
``train.prior_init`` and ``model.block_init``). The format-3 ones in ``fixtures/format3/configs.json`` come
from commit d0a5065: a run stored in experiments/depth-testbed/headline/results.db (rope) and a config written
by ``Config.to_dict`` there with every rope field and spectral damping away from their defaults. Each
rewritten config must equal the one built here by hand from the format-4 sections, and rewriting again
changes nothing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from looplm.config import (BPTTConfig, Config, DataConfig, FixedDepthConfig, LearnedDepthConfig, ModelConfig,
                           OptimConfig, PLNDepthConfig, RopeConfig, SpectralDampingConfig, TBPTTConfig, TrainConfig,
                           UniformDepthConfig)

ROOT = Path(__file__).resolve().parents[2]
FORMAT2 = json.loads((ROOT / "tests" / "fixtures" / "format2" / "configs.json").read_text())
FORMAT3 = json.loads((ROOT / "tests" / "fixtures" / "format3" / "configs.json").read_text())


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


LOOPED_S0 = Config(
    name="looped-s0",
    model=ModelConfig(rule="looped", vocab_size=64, d_model=128, n_heads=4, d_ff=512, seq_len=32, dropout=0.0,
                      n_prelude=0, n_core=1, n_coda=0, position=RopeConfig()),
    data=DataConfig(dataset="task", task="addition", task_k=3, tokenizer="gpt2"),
    depth=UniformDepthConfig(lo=1, hi=8), optim=OptimConfig(lr=2e-3, warmup_steps=100),
    train=TrainConfig(steps=2500, batch_size=64, eval_every=100, eval_batches=2, eval_depth=8, ckpt_every=250,
                      device="cpu", num_threads=1))

EXPECTED = {
    "depth-testbed/looped-s0": LOOPED_S0,
    "lmdr-ablation/fixed5_bptt-s0": _lmdr("fixed5_bptt-s0", FixedDepthConfig(depth=5), BPTTConfig()),
    "lmdr-ablation/fixed5_tbptt2-s0": _lmdr("fixed5_tbptt2-s0", FixedDepthConfig(depth=5), TBPTTConfig(steps=2)),
    "lmdr-ablation/pln5_tbptt2-s0": _lmdr("pln5_tbptt2-s0", PLNDepthConfig(mean=5.0, sigma=0.5, cap=64),
                                          TBPTTConfig(steps=2)),
    "lmdr-ablation/learned_tbptt2-s0": _lmdr(
        "learned_tbptt2-s0", LearnedDepthConfig(mean=5.0, sigma=0.5, cap=64, reward="inv_ppl", scale=True,
                                                scale_window=8), TBPTTConfig(steps=2)),
}


EXPECTED3 = {  # the headline run: the same recipe, with the task tokenizer's vocabulary (42)
    "depth-testbed/looped-s0": LOOPED_S0.replace(model=LOOPED_S0.model.replace(vocab_size=42)),
    "written/damped-rope": Config(
        name="damped-rope",
        model=ModelConfig(rule="plain", vocab_size=64, d_model=32, n_heads=2, d_ff=64, seq_len=16, dropout=0.0,
                          n_core=2, scale_control=SpectralDampingConfig(init=0.7),
                          position=RopeConfig(theta=50000.0, layout="interleaved", scaling="linear",
                                              scaling_factor=2.0, table_dtype="bfloat16")),
        depth=FixedDepthConfig(depth=3), train=TrainConfig(steps=10, device="cpu")),
}


@pytest.mark.parametrize("version, key", [(2, k) for k in sorted(FORMAT2)] + [(3, k) for k in sorted(FORMAT3)])
def test_old_config_rewrites_to_the_hand_built_format4_config(version, key):
    old, want = (FORMAT2[key], EXPECTED[key]) if version == 2 else (FORMAT3[key], EXPECTED3[key])
    assert old["format_version"] == version
    new = rewrite_configs.rewrite(old)
    assert new["format_version"] == 4 and new == want.to_dict()
    assert Config.from_dict(new) == want  # strict format-4 load: every field, nothing extra
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


def test_rl_options_and_student_records_get_their_optim_section():
    """The options of a stored RL run (experiments/lmdr-rl/results/reuse-s0.json before the rewrite, verbatim)
    and a format-1 student record (flat optimizer fields) rewritten into their ``optim`` sections, once."""
    from looplm.distill.config import DistillConfig, StudentRecord
    from looplm.rl.config import RLConfig

    old = {"method": "reuse", "depth": 6, "neumann_steps": 4, "group_size": 16, "prompts_per_update": 8,
           "updates": 300, "train_problems": 0, "optimizer": "adamw", "lr": 5e-05, "warmup": 10, "temperature": 1.0,
           "reward": "exact_match", "seed": 0, "task": "addition", "digits": 3, "eval_problems": 500,
           "eval_samples": 8, "eval_seed": 0, "compare_every": 10, "ckpt_every": 25, "grad_clip": 1.0}
    new = rewrite_configs.rewrite_rl(old)
    assert new == RLConfig(group_size=16, prompts_per_update=8, updates=300, task="addition", digits=3,
                           optim=OptimConfig(lr=5e-5, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.0,
                                             beta2=0.98)).to_dict()
    assert rewrite_configs.rewrite_rl(new) == new
    flat = {**{k: v for k, v in DistillConfig().to_dict().items() if k != "optim"}, "lr": 3e-3, "min_lr_ratio": 0.1,
            "warmup_steps": 20, "schedule": "cosine", "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0}
    teacher = {"fingerprint": "f", "checkpoint": "c", "name": "n", "rule": "huginn_linear", "d_model": 8, "n_core": 2}
    record = {"kind": "looplm-student", "format_version": 1, "distill": flat, "teacher": teacher, "sigma2": 1.0}
    student = rewrite_configs.walk(record, {})
    assert StudentRecord.from_dict(student).distill == DistillConfig(optim=OptimConfig(lr=3e-3, warmup_steps=20))
    assert rewrite_configs.walk(student, {}) == student


def test_format3_model_keys_are_renamed_once():
    """The position and scale-control override keys move into their sections (``experiments/import/run.sh``'s
    spelling at commit d0a5065)."""
    old = ('[variants]\na = {"model.position_embedding" = "rope", "model.rope_theta" = 50000, '
           '"model.rope_layout" = "interleaved"}\nb = {"model.scale_control" = "spectral_damping", '
           '"model.damping_init" = 0.7, "model.readout" = "raw"}\n')
    new = ('[variants]\na = {"model.position.kind" = "rope", "model.position.theta" = 50000, '
           '"model.position.layout" = "interleaved"}\nb = {"model.scale_control.kind" = "spectral_damping", '
           '"model.scale_control.init" = 0.7, "model.readout" = "raw"}\n')
    assert rewrite_configs.rewrite_toml(old) == new
    assert rewrite_configs.rewrite_toml(new) == new
    grid = {"model.rope_table_dtype": "bfloat16", "model.rope_scaling": "linear", "model.rope_scaling_factor": 2.0}
    rekeyed = rewrite_configs.rekey(grid)
    assert rekeyed == {"model.position.table_dtype": "bfloat16", "model.position.scaling": "linear",
                       "model.position.scaling_factor": 2.0}
    assert rewrite_configs.rekey(rekeyed) == rekeyed
