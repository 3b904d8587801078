"""Distilled prefill (LMDR arXiv:2610.06833 §3.2 Figure 3c, eq. 4, §5.5 Table 5; SPEC §8): a student S_ψ maps
the teacher's prelude output e to ẑ ≈ z^R; one teacher recurrence from ẑ and the coda fill terminal KV banks.
Submodules: config, student, loss (eq. 4), prefill, train (``looplm distill``), evaluate (``looplm eval distill``).
"""

import importlib

#: public name → submodule; imported on first use, so `looplm --help` (which imports
#: looplm.distill.commands) does not pull in torch
_EXPORTS = {"DistillConfig": "config", "StudentRecord": "config", "TeacherRef": "config",
            "distill_loss": "loss", "distilled_prefill": "prefill", "prefill_paths": "prefill",
            "Student": "student", "StudentMismatchError": "student", "build_student": "student",
            "default_student_dir": "student", "load_student": "student", "teacher_fingerprint": "student"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"looplm.distill.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'looplm.distill' has no attribute {name!r}")
