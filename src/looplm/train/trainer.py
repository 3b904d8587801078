"""The training loop: setup → fit, with periodic validation, atomic checkpoints and exact resume.

Exact resume: batches and depth draws are pure functions of (seed, step, micro); the checkpoint keeps
weights, optimizer, scheduler and the torch RNG (dropout) state, so a run resumed from step k
reproduces the loss trace of the uninterrupted run bit for bit on CPU.

The run folder, its lock, the metrics log, the RNG state and the step loop are :mod:`looplm.run.folder`'s.

Faults: the run folder is locked while a process trains into it (:mod:`looplm.run.lock`). A step
whose loss or gradient norm is NaN/inf is skipped (no optimizer update, no depth-prior update; its batch
is not retried and the schedule advances, so resume stays exact) and logged with ``"skipped": true``;
``train.max_nonfinite_steps`` such steps in a row stop the run with :class:`DivergenceError`. A
checkpoint is never written from non-finite weights, and every JSON file is strict (NaN → null, listed
under ``"nonfinite"``).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from looplm.config import Config
from looplm.data.paths import resolve_cache_dir, resolve_data_root
from looplm.data.tokenizer import get_tokenizer
from looplm.data.tokens import load_tokens, sample_batch
from looplm.eval.perplexity import evaluate_depths
from looplm.finite import NonFiniteError, clean, nonfinite_tensors
from looplm.model import Block, LoopLM, build_model
from looplm.run.checkpoint import (is_sharded, load_checkpoint, load_config, load_sharded, load_train_state,
                                   newest_valid_checkpoint, save_checkpoint, save_sharded_checkpoint, sharded_keys)
from looplm.run.dist import (all_reduce_sum, barrier, full_state, init_distributed, load_optimizer_state,
                             local_rows, mean_across_ranks, resolve_device, set_sharded_state, sharded_state,
                             shutdown, unwrap, wrap_model)
from looplm.run.folder import Fit, RunFolder, rng_state, set_rng_state
from looplm.train.loggers import Trackers, check_loggers, open_trackers
from looplm.train.losses import training_loss
from looplm.train.optim import build_optimizer, build_scheduler
from looplm.train.samplers import build_sampler

if TYPE_CHECKING:
    from looplm.tasks.data import TaskData


class DivergenceError(NonFiniteError):
    """Training stopped: ``train.max_nonfinite_steps`` consecutive steps had a non-finite loss or
    gradient norm. The message names the steps and the newest checkpoint (whose weights are finite)."""


def compile_blocks(model: LoopLM, backend: str = "inductor") -> LoopLM:
    """``torch.compile`` every block in place (``nn.Module.compile``: weights and state-dict keys are
    unchanged). Each block is one graph whatever the loop depth, so changing T does not recompile."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(backend=backend)
    return model


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast when ``dtype == "bfloat16"``, otherwise a no-op context."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class TrainData:
    """Tokenized splits and the tokenizer of a run. ``window_stride``: training windows start at
    multiples of it (``sample_batch``'s ``stride``; > 1 for streams of fixed-length records, e.g. the
    synthetic tasks of :mod:`looplm.rl.task`; corpora use 1)."""

    train: np.ndarray
    valid: np.ndarray
    tokenizer_json: str
    vocab_size: int
    window_stride: int = 1

    def batch(self, batch_size: int, seq_len: int, *, seed: int, step: int, micro: int = 0):
        """The training batch x, y (B, L) of (seed, step, micro) (:func:`sample_batch`)."""
        return sample_batch(self.train, batch_size, seq_len, seed=seed, step=step, micro=micro,
                            stride=self.window_stride)

    def validate(self, model, depth: int, *, batch_size: int, batches: int, device) -> dict[str, float]:
        """Validation loss, PPL and state RMS at ``depth`` on the first ``batches`` windows of ``valid``."""
        res = evaluate_depths(model, self.valid, [depth], batch_size=batch_size,
                              max_tokens=batches * batch_size * model.cfg.seq_len, device=device, progress=False,
                              state_rms=True)[depth]
        return {"val_loss": res["nll"], "val_ppl": res["ppl"], "val_state_rms": res["state_rms"],
                "val_state_rms_max": res["state_rms_max"]}


