"""The distillation config (torch-free): the student's shape, the eq. 4 loss terms and the optimization.

Source: "Towards Looped Models Done Right" (arXiv:2610.06833) §3.2 eq. 4, §5.5; SPEC §8. Every field is
an option of ``looplm distill``: ``--distill.n_blocks 2``, ``--optim.lr 1e-3`` (the shared
:class:`looplm.config.OptimConfig`, with distill's own defaults), help texts from the metadata.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from looplm.config import ConfigError, Device, OptimConfig, RunSection
from looplm.config import section_field as _f

StudentInit = Literal["teacher", "random"]

#: ``config.json`` of a student checkpoint says what it is, so a teacher folder is never mistaken for it
STUDENT_KIND = "looplm-student"
STUDENT_FORMAT = 2  # 2: the optimizer fields in an ``optim`` section


@dataclass(frozen=True)
class DistillConfig(RunSection):
    """A distillation run: student S_ψ, loss (LMDR eq. 4) and optimization (SPEC §8)."""

    _prefix = "distill."
    n_blocks: int = _f(2, "student blocks (LMDR §5.5: 2), each the teacher's Block class with causal attention "
                       "over the whole prompt")
    init: StudentInit = _f("teacher", "teacher: student block i starts as a copy of teacher core block i mod "
                           "n_core (LMDR §5.5); random: GPT-2 init (N(0, init_std), output projections "
                           "init_std/sqrt(2 n_blocks))")
    out_norm: bool = _f(True, "end the student with an RMSNorm (learned gain, starts at 1): z^R of huginn_linear "
                        "leaves an RMSNorm, so its tokens have RMS 1")
    depth: int = _f(0, "teacher depth R whose endpoint z^R the student learns (0 = the teacher's nominal "
                    "training depth)")
    hidden_weight: float = _f(1.0, "weight of the hidden term ||ẑ − z^R||²_F / (N d σ_T²) of eq. 4 (0 = off)")
    kl_weight: float = _f(1.0, "weight of the token-mean KL(p_t || p̂_t) term of eq. 4 (0 = off); p̂ is the "
                          "teacher's coda + readout applied to ẑ")
    sigma_batches: int = _f(4, "batches of the training stream (drawn apart from the training batches) from "
                            "which σ_T², the variance of z^R's entries, is estimated once before step 0")
    steps: int = _f(0, "optimizer steps (0 = a quarter of the teacher's training tokens, LMDR §5.5)")
    batch_size: int = _f(0, "windows of seq_len tokens per step (0 = the teacher's train.batch_size)")
    seed: int = _f(0, "seed of the random init and of the batch draws")
    eval_every: int = _f(100, "measure the loss terms on the valid split every this many steps (0 = only at the end)")
    eval_batches: int = _f(4, "valid batches per measurement")
    ckpt_every: int = _f(100, "write a checkpoint every this many steps (0 = only at the end)")
    num_threads: int = _f(0, "torch CPU threads (0 = torch default)")
    device: Device = _f("cpu", "cpu, cuda or auto")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20),
                               metadata={"help": "AdamW and its schedule (distill's defaults: lr 1e-3, 20 warm-up "
                                                 "steps)"})

    def validate(self) -> None:
        for name in ("n_blocks", "sigma_batches", "eval_batches"):
            self.require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("depth", "steps", "batch_size", "eval_every", "ckpt_every", "num_threads", "hidden_weight",
                     "kl_weight"):
            self.require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        self.require(self.hidden_weight > 0 or self.kl_weight > 0, "kl_weight",
                     "hidden_weight and kl_weight are both 0: eq. 4 needs at least one term")


@dataclass(frozen=True)
class TeacherRef:
    """Which teacher a student was distilled from: ``fingerprint`` is the sha256 of its weights
    (:func:`looplm.distill.student.teacher_fingerprint`); the rest is for people."""

    fingerprint: str
    checkpoint: str
    name: str
    rule: str
    d_model: int
    n_core: int


@dataclass(frozen=True)
class StudentRecord:
    """What a student checkpoint's ``config.json`` holds: the resolved :class:`DistillConfig` (``depth``,
    ``steps`` and ``batch_size`` filled in), the teacher it belongs to and σ_T² (eq. 4)."""

    distill: DistillConfig
    teacher: TeacherRef
    sigma2: float

    def to_dict(self) -> dict[str, Any]:
        return {"kind": STUDENT_KIND, "format_version": STUDENT_FORMAT, "distill": self.distill.to_dict(),
                "teacher": dataclasses.asdict(self.teacher), "sigma2": self.sigma2}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StudentRecord":
        """Raises ConfigError: not a student config, another format, or a bad field."""
        if d.get("kind") != STUDENT_KIND:
            raise ConfigError(f"kind: not a distilled student (expected {STUDENT_KIND!r}, got {d.get('kind')!r})")
        if d.get("format_version") != STUDENT_FORMAT:
            raise ConfigError(f"format_version: this looplm reads student format {STUDENT_FORMAT}, "
                              f"got {d.get('format_version')!r}")
        try:
            teacher = TeacherRef(**d["teacher"])
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"teacher: {exc}") from None
        return cls(distill=DistillConfig.from_dict(d["distill"]), teacher=teacher, sigma2=float(d["sigma2"]))
