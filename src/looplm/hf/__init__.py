"""Hugging Face interop (the ``hf`` extra): transformers classes, the export folder, the lm-eval backend.
Importing it registers ``LoopLMConfig`` / ``LoopLMForCausalLM`` (model type ``looplm``) with the Auto classes
when transformers is installed (``import looplm`` does so only if transformers is already imported).
"""

from __future__ import annotations

__all__ = ["register", "LoopLMConfig", "LoopLMForCausalLM", "LoopLMCache"]


def register() -> bool:
    """Register the looplm classes with transformers' Auto classes (idempotent). Returns whether
    transformers is installed (False: nothing registered)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return False
    AutoConfig.register("looplm", LoopLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)
    return True


try:  # registration on import, when transformers is installed
    import transformers as _transformers  # noqa: F401
except ImportError:
    pass
else:
    from looplm.hf.configuration import LoopLMConfig
    from looplm.hf.modeling import LoopLMCache, LoopLMForCausalLM

    register()
