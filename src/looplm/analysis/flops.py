"""FLOP proxy per token and parameter accounting (SCSE, arXiv:2607.27656, eq. 20–21; SPEC §9)."""

from __future__ import annotations

from typing import Any, Sequence

from looplm.config import ModelConfig

#: core applications per loop step, per rule (the subtractive controls of SPEC §2 use 2).
BODY_CALLS_PER_STEP: dict[str, int] = {
    "looped": 1, "adapter": 1, "step_adapter": 1, "step_film": 1, "scse": 1, "norm_reset": 1, "sc_cond": 1,
    "scse_leak": 1, "sc_subtract": 2, "additive_subtract": 2,
    "plain": 1, "huginn_linear": 1, "parcae_decay": 1, "parcae": 1, "orthoinj": 1, "deq_qkv": 1,
}


def block_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of one block per token: ``8d² + 6·d·d_ff + 4·L·d`` (SCSE eq. 20); with GQA ``4d² + 4·d·d_kv``
    for the attention projections."""
    d = cfg.d_model
    d_kv = d * (cfg.n_kv_heads or cfg.n_heads) // cfg.n_heads
    return 4 * d * d + 4 * d * d_kv + 6 * d * cfg.d_ff + 4 * cfg.seq_len * d


def body_applications(cfg: ModelConfig, depth: int) -> int:
    """N_body(T): ``c_body·K·T + n_prelude + n_coda`` (c_body: core calls per step); unshared ``min(T, n_layers)``."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    if cfg.architecture == "unshared":
        return min(depth, cfg.n_layers)
    return BODY_CALLS_PER_STEP[cfg.rule] * cfg.n_core * depth + cfg.n_prelude + cfg.n_coda


def flops_per_token(cfg: ModelConfig, depth: int) -> dict[str, int]:
    """``{"body": N_body(T)·block, "body_head": body + 2·d·V}`` FLOPs/token at depth T (SCSE eq. 20–21)."""
    body = body_applications(cfg, depth) * block_flops_per_token(cfg)
    return {"body": body, "body_head": body + 2 * cfg.d_model * cfg.vocab_size}


def multidepth_flops_per_token(cfg: ModelConfig, depths) -> int:
    """FLOPs/token of one unroll to max(depths) read out at every depth: body_head plus one readout (the coda's
    blocks and 2·d·V) per other depth (real work: at V = 8,192, d = 192 one costs ~4 core blocks)."""
    readout = (cfg.n_coda if cfg.architecture == "shared" else 0) * block_flops_per_token(cfg) \
        + 2 * cfg.d_model * cfg.vocab_size
    depths = {int(t) for t in depths}
    return flops_per_token(cfg, max(depths))["body_head"] + (len(depths) - 1) * readout


def config_info(cfg, *, depths: Sequence[int] = (8, 48), list: bool = False) -> dict[str, Any]:
    """``looplm info``: parameter count and FLOP proxy of config ``cfg`` (model built on the meta device).

    Args:
        depths: comma-separated loop depths of the FLOP proxy
        list: list the presets and their model configs instead
    """
    import torch

    from looplm.model import build_model
    from looplm.presets import PRESETS

    if list:
        return {name: c.to_dict()["model"] for name, c in PRESETS.items()}
    with torch.device("meta"):
        params = build_model(cfg).num_params()
    return {"name": cfg.name, "params": params, "params_millions": round(params / 1e6, 2),
            "flops_per_token": {str(T): flops_per_token(cfg.model, T) for T in depths}, "config": cfg.to_dict()}
