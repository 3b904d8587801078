"""The distillation config (torch-free): the student's shape, the eq. 4 loss terms and the optimization.

Source: "Towards Looped Models Done Right" (arXiv:2610.06833) §3.2 eq. 4, §5.5; SPEC §8. Every field
becomes an option of ``looplm distill`` (``--n-blocks 2``), with its help text from the metadata.

The optimization fields have the names and meanings of :class:`looplm.config.OptimConfig`'s (``lr``,
``warmup_steps``, ``schedule``, ``min_lr_ratio``, ``weight_decay``, ``beta1``, ``beta2``, ``grad_clip``);
:attr:`DistillConfig.optim` hands them to :func:`looplm.train.optim.build_optimizer` and ``lr_factor``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from looplm.config import ConfigError, Device, OptimConfig, Schedule, _Base, _check, _check_literal, _f

StudentInit = Literal["teacher", "random"]

#: ``config.json`` of a student checkpoint says what it is, so a teacher folder is never mistaken for it
STUDENT_KIND = "looplm-student"
STUDENT_FORMAT = 1


@dataclass(frozen=True)
class DistillConfig(_Base):
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
    lr: float = _f(1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr")
    warmup_steps: int = _f(20, "linear warm-up steps")
    schedule: Schedule = _f("cosine", "after the warm-up: cosine (to min_lr_ratio·lr) or wsd (constant, then cosine "
                            "over the last tenth)")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices")
    beta1: float = _f(0.9, "AdamW β1")
    beta2: float = _f(0.95, "AdamW β2")
    grad_clip: float = _f(1.0, "gradient-norm clipping threshold (0 = off)")
    seed: int = _f(0, "seed of the random init and of the batch draws")
    eval_every: int = _f(100, "measure the loss terms on the valid split every this many steps (0 = only at the end)")
    eval_batches: int = _f(4, "valid batches per measurement")
    ckpt_every: int = _f(100, "write a checkpoint every this many steps (0 = only at the end)")
    num_threads: int = _f(0, "torch CPU threads (0 = torch default)")
    device: Device = _f("cpu", "cpu, cuda or auto")

    def __post_init__(self) -> None:
        _check_literal(self, self._prefix)
        p = self._prefix
        for name in ("n_blocks", "sigma_batches", "eval_batches"):
            _check(getattr(self, name) >= 1, p + name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("depth", "steps", "batch_size", "warmup_steps", "eval_every", "ckpt_every", "num_threads"):
            _check(getattr(self, name) >= 0, p + name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("hidden_weight", "kl_weight", "weight_decay", "grad_clip"):
            _check(getattr(self, name) >= 0, p + name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.hidden_weight > 0 or self.kl_weight > 0, p + "kl_weight",
               "hidden_weight and kl_weight are both 0: eq. 4 needs at least one term")
        try:
            self.optim
        except ConfigError as exc:  # named as this config's own field
            raise ConfigError(p + str(exc).removeprefix(OptimConfig._prefix)) from None

    @property
    def optim(self) -> OptimConfig:
        """The optimization fields as the shared :class:`~looplm.config.OptimConfig` (validated there)."""
        return OptimConfig(**{name: getattr(self, name) for name in OptimConfig.field_names()})

    @classmethod
    def fields_help(cls) -> dict[str, str]:
        """``{field: help}`` (for the command line)."""
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if not f.name.startswith("_")}


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
        import json

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
