"""Synthetic reasoning tasks whose difficulty k is the number of sequential steps the answer needs (issue 24
§1): p-hop induction, modular running sums, variable-binding chains, multi-digit addition; one module per
:class:`~looplm.tasks.base.TaskFamily`, seeded data in :mod:`.data` (``data.dataset=task``)."""

from looplm.tasks import addition, forest, modsum, phop, pointer, varchain  # noqa: F401  (each registers its family)
from looplm.tasks.base import TASKS, Instance, TaskFamily, decode, encode, get_task

__all__ = ["TASKS", "Instance", "TaskFamily", "decode", "encode", "get_task"]
