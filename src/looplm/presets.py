"""Named configurations: the SCSE paper's shapes (SPEC §1) and CPU-sized ones.

``scse-*``: the paper's shared-block shapes with its WikiText-103 5k-step protocol (batch 32 × L=128
= 4,096 tokens/step, AdamW lr 3e-4, 500 warm-up steps, uniform 1..8 training depth).
``unshared-4x320`` / ``unshared-6x288``: the parameter-matched unshared controls (22.7M / 22.5M);
``transformer-8``: the fixed-depth unshared Transformer-8 reference.
``cpu``: the CPU reference protocol (SPEC §11) sized so that the main job (two models trained and
evaluated) finishes within 15 minutes on a 2-core machine. Dropout is 0 (our choice): 400 steps is
far from overfitting Brown, and at step 200 SCSE's validation PPL was 829 without dropout vs 876
with the paper's 0.1. ``huginn-cpu``: the CPU protocol with the Huginn-style 1 + 2×R + 1 layout (huginn_linear injection,
PLN-5 depths, truncated BPTT b = 2) and LMDR's optimization (§5.1, App. B.3): warm-up–stable–decay over
5% / last 10% of the steps, AdamW betas (0.9, 0.98). Its learned-prior variant (experiments/lmdr-ablation)
adds ``--depth.sampler learned --depth.reward inv_ppl --depth.scale true --depth.scale_window 8``: the
inverse-perplexity reward with the advantage scale s, its stds pooled over the last 8 updates (our choice:
the preset has one microbatch per update, where the paper's one-update window leaves s = 1). Three
committed results use it: experiments/lmdr-ablation, lmdr-endpoint and lmdr-distill (experiments/huginn-cpu
starts from ``cpu``). It is not LMDR's recipe (App. B–C; issue 25 §1): ``lmdr`` is. ``debug``: a tiny model
on real text, trains in seconds. ``task-<name>``: a 1-block looped model (d = 128) on a synthetic task of
:mod:`looplm.tasks` (issue 24; k_train and sizes our choice, experiments/depth-testbed), depth uniform in 1..8.

``lmdr``: LMDR's own recipe (arXiv:2610.06833, App. B–C) at CPU scale, for experiments/lmdr-recipe: the
1 + 2×R + 1 layout with Parcae-without-norm injection ζ = Λh + Δ⊙W·e (every depth-prior run, App. C.1,
Table 7; no exit norm), separate input and output embeddings (App. B.1), RoPE, WSD with 5% warm-up and the
last 10% cosine to 0.1×, AdamW (0.9, 0.98), wd 0.1, clip 1 (Table 6), and the learned prior with the
inverse-perplexity reward and advantage scale s (λ_H = 0.01, R̄ = 5, R_max = 64, prior Adam lr 1e-3, 32
warm-up updates) backpropagating b_max = 10 recurrences (App. B.3; b = 2 belongs only to the fixed-R = 5
one-change pair). The initial state: LMDR says only "Gaussian" (App. B.4), not its σ; we take Huginn-0125's
truncated normal of std √(2/5) ≈ 0.63 (looplm.importers.huginn.STATE_STD), our choice. seq_len 512 × batch 4
keeps huginn-cpu's 2,048 tokens per step and lets the terminal KV-sharing evaluation prefill 256 tokens
(half a window). Remaining deviations from the paper: scale (d = 192, 3 heads of 64, SwiGLU 768 — not the
paper's 2.83× FFN ratio nor its 4:1 grouped-query heads; 5.54M parameters against 304M at S); data (BPE
8,192 on Brown, not Jais64k on the TxT360 mixture); context 512, not 8,192, so prefill is 256 tokens, not
1,024–4,096; 1,000 steps of 2,048 tokens, not 5,120 of 4.2M; one microbatch per update, so s pools the
last 8 updates (the paper's one-update window would leave s = 1); float32, not bfloat16; lr 2e-3, inside
the paper's S range [0.5, 4]e-3 but not screened; the injection W, Δ and Λ start from looplm's defaults
(N(0, 0.02), Δ_raw = α_raw = 0): LMDR takes Parcae's initialization code [54], which its text does not state.
"""

from __future__ import annotations

import math

from looplm.config import (Config, DataConfig, LearnedDepthConfig, LearnedPositionConfig, ModelConfig, OptimConfig,
                            PLNDepthConfig, PositionConfig, RopeConfig, TrainConfig, UniformDepthConfig)

_PAPER_TRAIN = TrainConfig(steps=5000, batch_size=32)
_PAPER_OPTIM = OptimConfig(lr=3e-4, warmup_steps=500)
_PAPER_DATA = DataConfig(dataset="wikitext103", tokenizer="gpt2")


def _paper(name: str, d: int, heads: int, d_ff: int, **model) -> Config:
    return Config(name=name, model=ModelConfig(d_model=d, n_heads=heads, d_ff=d_ff, **model),
                  data=_PAPER_DATA, depth=UniformDepthConfig(lo=1, hi=8), optim=_PAPER_OPTIM, train=_PAPER_TRAIN)


