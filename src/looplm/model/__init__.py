"""Model code (single-device; no torch.distributed here)."""

from looplm.model.cursor import BPTT, NLL, Gradient, Loop, Readout
from looplm.model.kvcache import AttentionScope, KVCache, KVVisit
from looplm.model.layers import Block, Core, RMSNorm
from looplm.model.looped import DepthLM, LoopLM, LoopOutput, TransformerLM, build_model, eval_mode
from looplm.model.recurrence import RULES, LoopContext, RecurrenceRule, build_rule, register_rule

__all__ = ["BPTT", "NLL", "Gradient", "Loop", "Readout", "AttentionScope", "KVCache", "KVVisit", "Block", "Core",
           "RMSNorm", "DepthLM", "LoopLM", "LoopOutput",
           "TransformerLM", "build_model", "eval_mode", "RULES", "LoopContext", "RecurrenceRule", "build_rule", "register_rule"]