def prepare_data(cfg: Config, *, progress: bool = True) -> "TrainData | TaskData":
    """Tokenizer and memmapped train/valid token streams for ``cfg.data`` (cached on disk); for
    ``data.dataset=task`` the task's generated batches (:class:`looplm.tasks.data.TaskData`)."""
    if cfg.data.dataset == "task":
        from looplm.tasks.data import task_data

        return task_data(cfg.data)
    root = resolve_data_root(cfg.data.data_root)
    cache = resolve_cache_dir(cfg.data.cache_dir)
    tok = get_tokenizer(cfg.data, root, cache)
    train = load_tokens(cfg.data, "train", tok, root, cache, progress=progress)
    valid = load_tokens(cfg.data, "valid", tok, root, cache, progress=progress)
    return TrainData(train=train, valid=valid, tokenizer_json=tok.to_str(), vocab_size=tok.get_vocab_size())


def _check_init_vocab(ckpt: Path, vocab_size: int, data: TrainData) -> None:
    """--init-from: the data's tokenizer must have the vocabulary the weights were trained with."""
    from tokenizers import Tokenizer

    saved = ckpt / "tokenizer.json"
    if vocab_size != data.vocab_size or saved.is_file() and Tokenizer.from_file(str(saved)).get_vocab() != \
            Tokenizer.from_str(data.tokenizer_json).get_vocab():
        raise ValueError(f"--init-from {ckpt}: its tokenizer.json differs from the data's tokenizer "
                         f"({data.vocab_size} entries); set data.tokenizer to the one the weights were trained with")


