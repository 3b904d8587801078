"""Distilled prefill (LMDR arXiv:2610.06833 §3.2 Figure 3c, eq. 4, §5.5 Table 5; SPEC §8): a student S_ψ maps
the teacher's prelude output e to ẑ ≈ z^R; one teacher recurrence from ẑ and the coda fill terminal KV banks.
Submodules: config, student, loss (eq. 4), prefill, train (``looplm distill``), evaluate (``looplm eval distill``).
"""
