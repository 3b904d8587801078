"""Import Huginn-0125 (``tomg-group-umd/huginn-0125``, ``RavenForCausalLM``; arXiv:2502.05171) as a looplm
checkpoint.

The architecture, step by step: ``docs/importers-layout.md``. In looplm terms it is ``rule=huginn_linear``
(adapter ``W [s; e]`` without bias, no step norm), P prelude / R core / C coda ``pre_post`` blocks,
interleaved RoPE with q/k bias, embedding scale √d, ``exit_norm=final`` (``ln_f`` before the coda and again
at the readout), tied head, and a truncated-normal initial state of std √(2/5). The tensor map is
:func:`tensor_map` (``freqs_cis`` is not stored: :func:`check_rope_table` checks it against ``Rope``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from looplm.importers.common import ConfigReader, Entry, ImporterError, Source, import_folder

MODEL_NAME = "Huginn-0125"
#: ``initial_state`` choices: the loop's initial state s₀ of the imported model (see :func:`import_huginn`)
INITIAL_STATES = ("table", "fresh", "zeros")
#: std of Huginn's s₀: TN(0, σ², ±3σ)·√d with σ = √(2/(5d)), i.e. √(2/5) whatever the width
STATE_STD = math.sqrt(2.0 / 5.0)
_BLOCK_NAMES = {"norm_1": "norm1", "norm_2": "post_attn_norm", "norm_3": "norm2", "norm_4": "post_mlp_norm",
                "attn.Wqkv": "attn.qkv", "attn.proj": "attn.proj", "mlp.fc": "mlp.gate_up", "mlp.proj": "mlp.down"}


def read_config(raw: dict[str, Any], *, seq_len: int | None = None, initial_state: str = "table"):
    """The looplm :class:`~looplm.config.ModelConfig` of a Huginn-0125 ``config.json``, and its depth.

    ``seq_len`` and ``initial_state`` as for :func:`import_huginn`; depth is ``mean_recurrence``.
    ImporterError: an unknown key or an unsupported value (named), or a ``seq_len`` beyond ``block_size``."""
    r = ConfigReader(raw, MODEL_NAME)
    r.require("model_type", ["huginn_raven"], why="not a Huginn-0125 config")
    r.require("architecture_class_name", ["RecurrentGPT"])
    r.require("block_class_name", ["SandwichBlock"], why="the importer maps the sandwich block (block_norm=pre_post)")
    r.require("mlp_class_name", ["GatedMLP"])
    r.require("nonlin_name", ["SiLU"])
    r.require("norm_class_name", ["RMSNorm_llama"])
    r.require("bias", [False], why="the published value; the adapter bias of bias=true is not checked against the "
              "original")
    r.require("tie_embeddings", [True], why="the head is the embedding")
    r.require("test_time_noise", [0, 0.0], why="noise added to the state at every step is not implemented")
    d, heads = r.positive_int("n_embd"), r.positive_int("n_heads")
    if d % heads:
        raise ImporterError(f"config.json: n_embd = {d} is not divisible by n_heads = {heads}")
    r.require("head_dim", [d // heads], default=d // heads, why="looplm's head width is n_embd / n_heads")
    r.require("num_key_value_heads", [heads], default=heads, why="Huginn's qk_bias has one row per query head; "
              "grouped key/value heads are not part of its layout")
    P, R, C = (r.positive_int("n_layers_in_prelude", minimum=0), r.positive_int("n_layers_in_recurrent_block"),
               r.positive_int("n_layers_in_coda", minimum=0))
    r.require("n_layers", [P + R + C], default=P + R + C, why="prelude + recurrent block + coda")
    vocab = r.positive_int("padded_vocab_size")
    block_size = r.positive_int("block_size")
    depth = r.positive_int("mean_recurrence")
    scale = r.get("init_values", {}).get("embed_scale", math.sqrt(d))
    if not isinstance(scale, (int, float)) or not math.isclose(scale, math.sqrt(d), rel_tol=1e-6):
        raise ImporterError(f"config.json: init_values.embed_scale = {scale!r}; the importer reproduces "
                            f"sqrt(n_embd) = {math.sqrt(d):g}")
    if seq_len is None:
        seq_len = min(block_size, 4096)
    if not 1 <= seq_len <= block_size:
        raise ImporterError(f"--seq-len {seq_len}: must be in 1..block_size = {block_size} (Huginn's RoPE table "
                            "covers positions < block_size)")
    qk_bias = r.require("qk_bias", [True, False])
    # read by the training code only, or (injection_type, state_init) never by the minimal modeling file
    r.ignore("vocab_size", "padding_multiple", "effective_expected_depth", "mean_backprop_depth", "sampling_scheme",
             "init_strategy", "init_orthogonal", "activation_checkpoint_impl", "injection_type", "state_init",
             "test_time_noise_type")
    model = huginn_layout_config(
        vocab_size=vocab, d_model=d, n_heads=heads, d_ff=r.positive_int("intermediate_size"), seq_len=seq_len,
        n_prelude=P, n_core=R, n_coda=C, norm_eps=r.number("norm_eps"), rope_theta=r.number("rope_base"),
        qk_bias=qk_bias, initial_state=initial_state)
    r.finish()
    return model, depth


def huginn_layout_config(*, vocab_size: int, d_model: int, n_heads: int, d_ff: int, seq_len: int, n_prelude: int,
                         n_core: int, n_coda: int, norm_eps: float = 1e-6, rope_theta: float = 50000.0,
                         qk_bias: bool = True, initial_state: str = "table", rope_table_dtype: str = "float32"):
    """A :class:`~looplm.config.ModelConfig` with Huginn-0125's architecture options and the given sizes (what
    the importer builds; also a looplm model to train in that layout). ``initial_state`` as in
    :func:`read_config`."""
    from looplm.config import ModelConfig, RopeConfig

    if initial_state not in INITIAL_STATES:
        raise ImporterError(f"--initial-state: got {initial_state!r}; allowed: {', '.join(INITIAL_STATES)}")
    return ModelConfig(
        architecture="shared", rule="huginn_linear", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        d_ff=d_ff, seq_len=seq_len, dropout=0.0, n_prelude=n_prelude, n_core=n_core, n_coda=n_coda,
        tie_embeddings=True, norm_eps=norm_eps, readout="rmsnorm",
        position=RopeConfig(theta=rope_theta, layout="interleaved", table_dtype=rope_table_dtype), qk_bias=qk_bias,
        block_norm="pre_post",
        embed_scale=math.sqrt(d_model), exit_norm="final",
        options=dict(state_init="zeros" if initial_state == "zeros" else "truncated_normal", state_init_std=STATE_STD,
                     state_init_seed=-1 if initial_state == "fresh" else 0, adapter_bias=False, step_norm=False))


#: the ModelConfig fields (and rule options) that make a looplm model Huginn-0125's architecture
_LAYOUT_FIELDS = ("architecture", "rule", "tie_embeddings", "readout", "position", "n_kv_heads", "block_norm",
                  "embed_scale", "exit_norm", "residual", "input_norm", "scale_control", "exit_gate")


def write_huginn_folder(model, tokenizer_json: str, out: str | Path, *, depth: int) -> Path:
    """Write a looplm model of Huginn-0125's architecture in the published layout (config.json, model.safetensors
    with ``freqs_cis``, tokenizer.json): the inverse of :func:`tensor_map`, for round-trip checks.
    ImporterError: the model differs from the layout in a field (named), e.g. another rule or block norm."""
    from safetensors.torch import save_file

    from looplm.model.layers import Rope

    c = model.cfg
    pos = c.position  # θ and the table dtype are free; the rest of the position signal is the layout's
    free = dict(rope_theta=pos.theta, rope_table_dtype=pos.table_dtype) if pos.NAME == "rope" else {}
    want = huginn_layout_config(vocab_size=c.vocab_size, d_model=c.d_model, n_heads=c.n_heads, d_ff=c.d_ff,
                                seq_len=c.seq_len, n_prelude=c.n_prelude, n_core=c.n_core, n_coda=c.n_coda, **free)
    for name in _LAYOUT_FIELDS:
        if getattr(c, name) != getattr(want, name):
            raise ImporterError(f"model.{name} = {getattr(c, name)!r}: Huginn-0125's layout has "
                                f"{getattr(want, name)!r}")
    if c.rule == "huginn_linear" and (c.options.adapter_bias or c.options.step_norm):
        raise ImporterError("model.options.adapter_bias / step_norm: Huginn-0125's layout has neither")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    H, hd = c.n_heads, c.head_dim
    tensors = {}
    for e in tensor_map(c):
        t = sd[e.target].detach()
        tensors[e.sources[0]] = (t.view(2, 1, H, hd) if e.target.endswith("attn.qk_bias") else t).clone().contiguous()
    rope = Rope(hd, pos.theta, "interleaved", table_dtype=pos.table_dtype)
    cos, sin = rope.cos_sin(torch.arange(c.seq_len)[None])  # 2 × (1, 1, seq_len, hd/2)
    dtype = sd["tok_emb.weight"].dtype
    tensors["freqs_cis"] = torch.stack([cos[0, 0], sin[0, 0]], -1)[None, :, None].to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["RavenForCausalLM"], "architecture_class_name": "RecurrentGPT", "model_type": "huginn_raven",
        "block_class_name": "SandwichBlock", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama", "bias": False, "tie_embeddings": True, "injection_type": "linear",
        "state_init": "like-init", "test_time_noise": 0, "test_time_noise_type": "fixed", "n_embd": c.d_model,
        "n_heads": H, "head_dim": hd, "num_key_value_heads": H, "intermediate_size": c.d_ff,
        "n_layers": c.n_prelude + c.n_core + c.n_coda, "n_layers_in_prelude": c.n_prelude,
        "n_layers_in_recurrent_block": c.n_core, "n_layers_in_coda": c.n_coda, "vocab_size": c.vocab_size,
        "padded_vocab_size": c.vocab_size, "block_size": c.seq_len, "mean_recurrence": depth,
        "rope_base": pos.theta, "norm_eps": c.norm_eps, "qk_bias": c.qk_bias,
        "init_values": {"embed_scale": math.sqrt(c.d_model)}, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json)
    return out


def tensor_map(model_cfg) -> list[Entry]:
    """Every looplm weight of ``model_cfg`` with the stored tensors it is made of (see the module table)."""
    H, hd = model_cfg.n_heads, model_cfg.head_dim

    def qk(ts: list[torch.Tensor]) -> torch.Tensor:  # (2, 1, H, hd) → (2·H·hd,): q's bias, then k's
        b = ts[0]
        return torch.cat([b[0].reshape(H * hd), b[1].reshape(H * hd)])

    entries = [Entry("tok_emb.weight", ("transformer.wte.weight",)),
               Entry("rule.adapter.weight", ("transformer.adapter.weight",)),
               Entry("norm_f.weight", ("transformer.ln_f.weight",))]
    for src, dst, n in (("prelude", "prelude", model_cfg.n_prelude), ("core_block", "core.blocks", model_cfg.n_core),
                        ("coda", "coda", model_cfg.n_coda)):
        for i in range(n):
            for a, b in _BLOCK_NAMES.items():
                entries.append(Entry(f"{dst}.{i}.{b}.weight", (f"transformer.{src}.{i}.{a}.weight",)))
            if model_cfg.qk_bias:
                entries.append(Entry(f"{dst}.{i}.attn.qk_bias", (f"transformer.{src}.{i}.attn.qk_bias",), qk))
    return entries


def check_rope_table(source: Source, model_cfg, tolerance: float = 0.0) -> str:
    """Compare the stored ``freqs_cis`` (1, block_size, 1, hd/2, 2), with which the original rotates, to looplm's
    :class:`~looplm.model.layers.Rope` table rounded to the stored dtype; returns that ``table_dtype``.
    ImporterError: no ``freqs_cis``, a wrong shape or dtype, or values further than ``tolerance`` from looplm's
    table (the message gives the count and the largest difference)."""
    from safetensors import safe_open

    from looplm.model.layers import Rope

    name = "freqs_cis"
    if name not in source.where:
        raise ImporterError(f"{source.root}: missing tensor 'freqs_cis' (Huginn's stored RoPE table, a persistent "
                            "buffer; the import checks it against looplm's table)")
    hd = model_cfg.head_dim
    block_size = source.config["block_size"]
    if source.shapes[name] != (1, block_size, 1, hd // 2, 2):
        raise ImporterError(f"tensor 'freqs_cis': shape {list(source.shapes[name])}, expected "
                            f"{[1, block_size, 1, hd // 2, 2]} from block_size and n_embd / n_heads")
    dtype = source.dtypes[name]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ImporterError(f"tensor 'freqs_cis': dtype {dtype}; the importer reproduces float32 or bfloat16 tables")
    with safe_open(str(source.where[name]), framework="pt") as f:
        stored = f.get_tensor(name)[0, :, 0].float()  # (block_size, hd/2, 2)
    theta = model_cfg.position.theta
    cos, sin = Rope(hd, theta, "interleaved").cos_sin(torch.arange(block_size)[None])
    ours = torch.stack([cos[0, 0], sin[0, 0]], dim=-1).to(dtype).float()  # (block_size, hd/2, 2)
    diff = (ours - stored).abs()
    if diff.max() > tolerance:
        raise ImporterError(
            f"tensor 'freqs_cis': {int((diff > tolerance).sum())} of {diff.numel()} entries differ from looplm's "
            f"RoPE table (rope_base {theta:g}, rounded to {str(dtype).removeprefix('torch.')}) by up to "
            f"{diff.max().item():.3g}; the original rotates with the stored values, so the imported model would not "
            f"reproduce it exactly. --rope-tolerance {diff.max().item():.3g} imports it anyway")
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def import_huginn(src: str | Path, out: str | Path, *, seq_len: int | None = None, dtype: str = "source",
                  initial_state: str = "table", rope_tolerance: float = 0.0, progress: bool = True) -> dict[str, Any]:
    """Import a Huginn-0125 folder (config.json, safetensors shards, tokenizer.json) as a looplm checkpoint.

    Args:
        src: the downloaded folder (e.g. huggingface-cli download tomg-group-umd/huginn-0125 --local-dir SRC).
        out: the run folder to write (OUT/latest → OUT/checkpoints/step-000000); must not hold a
            checkpoint.
        seq_len: context length of the imported model, at most block_size; default min(block_size, 4096)
        dtype: weights as stored (source: bf16, every value kept) or converted (float32, bfloat16)
        initial_state: table (truncated normal, std √(2/5), fixed per position, seed 0), fresh (a new draw every
            forward, as the original) or zeros (the original's init_scale=0)
        rope_tolerance: largest accepted difference between the stored RoPE table and looplm's (0: exact)
        progress: show a progress bar over the bytes read
    ImporterError: the folder, a config key, a tensor or the RoPE table cannot be imported exactly (named)."""
    def read(source: Source):
        model_cfg, depth = read_config(source.config, seq_len=seq_len, initial_state=initial_state)
        table_dtype = check_rope_table(source, model_cfg, rope_tolerance)
        model_cfg = model_cfg.replace(position=model_cfg.position.replace(table_dtype=table_dtype))
        return model_cfg, {"depth": depth, "rope_table_dtype": table_dtype, "initial_state": initial_state}

    return import_folder(src, out, read, tensor_map, fmt="huginn-0125", model_name=MODEL_NAME, dtype=dtype,
                         progress=progress, consumed=["freqs_cis"])
