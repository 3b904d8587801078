"""Mechanism diagnostics (SPEC §7)."""
