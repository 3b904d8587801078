"""Synthetic reasoning tasks whose difficulty k is the number of sequential steps the answer needs
(issue 24 §1): p-hop induction, modular running sums, variable-binding chains, multi-digit addition.

Each family (one module) implements :class:`~looplm.tasks.base.TaskFamily`; :mod:`looplm.tasks.data`
turns a family into seeded training batches and held-out sets, the data source of ``looplm train``
with ``data.dataset=task`` (loss on the answer tokens only); ``looplm eval tasks`` reports exact-match
accuracy by loop depth × k (:mod:`looplm.eval.tasks`).
"""

from looplm.tasks import addition, modsum, phop, varchain  # noqa: F401  (each registers its family)
from looplm.tasks.base import (CHARS, EOT, PAD_ID, TASKS, VOCAB, Instance, TaskFamily, decode, encode, get_task,
                               tokenizer)

__all__ = ["CHARS", "EOT", "PAD_ID", "TASKS", "VOCAB", "Instance", "TaskFamily", "decode", "encode", "get_task",
           "tokenizer"]
