"""Named configurations: the SCSE paper's shapes (SPEC §1) and CPU-sized ones (``cpu``, ``huginn-cpu``,
``lmdr``, ``debug``, ``task-<name>``). What each is, and every choice and deviation: docs/presets.md.
"""
from __future__ import annotations

import math

from looplm.config import (Config, DataConfig, DepthConfig, LearnedDepthConfig, LearnedPositionConfig, ModelConfig,
                            NoPositionConfig, OptimConfig, PLNDepthConfig, PositionConfig, RopeConfig, TrainConfig,
                            UniformDepthConfig)

def _paper(name: str, d: int, heads: int, d_ff: int, **model) -> Config:
    """The paper's protocol is the defaults (5k steps, batch 32, lr 3e-4, 500 warm-up, depths 1..8, GPT-2 BPE)."""
    return Config(name=name, model=ModelConfig(d_model=d, n_heads=heads, d_ff=d_ff, **model),
                  data=DataConfig(dataset="wikitext103"))


def _task(task: str, k_train: int, seq_len: int, position: PositionConfig) -> Config:
    return Config(
        name=f"task-{task}",
        model=ModelConfig(rule="looped", vocab_size=64, d_model=128, n_heads=4, d_ff=512, seq_len=seq_len,
                          dropout=0.0, position=position),
        data=DataConfig(dataset="task", task=task, task_k=k_train),  # depths 1..8, the default sampler
        optim=OptimConfig(lr=1e-3, warmup_steps=100),
        train=TrainConfig(steps=2000, batch_size=64, eval_every=100, eval_batches=2, ckpt_every=250, device="cpu"),
    )


def _cpu(name: str, depth: DepthConfig, optim: OptimConfig, model: dict, train: dict) -> Config:
    """A CPU-sized run on Brown, tokenized by a byte-level BPE of the model's vocabulary size."""
    return Config(name=name, model=ModelConfig(dropout=0.0, **model), depth=depth, optim=optim,
                  data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=model["vocab_size"]),
                  train=TrainConfig(device="cpu", **train))


PRESETS: dict[str, Config] = {cfg.name: cfg for cfg in [
    _paper("scse-22m", 384, 6, 1536, rule="scse"),
    _paper("scse-50m", 768, 12, 3072, rule="scse"),
    _paper("scse-95m", 1280, 20, 5120, rule="scse"),
    _paper("scse-136m", 1664, 26, 6656, rule="scse"),
    _paper("unshared-4x320", 320, 5, 1280, architecture="unshared", n_layers=4),
    _paper("unshared-6x288", 288, 6, 1152, architecture="unshared", n_layers=6),
    _paper("transformer-8", 384, 6, 1536, architecture="unshared", n_layers=8),
    _cpu("cpu", UniformDepthConfig(lo=1, hi=8), OptimConfig(lr=2e-3, warmup_steps=40),
         model=dict(rule="scse", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=128),
         train=dict(steps=400, batch_size=16, eval_every=200, eval_batches=4, eval_depth=8, ckpt_every=100)),
    # the CPU reference protocol with a Huginn-style 1 + 2×R + 1 layout (experiments/lmdr-ablation, -endpoint, -distill)
    _cpu("huginn-cpu", PLNDepthConfig(mean=5.0, cap=64),
         OptimConfig(lr=2e-3, warmup_steps=15, schedule="wsd", beta2=0.98),
         model=dict(rule="huginn_linear", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=128,
                    n_prelude=1, n_core=2, n_coda=1),
         train=dict(steps=300, batch_size=16, gradient={"kind": "tbptt", "steps": 2}, eval_every=150,
                    eval_batches=4, eval_depth=5, ckpt_every=100)),
    # LMDR's recipe (arXiv:2610.06833 App. B–C) at CPU scale; deviations in docs/presets.md
    _cpu("lmdr", LearnedDepthConfig(mean=5.0, cap=64, reward="inv_ppl", scale=True, scale_window=8),
         OptimConfig(lr=2e-3, warmup_steps=50, schedule="wsd", beta2=0.98),
         model=dict(rule="parcae", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=512, n_prelude=1,
                    n_core=2, n_coda=1, tie_embeddings=False, position=RopeConfig(),
                    options=dict(state_init="truncated_normal", state_init_std=math.sqrt(2 / 5))),  # Huginn-0125's σ
         train=dict(steps=1000, batch_size=4, gradient={"kind": "tbptt", "steps": 10}, eval_every=100,
                    eval_batches=4, eval_depth=5, ckpt_every=100)),
    _cpu("debug", UniformDepthConfig(lo=1, hi=4), OptimConfig(lr=3e-3, warmup_steps=5),
         model=dict(rule="scse", vocab_size=1024, d_model=64, n_heads=2, d_ff=128, seq_len=64),
         train=dict(steps=40, batch_size=8, eval_every=20, eval_batches=2, eval_depth=4, ckpt_every=20)),
    # seq_len fits k up to 2·k_train (rows grow with k except for phop and pointer*); rope where they grow and
    # for pointer_edges (relative look-ups: an edge's child is the token before its parent); none for pointer_pairs
    # and pointer_forest (edges in random order, the query the only node token: a hop is a pure content match)
    _task("phop", 8, 68, LearnedPositionConfig()),
    _task("varchain", 4, 80, RopeConfig()),
    _task("modsum", 8, 40, RopeConfig()),
    _task("addition", 4, 32, RopeConfig()),
    _task("pointer", 4, 30, LearnedPositionConfig()),
    _task("pointer_edges", 3, 52, RopeConfig()),
    _task("pointer_pairs", 3, 18, NoPositionConfig()),
    _task("pointer_pairs_mq", 3, 28, NoPositionConfig()),
    _task("pointer_forest", 3, 34, NoPositionConfig()),  # four trees: 32 edges + "?q"
]}


def get_preset(name: str) -> Config:
    """The named preset (KeyError listing the known ones)."""
    if name not in PRESETS:
        raise KeyError(f"--preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
