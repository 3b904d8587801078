"""Hugging Face interop (the ``hf`` extra): transformers classes, the export folder, the lm-eval backend.
Importing it registers ``LoopLMConfig`` / ``LoopLMForCausalLM`` (model type ``looplm``) with the Auto classes
when transformers is installed (``import looplm`` does so only if transformers is already imported).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["register", "LoopLMConfig", "LoopLMForCausalLM", "LoopLMCache"]
#: the lazily imported classes and their modules
_LAZY = {"LoopLMConfig": "configuration", "LoopLMForCausalLM": "modeling", "LoopLMCache": "modeling"}

_registered = False


def register() -> bool:
    """Register the looplm classes with transformers' Auto classes (idempotent). Returns whether
    transformers is installed (False: nothing registered)."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return False
    from looplm.hf.configuration import LoopLMConfig
    from looplm.hf.modeling import LoopLMForCausalLM

    AutoConfig.register("looplm", LoopLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)
    _registered = True
    return True


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'looplm.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"looplm.hf.{_LAZY[name]}"), name)


try:  # registration on import, when transformers is installed
    import transformers as _transformers  # noqa: F401
except ImportError:
    pass
else:
    register()