def train(cfg: Config, out_dir: str | Path, *, resume: bool = False, progress: bool = True,
          data: "TrainData | TaskData | None" = None, stop_after: int | None = None, steps: int | None = None,
          init_from: str | Path | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into ``out_dir`` (checkpoints, ``metrics.jsonl``, ``config.json``).

    Under ``torchrun`` (WORLD_SIZE > 1) this runs data-parallel with DDP or FSDP2
    (``train.distributed``); rank 0 writes every file.

    Args:
        cfg: run config; ``model.vocab_size`` is set from the tokenizer.
        out_dir: run directory.
        resume: continue from the newest valid checkpoint in ``out_dir`` (its saved config wins; the
            world size may differ from the one that saved it).
        data: pre-tokenized data (tests and the demo reuse it across runs).
        stop_after: stop (with a checkpoint) after this many steps of this invocation, e.g. to fit a
            time box; ``resume`` continues later exactly as if never stopped.
        steps: with ``resume``, train on to this many steps (e.g. a finished run of 400 to 800). The
            saved ``train.steps`` becomes ``steps`` and the LR schedule is recomputed for the new total
            (:func:`~looplm.train.optim.lr_factor` at the resumed step; a cosine that had decayed rises to
            its value there). Unchanged ``steps``: the ordinary, bit-exact resume.
        init_from: a new run starts from this checkpoint's weights (run, checkpoint or HF export folder;
            strict loading): its model config replaces ``cfg.model``; optimizer, schedule and step start
            fresh. The data's tokenizer must have the checkpoint's vocabulary.
        overwrite: a fresh run may replace the ``metrics.jsonl`` of a run in ``out_dir`` that wrote no
            checkpoint (it diverged or stopped before its first); refused otherwise.

    Returns:
        Summary: steps, final validation loss/PPL, wall time (``wall_s``: summed over every invocation
        up to the newest checkpoint), tokens/s of this invocation, parameter count.

    Raises:
        CheckpointError: ``resume`` with no valid checkpoint in ``out_dir``.
        RunLockedError: another process is training into ``out_dir``.
        DivergenceError: ``train.max_nonfinite_steps`` consecutive non-finite steps.
        NonFiniteError: the weights became non-finite (no checkpoint is written from them).
        ValueError: ``train.batch_size`` not divisible by the world size; a fresh run (no ``resume``)
            into a folder that already holds checkpoints, or (without ``overwrite``) a ``metrics.jsonl``;
            ``steps`` below the resumed step; ``init_from`` with ``resume`` or another vocabulary.
    """
    folder = RunFolder(out_dir)
    check_loggers(cfg.train.logger)  # a missing tracking package fails before anything else happens
    trackers = Trackers([])  # filled by _train (rank 0); closed here whatever happens
    # one writer per run folder; under torchrun rank 0 holds the lock for all ranks (it writes the files)
    with folder.locked(hold=int(os.environ.get("RANK", "0")) == 0):
        try:
            if not resume:
                folder.check_fresh()
            if not resume and not overwrite and folder.metrics.exists():
                raise ValueError(f"--out {folder.path} holds the metrics.jsonl of a run that wrote no checkpoint (it "
                                 "diverged or stopped before its first); pass --overwrite to replace it, or choose "
                                 "another --out")
            if resume and init_from is not None:
                raise ValueError("--init-from starts a new run from a checkpoint's weights; not with --resume")
            return _train(cfg, folder, resume=resume, progress=progress, data=data, stop_after=stop_after,
                          trackers=trackers, steps=steps, init_from=init_from)
        finally:
            trackers.close(None)


def _train(cfg: Config, folder: RunFolder, *, resume: bool, progress: bool, data: "TrainData | TaskData | None",
           stop_after: int | None, trackers: Trackers, steps: int | None = None,
           init_from: str | Path | None = None) -> dict[str, Any]:
    out = folder.path
    start_step, state, sharded_ckpt, source = 0, None, None, None
    if resume:
        ckpt = folder.resume_checkpoint()
        if is_sharded(ckpt):  # weights and optimizer are read after wrapping, each rank its own shards
            sharded_ckpt = ckpt
            cfg, state = load_config(ckpt), load_train_state(ckpt)
            model = build_model(cfg)
        else:
            model, cfg, state, _ = load_checkpoint(ckpt, with_state=True)
            model.final_depth = None  # as built fresh: training sets the readout per forward
        start_step = int(state["step"])
        if steps is not None and steps != cfg.train.steps:
            if steps < start_step:
                raise ValueError(f"--train.steps {steps}: the run in {out} is at step {start_step} already")
            cfg = cfg.replace(train=cfg.train.replace(steps=steps))
        else:
            steps = None  # the saved schedule: an ordinary resume
    elif init_from is not None:
        source, source_cfg, _, source_ckpt = load_checkpoint(init_from)
        cfg = cfg.replace(model=source.cfg)  # N = K·R as the source resolved it
    tcfg = cfg.train
    check_loggers(tcfg.logger)  # on resume: the saved config's loggers
    if tcfg.num_threads:
        torch.set_num_threads(tcfg.num_threads)
    env = init_distributed(resolve_device(tcfg.device))
    device, main = env.device, env.is_main
    rows = local_rows(tcfg.batch_size, env)
    data = data or prepare_data(cfg, progress=progress and main)
    if cfg.model.vocab_size != data.vocab_size:
        cfg = cfg.replace(model=cfg.model.replace(vocab_size=data.vocab_size))
    if source is not None:
        _check_init_vocab(source_ckpt, source_cfg.model.vocab_size, data)
    if not resume:
        torch.manual_seed(tcfg.seed)
        model = build_model(cfg)
        if source is not None:
            model.load_state_dict(source.state_dict(), strict=True)  # same config: the same keys and shapes
    model.to(device)
    if tcfg.compile:
        compile_blocks(model)
    fsdp = env.enabled and tcfg.distributed == "fsdp"
    n_params = model.num_params()  # before FSDP2 turns parameters into shards
    wrapped = wrap_model(model, tcfg.distributed, env)
    opt = build_optimizer(wrapped, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, tcfg.steps)
    if sharded_ckpt is not None:
        model_sd, opt_sd = sharded_state(wrapped, opt, saved=sharded_keys(sharded_ckpt))
        loaded = {"model": model_sd, "optimizer": opt_sd}
        load_sharded(sharded_ckpt, loaded, distributed=env.enabled)  # DCP reshards to this world size
        set_sharded_state(wrapped, opt, loaded["model"], loaded["optimizer"])
    elif state is not None:
        load_optimizer_state(wrapped, opt, state["optimizer"], tcfg.distributed, env)
    if state is not None:
        if steps is None:
            sched.load_state_dict(state["scheduler"])
        else:  # a new total: its schedule from the resumed step on (the groups' initial_lr came with the state)
            sched = build_scheduler(opt, cfg.optim, tcfg.steps, start=start_step)
        set_rng_state(state["rng"])
    sampler = build_sampler(cfg.depth)
    if state is not None and state.get("depth_prior"):
        sampler.load_state_dict(state["depth_prior"])
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(cfg.to_json())
        (out / "tokenizer.json").write_text(data.tokenizer_json)
        # TensorBoard / W&B / trackio (train.logger): the same records as metrics.jsonl
        trackers.trackers = open_trackers(tcfg.logger, out, cfg.to_dict(), name=cfg.name, start_step=start_step,
                                          resume=resume).trackers
    L, B = cfg.model.seq_len, tcfg.batch_size
    eval_model = wrapped if fsdp else unwrap(wrapped)  # FSDP forward is collective: every rank evaluates

    guard = dict(state.get("nonfinite", {})) if state is not None else {}
    wall_before = float(state.get("wall_s", 0.0)) if state is not None else 0.0  # earlier invocations
    skipped, streak = int(guard.get("skipped_steps", 0)), int(guard.get("streak", 0))

    def checkpoint(step: int) -> None:
        plain = unwrap(wrapped)
        bad = nonfinite_tensors([*plain.named_parameters(), *plain.named_buffers()])
        if mean_across_ranks(float(len(bad)), env) > 0:  # every rank agrees, so all raise together
            raise NonFiniteError(f"step {step}: refusing to write a checkpoint: non-finite weights"
                                 f"{' in ' + ', '.join(bad[:5]) if bad else ' on another rank'}; the newest "
                                 f"checkpoint under {out / 'checkpoints'} is left as it was")
        train_state = {"step": step, "scheduler": sched.state_dict(), "rng": rng_state(),
                       "data_position": {"seed": tcfg.seed, "step": step}, "world_size": env.world_size,
                       "depth_prior": sampler.state_dict(), "nonfinite": {"skipped_steps": skipped, "streak": streak},
                       "wall_s": wall_before + time.time() - t_start}
        if tcfg.checkpoint_format == "sharded":
            model_sd, opt_sd = sharded_state(wrapped, opt)
            save_sharded_checkpoint(out, step, {"model": model_sd, "optimizer": opt_sd}, cfg, env,
                                    train_state=train_state, tokenizer_json=data.tokenizer_json)
            return
        model_sd, opt_sd = full_state(wrapped, opt, tcfg.distributed, env)
        if main:
            plain = unwrap(wrapped)
            if fsdp:
                plain = build_model(cfg)
                plain.load_state_dict(model_sd, strict=True)
            save_checkpoint(out, step, plain, cfg, train_state={**train_state, "optimizer": opt_sd},
                            tokenizer_json=data.tokenizer_json)
        barrier(env)

    def validate() -> dict[str, float]:
        return data.validate(eval_model, tcfg.eval_depth, batch_size=B, batches=tcfg.eval_batches, device=device)

    wrapped.train()
    t_start = time.time()
    tokens_done = 0
    last: dict[str, Any] = {}
    fit = Fit(folder, start=start_step, total=tcfg.steps, stop_after=stop_after, ckpt_every=tcfg.ckpt_every,
              save=checkpoint, desc=cfg.name, progress=progress and main, write=main)
    with fit:
        for step in fit:
            t0 = time.time()
            loss_sum, depths, extras, observed = 0.0, [], {}, []
            for micro in range(tcfg.grad_accum):
                # every rank draws the same depth: a pure function of (seed, step, micro)
                T = (cfg.model.n_layers if cfg.model.architecture == "unshared"
                     else sampler.sample(tcfg.seed, step, micro))
                depths.append(T)
                x, y = data.batch(B, L, seed=tcfg.seed, step=step, micro=micro)  # global batch
                x, y = x[rows], y[rows]
                if device.type == "cuda":  # page-locked host memory makes the copy asynchronous
                    x, y = x.pin_memory(), y.pin_memory()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync = contextlib.nullcontext()
                if micro < tcfg.grad_accum - 1 and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                    sync = wrapped.no_sync()
                with sync, autocast_context(device, tcfg.dtype):
                    res = training_loss(wrapped, x, y, T, tcfg)
                with sync:
                    (res.loss / tcfg.grad_accum).backward()
                loss_sum += res.ce
                observed.append((T, res.ce, res.n_tokens))  # fed to the depth prior only if the step is kept
                for key, value in {"objective": float(res.loss.detach()), **res.extras}.items():
                    extras[key] = extras.get(key, 0.0) + value / tcfg.grad_accum
            grad_norm = float(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.optim.grad_clip or math.inf))
            lr = sched.get_last_lr()[0]
            loss = mean_across_ranks(loss_sum / tcfg.grad_accum, env)  # the same on every rank, as is grad_norm
            keep = math.isfinite(loss) and math.isfinite(grad_norm)
            prior: dict[str, float] = {}
            if keep:
                opt.step()
                for obs in observed:
                    sampler.observe(*obs)
                prior = sampler.update(reduce=(lambda t: all_reduce_sum(t, env)) if env.enabled else None)
                streak = 0
            else:  # skip the update (as large-scale trainers do); the batch is not retried
                skipped, streak = skipped + 1, streak + 1
            sched.step()  # the schedule is a function of the step, kept or skipped
            opt.zero_grad(set_to_none=True)
            dt = time.time() - t0
            n_tok = B * L * tcfg.grad_accum
            tokens_done += n_tok
            done = step + 1
            last = {"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm, "depths": depths,
                    "tokens_per_s": n_tok / dt, **extras, **{f"prior_{k}": v for k, v in prior.items()},
                    "skipped_steps": skipped, **({} if keep else {"skipped": True})}
            if tcfg.eval_every and done % tcfg.eval_every == 0 or done == tcfg.steps:
                last.update(validate())
            fit.log(last, loss=f"{loss:.3f}", T=depths[0], tok_s=f"{n_tok / dt:.0f}", skipped=skipped,
                    **({"val_ppl": f"{last['val_ppl']:.1f}"} if "val_ppl" in last else {}))
            if main:
                trackers.log(last)
            if streak >= tcfg.max_nonfinite_steps:
                newest = newest_valid_checkpoint(out) if main else None
                shutdown(env)
                raise DivergenceError(
                    f"training diverged: {streak} consecutive steps ({done - streak + 1}..{done}) had a non-finite "
                    f"loss or gradient norm (last: loss {loss}, grad norm {grad_norm}); each was skipped, and "
                    f"train.max_nonfinite_steps={tcfg.max_nonfinite_steps} stops the run. Newest checkpoint (finite "
                    f"weights): {newest or 'none'}. Lower optim.lr, raise optim.warmup_steps or set optim.grad_clip")
    end_step = fit.end
    wall = time.time() - t_start
    summary = {"name": cfg.name, "steps": tcfg.steps, "completed_steps": end_step, "skipped_steps": skipped,
               "params": n_params,
               "world_size": env.world_size, "wall_s": wall_before + wall,
               "train_tokens_per_s": tokens_done / wall if wall > 0 else 0.0,
               "val_loss": last.get("val_loss"), "val_ppl": last.get("val_ppl"), "out": str(out)}
    # strict JSON: a NaN validation loss becomes null, listed in "nonfinite"
    summary = folder.summary(clean(summary), start=start_step, end=end_step, total=tcfg.steps, write=main)
    trackers.close(summary)  # the summary as run metadata
    shutdown(env)
    return summary
