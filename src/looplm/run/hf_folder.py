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


def hf_export(path: str | Path) -> dict | None:
    """The ``config.json`` dict of the export at ``path``: None unless it parses to a dict with ``model_type``
    "looplm" and the looplm config under "looplm"."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = isinstance(d, dict) and d.get("model_type") == MODEL_TYPE and isinstance(d.get(CONFIG_KEY), dict)
    return d if ok else None


def hf_export_config(export: dict) -> Config:
    """The looplm Config of an export's :func:`hf_export` dict, ``train.eval_depth`` = its ``num_steps``
    (transformers' default depth)."""
    cfg = Config.from_dict(export[CONFIG_KEY])
    if export.get("num_steps") is not None:
        cfg = cfg.replace(train=cfg.train.replace(eval_depth=int(export["num_steps"])))
    return cfg


def export_kv_cache(path: str | Path) -> str | None:
    """An export's default KV cache layout (``config.json``'s ``kv_cache``); None when not an export."""
    export = hf_export(path)
    return None if export is None else export.get("kv_cache", "per_visit")
