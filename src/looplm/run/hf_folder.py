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
    modeling_looplm.py       loads with torch + transformers alone (:mod:`looplm.hf.remote`)

:func:`is_hf_export` recognizes such a folder and :func:`hf_export_config` reads its looplm config;
:func:`looplm.run.checkpoint.load_checkpoint` loads its weights, so every ``looplm`` command that takes
``--checkpoint`` takes an export folder too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from looplm.config import Config

MODEL_TYPE = "looplm"
CONFIG_KEY = "looplm"  # the key of the looplm Config dict inside the HF config.json
WEIGHTS_PREFIX = "model."


def read_hf_config(path: str | Path) -> dict | None:
    """The dict of ``path/config.json``, or None when it is missing, unreadable or not a JSON object."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return d if isinstance(d, dict) else None


def is_hf_export(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``save_pretrained`` of :class:`LoopLMForCausalLM`
    (its ``config.json`` has ``model_type`` "looplm" and the looplm config under "looplm")."""
    d = read_hf_config(Path(path))
    return d is not None and d.get("model_type") == MODEL_TYPE and isinstance(d.get(CONFIG_KEY), dict)


def hf_export_config(path: str | Path) -> Config:
    """The looplm :class:`~looplm.config.Config` stored in an export's ``config.json``, with ``train.eval_depth``
    = its ``num_steps``: the depth transformers runs by default is every looplm command's default too."""
    d = read_hf_config(Path(path))
    if d is None or not isinstance(d.get(CONFIG_KEY), dict):
        raise ValueError(f"{path}: not a looplm Hugging Face export (config.json without a '{CONFIG_KEY}' entry)")
    cfg = Config.from_dict(d[CONFIG_KEY])
    if d.get("num_steps") is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_depth=int(d["num_steps"])))
    return cfg


def export_kv_cache(path: str | Path) -> str | None:
    """The KV cache layout an export's ``generate`` uses by default (``config.json``'s ``kv_cache``), or None
    when ``path`` is not an export: ``looplm generate`` / ``lm-eval`` default to it, as transformers does."""
    d = read_hf_config(Path(path)) if is_hf_export(path) else None
    return None if d is None else d.get("kv_cache", "per_visit")
