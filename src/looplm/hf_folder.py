"""The Hugging Face export folder, read without transformers (so the core loads it too; lives outside
:mod:`looplm.hf`, whose import registers with transformers).

An export (``looplm export``, :func:`looplm.hf.export.export_checkpoint`) is what
``LoopLMForCausalLM.save_pretrained`` writes plus the tokenizer::

    config.json              HF config: model_type "looplm", architectures, auto_map, num_steps,
                             kv_cache, final_depth, … and "looplm": the whole looplm Config dict
    model.safetensors        the weights, keys prefixed "model." (the wrapper's inner LoopLM)
    generation_config.json   eos / pad / bos token ids
    tokenizer.json           the checkpoint's tokenizer (tokenizers JSON, unchanged)
    tokenizer_config.json    PreTrainedTokenizerFast settings and special tokens
    configuration_looplm.py  remote code (``trust_remote_code=True``), generated from looplm's modules:
    modeling_looplm.py       loads with torch + transformers alone (:mod:`looplm.hf.export`)

:func:`is_hf_export` recognizes such a folder and :func:`load_hf_export` builds the plain looplm model
from it, so every ``looplm`` command that takes ``--checkpoint`` takes an export folder too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MODEL_TYPE = "looplm"
CONFIG_KEY = "looplm"  # the key of the looplm Config dict inside the HF config.json
WEIGHTS_PREFIX = "model."


def _read_config(path: Path) -> dict | None:
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return d if isinstance(d, dict) else None


def is_hf_export(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``save_pretrained`` of :class:`LoopLMForCausalLM`
    (its ``config.json`` has ``model_type`` "looplm" and the looplm config under "looplm")."""
    d = _read_config(Path(path))
    return d is not None and d.get("model_type") == MODEL_TYPE and isinstance(d.get(CONFIG_KEY), dict)


def hf_export_config(path: str | Path):
    """The looplm :class:`~looplm.config.Config` stored in an export's ``config.json``, with ``train.eval_depth``
    = its ``num_steps``: the depth transformers runs by default is every looplm command's default too."""
    import dataclasses

    from looplm.config import Config

    d = _read_config(Path(path))
    if d is None or not isinstance(d.get(CONFIG_KEY), dict):
        raise ValueError(f"{path}: not a looplm Hugging Face export (config.json without a '{CONFIG_KEY}' entry)")
    cfg = Config.from_dict(d[CONFIG_KEY])
    if d.get("num_steps") is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_depth=int(d["num_steps"])))
    return cfg


def export_kv_cache(path: str | Path) -> str | None:
    """The KV cache layout an export's ``generate`` uses by default (``config.json``'s ``kv_cache``), or None
    when ``path`` is not an export: ``looplm generate`` / ``lm-eval`` default to it, as transformers does."""
    d = _read_config(Path(path)) if is_hf_export(path) else None
    return None if d is None else d.get("kv_cache", "per_visit")


def load_hf_export(path: str | Path, *, device: str | torch.device = "cpu"):
    """``(model, config)``: the plain looplm model of an export folder, weights loaded strictly, in eval
    mode, with ``final_depth`` from the export's config (the checkpoint's nominal training depth).

    Raises:
        CheckpointError: missing or unreadable weights, or weights that do not match the config.
        NonFiniteError: the weights hold NaN or ±inf.
    """
    from safetensors.torch import load_file

    from looplm.model import build_model
    from looplm.train.checkpoint import CheckpointError

    path = Path(path)
    cfg = hf_export_config(path)
    hf = _read_config(path) or {}
    model = build_model(cfg.model)
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model.safetensors in this Hugging Face export")
    state: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            state.update(load_file(str(f), device=str(device)))
    except Exception as exc:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{path}: cannot load weights ({exc})") from exc
    state = {k[len(WEIGHTS_PREFIX):] if k.startswith(WEIGHTS_PREFIX) else k: v for k, v in state.items()}
    if cfg.model.tie_embeddings and "lm_head.weight" not in state and "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]  # save_pretrained drops the tied copy
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model of config.json "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.load_state_dict(state, strict=True)
    from looplm.finite import NonFiniteError, nonfinite_tensors

    bad = nonfinite_tensors(model.state_dict().items())
    if bad:
        raise NonFiniteError(f"{path}: the weights hold NaN/inf values (in {', '.join(bad[:5])})")
    model.to(device)
    model.final_depth = hf.get("final_depth", cfg.train.nominal_depth)
    model.eval()
    return model, cfg
