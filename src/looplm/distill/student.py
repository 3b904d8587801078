"""The student S_ψ of distilled prefill and its checkpoints (LMDR §3.2, §5.5, arXiv:2610.06833; SPEC §8).

ẑ = S_ψ(e): ``x ← x + Block_k(x)`` for k = 1 … n_blocks (deep copies of the teacher core's blocks, causal over
the whole prompt) from x = e, then an optional RMSNorm. Checkpoints are run folders (default ``RUN/student/``)
written by :func:`looplm.run.checkpoint.save_checkpoint`; ``config.json`` is a :class:`StudentRecord` with the
teacher's :func:`teacher_fingerprint`; loading refuses another teacher's student (:class:`StudentMismatchError`)
and is strict.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_model
from torch import nn

from looplm.config import ConfigError
from looplm.distill.config import DistillConfig, StudentRecord, TeacherRef
from looplm.model import Block, LoopLM, RMSNorm
from looplm.model.kvcache import AttentionScope
from looplm.run.checkpoint import CONFIG_FILE, MODEL_FILE, CheckpointError, resolve_checkpoint, verify_checkpoint
from looplm.run.hf_folder import hf_export

#: the folder of a teacher run that holds its student by default
STUDENT_DIR = "student"


class StudentMismatchError(CheckpointError):
    """A student checkpoint was distilled from another teacher (its recorded fingerprint differs)."""


class Student(nn.Module):
    """S_ψ: e (B, L, d) → ẑ (B, L, d) through residual ``blocks``, then an RMSNorm if ``out_norm``."""

    def __init__(self, blocks: list[Block], d_model: int, norm_eps: float, out_norm: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(d_model, norm_eps) if out_norm else None

    def forward(self, e: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """ẑ = S_ψ(e). e: (B, L, d); key_valid: (B, L) bool, False at left padding (None: all real).
        Returns (B, L, d)."""
        # a scope without a cache: the padding mask only; record=False leaves no K/V anywhere
        kv = None if key_valid is None else AttentionScope(None, key_valid).at(0, record=False)
        x = e
        for block in self.blocks:
            x = x + block(x, None, kv)  # (B, L, d)
        return self.norm(x) if self.norm is not None else x


def build_student(teacher: LoopLM, cfg: DistillConfig) -> Student:
    """A student for ``teacher`` as ``cfg`` asks (``n_blocks``, ``init``, ``out_norm``).

    ``init="teacher"``: block i copies teacher core block i mod n_core (LMDR §5.5); ``random``: re-drawn with
    ``torch.manual_seed(cfg.seed)`` by the GPT-2 rule of :meth:`looplm.model.DepthLM.reset_parameters`.
    ValueError: the teacher is not a looped model with a shared core."""
    if not getattr(teacher, "shared", False):
        raise ValueError("distill: the teacher must be a looped (shared-core) model; an unshared model has no "
                         "recurrent endpoint to distill")
    core = teacher.core.blocks
    blocks = [copy.deepcopy(core[i % len(core)]) for i in range(cfg.n_blocks)]
    student = Student(blocks, teacher.cfg.d_model, teacher.cfg.norm_eps, cfg.out_norm)
    if cfg.init == "random":
        gen = torch.Generator().manual_seed(cfg.seed)
        std = teacher.cfg.init_std
        for name, p in student.named_parameters():
            with torch.no_grad():
                if p.dim() < 2:
                    p.fill_(1.0)  # RMSNorm gains
                elif name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * (std / math.sqrt(2 * cfg.n_blocks)))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
    student.requires_grad_(True)  # copies of a frozen teacher's blocks would inherit requires_grad=False
    return student.to(next(teacher.parameters()).device)


def teacher_fingerprint(teacher: nn.Module) -> str:
    """sha256 over the state dict in name order (name, dtype, shape, bytes): independent of the file format."""
    h = hashlib.sha256()
    for name, t in sorted(teacher.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def teacher_ref(teacher: LoopLM, checkpoint: str | Path, name: str) -> TeacherRef:
    """The :class:`TeacherRef` of a loaded teacher."""
    return TeacherRef(fingerprint=teacher_fingerprint(teacher), checkpoint=str(checkpoint), name=name,
                      rule=teacher.cfg.rule, d_model=teacher.cfg.d_model, n_core=teacher.cfg.n_core)


def default_student_dir(teacher_checkpoint: str | Path) -> Path:
    """``RUN/student`` for a run or ``RUN/checkpoints/step-N``; ``DIR-student`` beside an HF export ``DIR``."""
    path = Path(teacher_checkpoint)
    if hf_export(path) is not None:
        return path.parent / f"{path.name}-{STUDENT_DIR}"
    if path.parent.name == "checkpoints" and path.name.startswith("step-"):
        path = path.parent.parent
    return path / STUDENT_DIR


def read_record(student_checkpoint: str | Path) -> tuple[StudentRecord, Path]:
    """(record, checkpoint folder) of a student checkpoint or run folder, after verifying its manifest.
    CheckpointError: nothing loadable there, a damaged file, or not a student checkpoint."""
    ckpt = resolve_checkpoint(student_checkpoint)
    verify_checkpoint(ckpt)
    try:
        return StudentRecord.from_dict(json.loads((ckpt / CONFIG_FILE).read_text())), ckpt
    except (ConfigError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: not a distilled-student config ({exc})") from None


def load_student(student_checkpoint: str | Path, teacher: LoopLM) -> tuple[Student, StudentRecord, Path]:
    """Load a student for ``teacher`` (eval mode, on the teacher's device); weights with strict=True.
    CheckpointError: missing, damaged or not a student checkpoint; StudentMismatchError: the student was distilled
    from another teacher (fingerprints differ)."""
    record, ckpt = read_record(student_checkpoint)
    mine = teacher_fingerprint(teacher)
    if record.teacher.fingerprint != mine:
        raise StudentMismatchError(
            f"{ckpt}: this student was distilled from the teacher {record.teacher.checkpoint} (weights sha256 "
            f"{record.teacher.fingerprint[:16]}…), not from the teacher given (sha256 {mine[:16]}…); "
            "distill a student for it with `looplm distill --checkpoint TEACHER`")
    student = build_student(teacher, record.distill.replace(init="teacher"))
    device = next(teacher.parameters()).device
    try:
        load_model(student, str(ckpt / MODEL_FILE), strict=True, device=str(device))
    except Exception as exc:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{ckpt / MODEL_FILE}: cannot load the student's weights ({exc})") from exc
    return student.eval(), record, ckpt
