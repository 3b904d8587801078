"""Model code (single-device; no torch.distributed here)."""

from looplm.model.kvcache import AttentionScope, KVCache
from looplm.model.layers import Block, Core, RMSNorm
from looplm.model.looped import LoopLM, LoopOutput
from looplm.model.recurrence import RULES, LoopContext, RecurrenceRule, build_rule, register_rule

__all__ = ["AttentionScope", "KVCache", "Block", "Core", "RMSNorm", "LoopLM", "LoopOutput", "RULES", "LoopContext", "RecurrenceRule",
           "build_rule", "register_rule"]
