"""The Hugging Face export folder (``looplm export``), read without transformers, so every command that takes
``--checkpoint`` takes an export too: ``config.json`` (model_type "looplm", num_steps, kv_cache, final_depth, and
the looplm Config under "looplm"), ``model.safetensors`` (keys prefixed "model."), the tokenizer files and the
remote code (:mod:`looplm.hf.remote`).
"""

from __future__ import annotations

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
    """Whether ``path``'s ``config.json`` has ``model_type`` "looplm" and the looplm config under "looplm"."""
    d = read_hf_config(Path(path))
    return d is not None and d.get("model_type") == MODEL_TYPE and isinstance(d.get(CONFIG_KEY), dict)


def hf_export_config(path: str | Path) -> Config:
    """The looplm Config of an export, ``train.eval_depth`` = its ``num_steps`` (transformers' default depth)."""
    d = read_hf_config(path)
    if d is None or not isinstance(d.get(CONFIG_KEY), dict):
        raise ValueError(f"{path}: not a looplm Hugging Face export (config.json without a '{CONFIG_KEY}' entry)")
    cfg = Config.from_dict(d[CONFIG_KEY])
    if d.get("num_steps") is not None:
        cfg = cfg.replace(train=cfg.train.replace(eval_depth=int(d["num_steps"])))
    return cfg


def export_kv_cache(path: str | Path) -> str | None:
    """An export's default KV cache layout (``config.json``'s ``kv_cache``); None when not an export."""
    return read_hf_config(path).get("kv_cache", "per_visit") if is_hf_export(path) else None
