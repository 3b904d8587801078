"""Distilled prefill (Looped Models Done Right, arXiv:2610.06833 §3.2 Figure 3c, eq. 4, §5.5 Table 5;
SPEC §8).

A student S_ψ maps the teacher's prelude output e to ẑ ≈ z^R; the prefill then runs one teacher
recurrence from ẑ and the coda, keeping each physical layer's terminal K/V, and the teacher decodes at
R with terminal KV sharing.

- :mod:`~looplm.distill.config`: :class:`DistillConfig` (torch-free; the options of ``looplm distill``)
  and the :class:`StudentRecord` saved with a student;
- :mod:`~looplm.distill.student`: the :class:`Student` module, its construction from the teacher's
  core, fingerprints and strict loading (``RUN/student/`` next to the teacher);
- :mod:`~looplm.distill.loss`: eq. 4 and the σ_T² estimator;
- :mod:`~looplm.distill.prefill`: :func:`distilled_prefill` and the prefill paths of Table 5;
- :mod:`~looplm.distill.train`: :func:`distill`, the resumable training loop (``looplm distill``);
- :mod:`~looplm.distill.evaluate`: continuation PPL after each prefill path (``looplm eval distill``).
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