def _task(task: str, k_train: int, seq_len: int, position: PositionConfig) -> Config:
    return Config(
        name=f"task-{task}",
        model=ModelConfig(rule="looped", vocab_size=64, d_model=128, n_heads=4, d_ff=512, seq_len=seq_len,
                          dropout=0.0, position=position),
        data=DataConfig(dataset="task", task=task, task_k=k_train),
        depth=UniformDepthConfig(lo=1, hi=8),
        optim=OptimConfig(lr=1e-3, warmup_steps=100),
        train=TrainConfig(steps=2000, batch_size=64, eval_every=100, eval_batches=2, eval_depth=8, ckpt_every=250,
                          device="cpu"),
    )


PRESETS: dict[str, Config] = {
    "scse-22m": _paper("scse-22m", 384, 6, 1536, rule="scse"),
    "scse-50m": _paper("scse-50m", 768, 12, 3072, rule="scse"),
    "scse-95m": _paper("scse-95m", 1280, 20, 5120, rule="scse"),
    "scse-136m": _paper("scse-136m", 1664, 26, 6656, rule="scse"),
    "unshared-4x320": _paper("unshared-4x320", 320, 5, 1280, architecture="unshared", n_layers=4),
    "unshared-6x288": _paper("unshared-6x288", 288, 6, 1152, architecture="unshared", n_layers=6),
    "transformer-8": _paper("transformer-8", 384, 6, 1536, architecture="unshared", n_layers=8),
    "cpu": Config(
        name="cpu",
        model=ModelConfig(rule="scse", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=128,
                          dropout=0.0),
        data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=8192),
        depth=UniformDepthConfig(lo=1, hi=8),
        optim=OptimConfig(lr=2e-3, warmup_steps=40),
        train=TrainConfig(steps=400, batch_size=16, eval_every=200, eval_batches=4, eval_depth=8, ckpt_every=100,
                          device="cpu"),
    ),
    # the CPU reference protocol with a Huginn-style 1 + 2×R + 1 layout (experiments/huginn-cpu)
    "huginn-cpu": Config(
        name="huginn-cpu",
        model=ModelConfig(rule="huginn_linear", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=128,
                          dropout=0.0, n_prelude=1, n_core=2, n_coda=1),
        data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=8192),
        depth=PLNDepthConfig(mean=5.0, cap=64),
        optim=OptimConfig(lr=2e-3, warmup_steps=15, schedule="wsd", beta2=0.98),
        train=TrainConfig(steps=300, batch_size=16, gradient={"kind": "tbptt", "steps": 2}, eval_every=150,
                          eval_batches=4, eval_depth=5, ckpt_every=100, device="cpu"),
    ),
    # LMDR's recipe (arXiv:2610.06833 App. B–C) at CPU scale; deviations in the module docstring
    "lmdr": Config(
        name="lmdr",
        model=ModelConfig(rule="parcae", vocab_size=8192, d_model=192, n_heads=3, d_ff=768, seq_len=512,
                          dropout=0.0, n_prelude=1, n_core=2, n_coda=1, tie_embeddings=False,
                          position=RopeConfig(),
                          options=dict(state_init="truncated_normal",
                                       state_init_std=math.sqrt(2.0 / 5.0))),  # Huginn-0125's σ
        data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=8192),
        depth=LearnedDepthConfig(mean=5.0, cap=64, reward="inv_ppl", scale=True, scale_window=8),
        optim=OptimConfig(lr=2e-3, warmup_steps=50, schedule="wsd", beta2=0.98),
        train=TrainConfig(steps=1000, batch_size=4, gradient={"kind": "tbptt", "steps": 10}, eval_every=100,
                          eval_batches=4, eval_depth=5, ckpt_every=100, device="cpu"),
    ),
    "debug": Config(
        name="debug",
        model=ModelConfig(rule="scse", vocab_size=1024, d_model=64, n_heads=2, d_ff=128, seq_len=64,
                          dropout=0.0),
        data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=1024),
        depth=UniformDepthConfig(lo=1, hi=4),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        train=TrainConfig(steps=40, batch_size=8, eval_every=20, eval_batches=2, eval_depth=4, ckpt_every=20,
                          device="cpu"),
    ),
    # seq_len fits k up to 2·k_train (rows grow with k except for phop); rope where they do
    "task-phop": _task("phop", 8, 68, LearnedPositionConfig()),
    "task-varchain": _task("varchain", 4, 80, RopeConfig()),
    "task-modsum": _task("modsum", 8, 40, RopeConfig()),
    "task-addition": _task("addition", 4, 32, RopeConfig()),
}


def get_preset(name: str) -> Config:
    """Return the named preset.

    Raises:
        KeyError: unknown name (the message lists the known presets).
    """
    if name not in PRESETS:
        raise KeyError(f"--preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
