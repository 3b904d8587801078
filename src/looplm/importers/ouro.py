"""Import Ouro (``ByteDance/Ouro-1.4B``, ``Ouro-2.6B`` and their ``-Thinking`` variants, ``OuroForCausalLM``;
arXiv:2510.25741) as a looplm checkpoint.

The architecture, step by step: ``docs/importers-layout.md``. In looplm terms it is ``rule=plain`` with every
layer in the core (no prelude or coda), ``sandwich`` blocks, rotate-half RoPE, grouped key/value heads,
``scale_control.kind=final_norm`` (``model.norm`` after every step, fed back) with ``readout=raw``, an exit gate
and an untied head. Depth T is ``total_ut_steps``; Ouro's threshold rule is the exit criterion ``exit_cdf``
(τ = ``early_exit_threshold``, 1.0 in the published configs: in float32 every token then reads out the last
step, i.e. fixed depth T). The tensor map is :func:`tensor_map`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looplm.importers.common import ConfigReader, Entry, ImporterError, cat_rows, import_folder

MODEL_NAME = "Ouro"
_NORMS = {"input_layernorm": "norm1", "input_layernorm_2": "post_attn_norm", "post_attention_layernorm": "norm2",
          "post_attention_layernorm_2": "post_mlp_norm"}


def read_config(raw: dict[str, Any], *, seq_len: int | None = None):
    """The looplm :class:`~looplm.config.ModelConfig` of an Ouro ``config.json``, its depth and exit threshold.

    ``seq_len`` as for :func:`import_ouro`; depth is ``total_ut_steps``.
    ImporterError: an unknown key or an unsupported value (named): sliding-window layers, a ``head_dim`` other than
    hidden_size / num_attention_heads, RoPE scaling other than linear, attention biases, a fixed
    ``early_exit_step``, quantized weights."""
    from looplm.config import FinalNormConfig, ModelConfig, RopeConfig

    r = ConfigReader(raw, MODEL_NAME)
    r.require("model_type", ["ouro"], why="not an Ouro config")
    r.require("hidden_act", ["silu"])
    d, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
    if d % heads:
        raise ImporterError(f"config.json: hidden_size = {d} is not divisible by num_attention_heads = {heads}")
    r.require("head_dim", [d // heads, None], default=None,
              why="looplm's head width is hidden_size / num_attention_heads")
    kv = r.get("num_key_value_heads", heads)
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ImporterError(f"config.json: num_key_value_heads = {kv!r} must divide num_attention_heads = {heads}")
    layers = r.positive_int("num_hidden_layers")
    r.require("use_sliding_window", [False], default=False, why="sliding-window attention is not implemented")
    types = r.get("layer_types", None)
    if types is not None and (len(types) != layers or any(t != "full_attention" for t in types)):
        bad = sorted({t for t in types if t != "full_attention"})
        raise ImporterError(f"config.json: layer_types holds {', '.join(map(repr, bad)) or 'a wrong count'}; the "
                            "importer supports full_attention layers only (sliding windows are not implemented)")
    r.require("attention_bias", [False], default=False, why="Ouro's projections have no bias")
    r.require("early_exit_step", [None], default=None, why="a fixed exit step replaces the threshold rule; "
              "read the step with --depth instead")
    r.require("quantization_config", [None], default=None, why="quantized weights are not read")
    scaling = r.get("rope_scaling", None)
    factor = 1.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "linear":
            raise ImporterError(f"config.json: rope_scaling.rope_type = {kind!r} is not supported by the Ouro "
                                "importer; supported: null, 'linear'")
        factor = float(scaling.get("factor", 0.0))
        if not factor > 0:
            raise ImporterError(f"config.json: rope_scaling.factor must be > 0, got {scaling.get('factor')!r}")
    tied = r.require("tie_word_embeddings", [True, False], default=False)
    depth = r.positive_int("total_ut_steps")
    tau = r.number("early_exit_threshold", 1.0)
    max_pos = r.positive_int("max_position_embeddings")
    if seq_len is None:
        seq_len = min(max_pos, 4096)
    if not 1 <= seq_len <= max_pos:
        raise ImporterError(f"--seq-len {seq_len}: must be in 1..max_position_embeddings = {max_pos}")
    # initialization, training dropout, and the sliding window (off: use_sliding_window is false)
    r.ignore("initializer_range", "attention_dropout", "sliding_window", "max_window_layers")
    model = ModelConfig(
        architecture="shared", rule="plain", vocab_size=r.positive_int("vocab_size"), d_model=d, n_heads=heads,
        d_ff=r.positive_int("intermediate_size"), seq_len=seq_len, dropout=0.0, n_prelude=0, n_core=layers,
        n_coda=0, tie_embeddings=tied, norm_eps=r.number("rms_norm_eps"), readout="raw",
        scale_control=FinalNormConfig(), exit_gate=True,
        position=RopeConfig(theta=r.number("rope_theta"), layout="half",
                            scaling="linear" if scaling is not None else "none", scaling_factor=factor),
        n_kv_heads=0 if kv == heads else kv, block_norm="sandwich")
    r.finish()
    return model, depth, tau


def tensor_map(model_cfg) -> list[Entry]:
    """Every looplm weight of ``model_cfg`` with the stored tensors it is made of (see the module table)."""
    entries = [Entry("tok_emb.weight", ("model.embed_tokens.weight",)),
               Entry("norm_f.weight", ("model.norm.weight",)),
               Entry("exit_gate.weight", ("model.early_exit_gate.weight",)),
               Entry("exit_gate.bias", ("model.early_exit_gate.bias",))]
    if not model_cfg.tie_embeddings:
        entries.append(Entry("lm_head.weight", ("lm_head.weight",)))
    for i in range(model_cfg.n_core):
        src, dst = f"model.layers.{i}", f"core.blocks.{i}"
        for a, b in _NORMS.items():
            entries.append(Entry(f"{dst}.{b}.weight", (f"{src}.{a}.weight",)))
        entries += [
            Entry(f"{dst}.attn.qkv.weight", tuple(f"{src}.self_attn.{p}_proj.weight" for p in "qkv"), cat_rows),
            Entry(f"{dst}.attn.proj.weight", (f"{src}.self_attn.o_proj.weight",)),
            Entry(f"{dst}.mlp.gate_up.weight", (f"{src}.mlp.gate_proj.weight", f"{src}.mlp.up_proj.weight"), cat_rows),
            Entry(f"{dst}.mlp.down.weight", (f"{src}.mlp.down_proj.weight",))]
    return entries


def import_ouro(src: str | Path, out: str | Path, *, seq_len: int | None = None, dtype: str = "source",
                progress: bool = True) -> dict[str, Any]:
    """Import an Ouro folder (config.json, safetensors shards, tokenizer.json) as a looplm checkpoint.

    Args:
        src: the downloaded folder (e.g. huggingface-cli download ByteDance/Ouro-1.4B --local-dir SRC).
        out: the run folder to write (OUT/latest → OUT/checkpoints/step-000000); must not hold a
            checkpoint.
        seq_len: context length, at most max_position_embeddings; default min(max_position_embeddings, 4096)
        dtype: weights as stored (source: bf16, every value kept) or converted (float32, bfloat16)
        progress: show a progress bar over the bytes read
    ImporterError: the folder, a config key or a tensor cannot be imported exactly (named)."""
    def read(source):
        model_cfg, depth, tau = read_config(source.config, seq_len=seq_len)
        return model_cfg, {"depth": depth, "early_exit_threshold": tau}

    return import_folder(src, out, read, tensor_map, fmt="ouro", model_name=MODEL_NAME, dtype=dtype,
                         progress=progress)
