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

from looplm.distill.config import DistillConfig, StudentRecord, TeacherRef
from looplm.distill.loss import distill_loss
from looplm.distill.prefill import distilled_prefill, prefill_paths
from looplm.distill.student import (Student, StudentMismatchError, build_student, default_student_dir, load_student,
                                    teacher_fingerprint)

__all__ = ["DistillConfig", "StudentRecord", "TeacherRef", "distill_loss", "distilled_prefill", "prefill_paths",
           "Student", "StudentMismatchError", "build_student", "default_student_dir", "load_student",
           "teacher_fingerprint"]
