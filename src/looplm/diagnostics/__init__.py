"""Mechanism diagnostics (SPEC §6–7): forcing bias, gain, anchor-start rollouts, hidden-state scale, visit
alignment and token convergence; :mod:`.runner` runs them all (``looplm diagnose``), :mod:`.report` renders."""
