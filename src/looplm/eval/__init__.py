"""Evaluation: multi-depth perplexity (SPEC §6)."""
