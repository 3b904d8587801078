"""Hugging Face interop: transformers classes, the export folder, and the lm-evaluation-harness backend.

Needs the ``hf`` extra (``pip install looplm[hf]``) (:mod:`looplm.run.hf_folder`, outside this package, reads an
export without transformers). Importing this package registers ``LoopLMConfig`` and
``LoopLMForCausalLM`` with ``AutoConfig`` / ``AutoModelForCausalLM`` (model type ``looplm``) when
transformers is installed, and does nothing otherwise. ``import looplm`` registers them too, but only
when transformers is already imported (so the core never pays transformers' import time).
"""

from __future__ import annotations

from typing import Any

__all__ = ["register", "LoopLMConfig", "LoopLMForCausalLM", "LoopLMCache"]

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

    try:
        AutoConfig.register("looplm", LoopLMConfig, exist_ok=True)
        AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)
    except TypeError:  # transformers without exist_ok
        AutoConfig.register("looplm", LoopLMConfig)
        AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM)
    _registered = True
    return True


def __getattr__(name: str) -> Any:
    if name == "LoopLMConfig":
        from looplm.hf.configuration import LoopLMConfig

        return LoopLMConfig
    if name in ("LoopLMForCausalLM", "LoopLMCache"):
        from looplm.hf import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'looplm.hf' has no attribute {name!r}")


try:  # registration on import, when transformers is installed
    import transformers as _transformers  # noqa: F401
except ImportError:
    pass
else:
    register()
