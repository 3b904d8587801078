"""``looplm distill``: train the student S_ψ against a frozen teacher (LMDR §3.2, §5.5, eq. 4; arXiv:2610.06833;
SPEC §8). Batches are the trainer's (pure functions of (seed, step); σ_T² from ``micro=-1`` draws); the
default budget is a quarter of the teacher's training tokens. The teacher (eval mode) gives e, z^R and its
logits under ``no_grad``; the loss flows through its coda + readout into ẑ. Checkpoints hold the student, its
:class:`StudentRecord` and the training state, so a resume reproduces the loss trace; the run folder is
locked while training (:mod:`looplm.run.folder`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looplm.data.tokens import eval_windows, sample_batch
from looplm.distill.config import DistillConfig, StudentRecord
from looplm.distill.loss import VarianceAccumulator, distill_loss
from looplm.distill.prefill import teacher_targets
from looplm.distill.student import Student, build_student, default_student_dir, load_student, read_record, teacher_ref
from looplm.run.finite import NonFiniteError
from looplm.model import LoopLM, eval_mode
from looplm.run.checkpoint import load_train_state, newest_valid_checkpoint, save_checkpoint
from looplm.run.dist import resolve_device
from looplm.run.folder import Fit, RunFolder, run_state, set_rng_state
from looplm.train.optim import Optimization


def resolve_config(cfg: DistillConfig, teacher_cfg) -> DistillConfig:
    """``cfg`` with ``depth`` (the teacher's nominal depth), ``batch_size`` (the teacher's) and ``steps`` (a
    quarter of the teacher's training tokens, LMDR §5.5, rounded up) filled in where they are 0."""
    t = teacher_cfg.train
    depth = cfg.depth or teacher_cfg.depth.nominal_depth()
    batch = cfg.batch_size or t.batch_size
    teacher_tokens = t.steps * t.batch_size * t.grad_accum
    steps = cfg.steps or max(1, math.ceil(teacher_tokens / 4 / batch))
    return cfg.replace(depth=depth, batch_size=batch, steps=steps)


def estimate_sigma2(teacher: LoopLM, tokens: np.ndarray, cfg: DistillConfig, seq_len: int,
                    device: torch.device) -> float:
    """σ_T² of eq. 4 (:mod:`looplm.distill.loss`): the variance of every entry of z^R over ``sigma_batches``
    windows batches drawn with ``micro=-1`` (never a training batch)."""
    acc = VarianceAccumulator()
    for k in range(cfg.sigma_batches):
        x, _ = sample_batch(tokens, cfg.batch_size, seq_len, seed=cfg.seed, step=k, micro=-1)
        acc.add(teacher_targets(teacher, x.to(device), cfg.depth, logits=False)[1])
    return acc.variance()


def student_step(teacher: LoopLM, student: Student, x: torch.Tensor, cfg: DistillConfig, sigma2: float,
                 y: torch.Tensor | None = None):
    """Eq. 4 on windows x (B, L): returns the :class:`~looplm.distill.loss.DistillLoss` and, given the
    targets y, the cross-entropies (nats/token) of the teacher at R and of the student's readout."""
    e, z, t_logits = teacher_targets(teacher, x, cfg.depth, logits=cfg.kl_weight > 0 or y is not None)
    z_hat = student(e)
    s_logits = (teacher.readout(z_hat, final=cfg.depth >= teacher.resolve_final_depth(None, cfg.depth))
                if cfg.kl_weight > 0 or y is not None else None)  # p̂: the teacher's coda + readout on ẑ at R
    res = distill_loss(z_hat, z, sigma2, student_logits=s_logits, teacher_logits=t_logits,
                       hidden_weight=cfg.hidden_weight, kl_weight=cfg.kl_weight)
    if y is None:
        return res, None
    ce = {name: float(torch.nn.functional.cross_entropy(lg.float().flatten(0, 1), y.flatten()))
          for name, lg in (("teacher", t_logits), ("student", s_logits))}
    return res, ce


@torch.no_grad()
def validate(teacher: LoopLM, student: Student, tokens: np.ndarray, cfg: DistillConfig, sigma2: float,
             seq_len: int, device: torch.device) -> dict[str, float]:
    """Token-weighted means over the first ``eval_batches`` full windows batches of ``tokens``: the two
    terms of eq. 4 and the cross-entropies of the teacher at R and of the student's own readout."""
    sums = {"hidden": 0.0, "kl": 0.0, "ce_teacher": 0.0, "ce_student": 0.0}
    n = 0
    with eval_mode(student):
        for x, y, mask in eval_windows(tokens, seq_len, cfg.batch_size, max_batches=cfg.eval_batches):
            full = mask.all(1)
            if not bool(full.any()):
                continue
            x, y = x[full].to(device), y[full].to(device)
            res, ce = student_step(teacher, student, x, cfg, sigma2, y)
            w = x.shape[0]
            for k, v in (("hidden", float(res.hidden)), ("kl", float(res.kl)), ("ce_teacher", ce["teacher"]),
                         ("ce_student", ce["student"])):
                sums[k] += v * w
            n += w
    return {f"val_{k}": v / max(n, 1) for k, v in sums.items()}


def distill(teacher_checkpoint: str | Path, out: str | Path | None = None, cfg: DistillConfig | None = None, *,
            resume: bool = False, stop_after: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Distill a student for ``teacher_checkpoint`` into ``out`` (default ``RUN/student`` next to the teacher).

    ``cfg`` (default :class:`DistillConfig`) is ignored with ``resume`` (the saved one wins); ``stop_after``:
    steps of this invocation. Returns the summary (steps, σ_T², final validation terms, wall time, teacher).

    Raises:
        CheckpointError: a damaged teacher; ``resume`` without a valid student checkpoint.
        StudentMismatchError: ``resume`` into a student of another teacher.
        RunLockedError: another process is distilling into ``out``.
        NonFiniteError: the loss or gradient became NaN/inf.
        ValueError: a fresh run into a folder that already holds checkpoints; an unshared teacher.
    """
    folder = RunFolder(out if out is not None else default_student_dir(teacher_checkpoint))
    with folder.start(resume=resume, what="a student") as ckpt:
        cfg = read_record(ckpt)[0].distill if ckpt else cfg or DistillConfig()
        device = resolve_device(cfg.device, "distill.device")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        from looplm.eval.runner import open_checkpoint

        opened = open_checkpoint(teacher_checkpoint, device=device)  # the teacher, in eval mode
        teacher, tcfg, tckpt = opened.model.requires_grad_(False), opened.cfg, opened.ckpt
        tokens = {split: opened.tokens(split) for split in ("train", "valid")}
        if ckpt:
            student, record, _ = load_student(ckpt, teacher)  # refuses another teacher's student
            student.train()
        else:
            cfg = resolve_config(cfg, tcfg)
            torch.manual_seed(cfg.seed)
            record = StudentRecord(distill=cfg, teacher=teacher_ref(teacher, tckpt, tcfg.name),
                                   sigma2=estimate_sigma2(teacher, tokens["train"], cfg, tcfg.model.seq_len, device))
            student = build_student(teacher, cfg).train()
        return _fit(folder, teacher, student, record, tokens, ckpt, stop_after=stop_after, progress=progress)


def _fit(folder: RunFolder, teacher: LoopLM, student: Student, record: StudentRecord, tokens: dict[str, np.ndarray],
         ckpt: Path | None, *, stop_after: int | None, progress: bool) -> dict[str, Any]:
    """The step loop of :func:`distill` from ``ckpt`` (None: step 0), and its summary."""
    cfg, sigma2, L, device = record.distill, record.sigma2, teacher.cfg.seq_len, next(teacher.parameters()).device
    optim = Optimization(student, cfg.optim, cfg.steps)
    start = 0
    if ckpt:
        state = load_train_state(ckpt)
        optim.load_state_dict(state)
        set_rng_state(state["rng"])
        start = int(state["step"])

    def checkpoint(step: int) -> None:
        save_checkpoint(folder.path, step, student, record,  # type: ignore[arg-type] (record has to_json/to_dict)
                        train_state=run_state(step, cfg.seed, **optim.state_dict()))

    fit = Fit(folder, start=start, total=cfg.steps, stop_after=stop_after, ckpt_every=cfg.ckpt_every,
              save=checkpoint, desc="distill", eval_every=cfg.eval_every, progress=progress)
    with fit:
        for step in fit:
            t0 = time.time()
            x, _ = sample_batch(tokens["train"], cfg.batch_size, L, seed=cfg.seed, step=step)
            res, _ = student_step(teacher, student, x.to(device), cfg, sigma2)
            res.loss.backward()
            loss = float(res.loss.detach())
            grad_norm, lr, kept = optim.step(loss)
            if not kept:
                raise NonFiniteError(f"distill step {step + 1}: loss {loss}, gradient norm {grad_norm}; lower "
                                     f"optim.lr (newest checkpoint: {newest_valid_checkpoint(folder.path)})")
            done = step + 1
            last = {"step": done, "loss": loss, "hidden": float(res.hidden.detach()), "kl": float(res.kl.detach()),
                    "lr": lr, "grad_norm": grad_norm, "tokens_per_s": cfg.batch_size * L / (time.time() - t0)}
            if fit.evaluating(done):
                last.update(validate(teacher, student, tokens["valid"], cfg, sigma2, L, device))
            fit.log(last, loss=f"{loss:.4f}", hidden=f"{last['hidden']:.4f}", kl=f"{last['kl']:.4f}",
                    **({"val_ce": f"{last['val_ce_student']:.3f}"} if "val_ce_student" in last else {}))
    return fit.summary({"steps": cfg.steps, "completed_steps": fit.end, "depth": cfg.depth, "sigma2": sigma2,
                        "params": sum(p.numel() for p in student.parameters()), "wall_s": time.time() - fit.t_start,
                        "tokens": (fit.end - start) * cfg.batch_size * L,
                        **{k: v for k, v in fit.last.items() if k.startswith("val_")},
                        "teacher": record.teacher.checkpoint, "teacher_fingerprint": record.teacher.fingerprint,
                        "out": str(folder.path)})
