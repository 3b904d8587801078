"""The training loop: setup → fit, with periodic validation, atomic checkpoints and exact resume.

Batches and depth draws are pure functions of (seed, step, micro) and checkpoints keep the optimizer, schedule
and RNG state, so a resumed run reproduces the uninterrupted loss trace bit for bit on CPU. A step with a
non-finite loss or gradient norm is skipped (schedule advancing) and logged ``"skipped": true``;
``train.max_nonfinite_steps`` in a row raise :class:`DivergenceError`; no checkpoint holds non-finite weights.
"""

from __future__ import annotations

import contextlib
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
from looplm.run.finite import NonFiniteError, nonfinite_tensors
from looplm.model import Block, LoopLM, build_model
from looplm.run.checkpoint import (CONFIG_FILE, TOKENIZER_FILE, is_sharded, load_checkpoint, load_config, load_sharded,
                                   load_train_state, newest_valid_checkpoint, save_checkpoint, save_sharded_checkpoint,
                                   sharded_keys)
from looplm.run.dist import (all_reduce_sum, barrier, full_state, init_distributed, load_optimizer_state,
                             local_rows, mean_across_ranks, resolve_device, set_sharded_state, sharded_state,
                             shutdown, unwrap, wrap_model)
from looplm.run.folder import Fit, RunFolder, run_state, set_rng_state
from looplm.train.loggers import Trackers, check_loggers
from looplm.train.losses import training_loss
from looplm.train.optim import Optimization, build_scheduler
from looplm.train.samplers import build_sampler

if TYPE_CHECKING:
    from looplm.tasks.data import TaskData


class DivergenceError(NonFiniteError):
    """``train.max_nonfinite_steps`` consecutive non-finite steps (the message names the newest checkpoint)."""


def compile_blocks(model: LoopLM, backend: str = "inductor") -> LoopLM:
    """``torch.compile`` every block in place (state-dict keys unchanged; a new depth T does not recompile)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(backend=backend)
    return model


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
    """Train ``cfg`` into ``out_dir`` (checkpoints, ``metrics.jsonl``, ``config.json``); data-parallel under
    ``torchrun`` (``train.distributed``), rank 0 writing. ``resume``: from the newest valid checkpoint (its
    config wins; any world size); ``data``: pre-tokenized; ``stop_after``: steps of this invocation; ``steps``:
    with ``resume``, extend the schedule to this total; ``init_from``: a fresh run from a checkpoint's weights
    and model config; ``overwrite``: replace the files of a folder that holds no checkpoint (a run that wrote
    none, or anything else: config.json, tokenizer.json, summary.json, metrics.jsonl). Returns the summary.

    Raises:
        CheckpointError: ``resume`` with no valid checkpoint in ``out_dir``.
        RunLockedError: another process is training into ``out_dir``.
        DivergenceError: ``train.max_nonfinite_steps`` consecutive non-finite steps.
        NonFiniteError: the weights became non-finite (no checkpoint is written from them).
        ValueError: ``train.batch_size`` not divisible by the world size; a fresh run (no ``resume``)
            into a folder that already holds checkpoints, or (without ``overwrite``) a file the run writes;
            ``steps`` below the resumed step; ``init_from`` with ``resume`` or another vocabulary.
    """
    if resume and init_from is not None:
        raise ValueError("--init-from starts a new run from a checkpoint's weights; not with --resume")
    folder = RunFolder(out_dir)
    check_loggers(cfg.train.logger)  # a missing tracking package fails before anything else happens
    trackers = Trackers()  # filled by _Run.fit (rank 0); closed here whatever happens
    # one writer per run folder; under torchrun rank 0 holds the lock for all ranks (it writes the files)
    with folder.start(resume=resume, hold=int(os.environ.get("RANK", "0")) == 0, writes=(CONFIG_FILE, TOKENIZER_FILE),
                      overwrite=overwrite) as ckpt:
        try:
            run = _Run.setup(cfg, folder, ckpt, data=data, steps=steps, init_from=init_from, progress=progress)
            return run.fit(trackers, resume=resume, stop_after=stop_after, progress=progress)
        finally:
            trackers.close(None)


def _load(cfg: Config, folder: RunFolder, ckpt: Path | None, steps: int | None, init_from: str | Path | None):
    """The config and what a run starts from: (cfg, model or None, train state or None, sharded checkpoint or
    None, ``steps`` (None: the saved schedule), --init-from (model, config, checkpoint) or None)."""
    model = state = sharded = source = None
    if ckpt is not None:
        if is_sharded(ckpt):  # weights and optimizer are read after wrapping, each rank its own shards
            sharded, cfg, state = ckpt, load_config(ckpt), load_train_state(ckpt)
            model = build_model(cfg)
        else:
            model, cfg, state, _ = load_checkpoint(ckpt, with_state=True)
            model.final_depth = None  # as built fresh: training sets the readout per forward
        start = int(state["step"])
        if steps is not None and steps != cfg.train.steps:
            if steps < start:
                raise ValueError(f"--train.steps {steps}: the run in {folder.path} is at step {start} already")
            cfg = cfg.replace(train=cfg.train.replace(steps=steps))
        else:
            steps = None  # the saved schedule: an ordinary resume
    elif init_from is not None:
        src, src_cfg, _, src_ckpt = load_checkpoint(init_from)
        cfg, source = cfg.replace(model=src.cfg), (src, src_cfg, src_ckpt)  # N = K·R as the source resolved it
    return cfg, model, state, sharded, steps, source


@dataclass
class _Run:
    """A training run set up on this rank: config, data, the model (plain and wrapped), its optimization and
    depth sampler, the training state it resumes from, and the non-finite-step guard."""

    cfg: Config
    folder: RunFolder
    env: Any
    rows: Any
    data: Any
    model: LoopLM
    wrapped: torch.nn.Module
    optim: Optimization
    sampler: Any
    state: dict | None
    n_params: int
    wall_before: float = 0.0  # seconds of training before this invocation (train_state's wall_s)
    skipped: int = 0
    streak: int = 0
    t_start: float = 0.0

    @classmethod
    def setup(cls, cfg: Config, folder: RunFolder, ckpt: Path | None, *, data, steps: int | None,
              init_from: str | Path | None, progress: bool) -> _Run:
        cfg, model, state, sharded, steps, source = _load(cfg, folder, ckpt, steps, init_from)
        tcfg = cfg.train
        check_loggers(tcfg.logger)  # on resume: the saved config's loggers
        if tcfg.num_threads:
            torch.set_num_threads(tcfg.num_threads)
        env = init_distributed(resolve_device(tcfg.device))
        rows = local_rows(tcfg.batch_size, env)
        data = data or prepare_data(cfg, progress=progress and env.is_main)
        if cfg.model.vocab_size != data.vocab_size:
            cfg = cfg.replace(model=cfg.model.replace(vocab_size=data.vocab_size))
        if source is not None:
            _check_init_vocab(source[2], source[1].model.vocab_size, data)
        if model is None:
            torch.manual_seed(tcfg.seed)
            model = build_model(cfg)
            if source is not None:
                model.load_state_dict(source[0].state_dict(), strict=True)  # same config: the same keys and shapes
        model.to(env.device)
        if tcfg.compile:
            compile_blocks(model)
        n_params = model.num_params()  # before FSDP2 turns parameters into shards
        wrapped = wrap_model(model, tcfg.distributed, env)
        optim = Optimization(wrapped, cfg.optim, tcfg.steps)
        if sharded is not None:
            model_sd, opt_sd = sharded_state(wrapped, optim.opt, saved=sharded_keys(sharded))
            loaded = {"model": model_sd, "optimizer": opt_sd}
            load_sharded(sharded, loaded, distributed=env.enabled)  # DCP reshards to this world size
            set_sharded_state(wrapped, optim.opt, loaded["model"], loaded["optimizer"])
        elif state is not None:
            load_optimizer_state(wrapped, optim.opt, state["optimizer"], tcfg.distributed, env)
        sampler = build_sampler(cfg.depth)
        if state is not None:
            if steps is None:
                optim.sched.load_state_dict(state["scheduler"])
            else:  # a new total: its schedule from the resumed step on (the groups' initial_lr came with the state)
                optim.sched = build_scheduler(optim.opt, cfg.optim, tcfg.steps, start=int(state["step"]))
            set_rng_state(state["rng"])
            sampler.load_state_dict(state["depth_prior"])
        guard = (state or {}).get("nonfinite", {})
        return cls(cfg, folder, env, rows, data, model, wrapped, optim, sampler, state, n_params,
                   wall_before=float((state or {}).get("wall_s", 0.0)), skipped=int(guard.get("skipped_steps", 0)),
                   streak=int(guard.get("streak", 0)))

    def checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` (consolidated on rank 0, or sharded); never from non-finite weights."""
        cfg, env, out, wrapped = self.cfg, self.env, self.folder.path, self.wrapped
        plain = unwrap(wrapped)
        bad = nonfinite_tensors([*plain.named_parameters(), *plain.named_buffers()])
        if mean_across_ranks(float(len(bad)), env) > 0:  # every rank agrees, so all raise together
            raise NonFiniteError(f"step {step}: refusing to write a checkpoint: non-finite weights"
                                 f"{' in ' + ', '.join(bad[:5]) if bad else ' on another rank'}; the newest "
                                 f"checkpoint under {out / 'checkpoints'} is left as it was")
        train_state = run_state(step, cfg.train.seed, scheduler=self.optim.sched.state_dict(),
                                world_size=env.world_size, depth_prior=self.sampler.state_dict(),
                                nonfinite={"skipped_steps": self.skipped, "streak": self.streak},
                                wall_s=self.wall_before + time.time() - self.t_start)
        if cfg.train.checkpoint_format == "sharded":
            model_sd, opt_sd = sharded_state(wrapped, self.optim.opt)
            save_sharded_checkpoint(out, step, {"model": model_sd, "optimizer": opt_sd}, cfg, env,
                                    train_state=train_state, tokenizer_json=self.data.tokenizer_json)
            return
        model_sd, opt_sd = full_state(wrapped, self.optim.opt, cfg.train.distributed, env)
        if env.is_main:
            if env.enabled and cfg.train.distributed == "fsdp":
                plain = build_model(cfg)
                plain.load_state_dict(model_sd, strict=True)
            save_checkpoint(out, step, plain, cfg, train_state={**train_state, "optimizer": opt_sd},
                            tokenizer_json=self.data.tokenizer_json)
        barrier(self.env)

    def step(self, step: int) -> tuple[dict[str, Any], int]:
        """One optimizer step (``grad_accum`` microbatches): its metrics record and its tokens."""
        cfg, tcfg, env, wrapped = self.cfg, self.cfg.train, self.env, self.wrapped
        t0, L, B, device = time.time(), cfg.model.seq_len, tcfg.batch_size, env.device
        loss_sum, depths, extras, observed = 0.0, [], {}, []
        for micro in range(tcfg.grad_accum):
            # every rank draws the same depth: a pure function of (seed, step, micro)
            T = (cfg.model.n_layers if cfg.model.architecture == "unshared"
                 else self.sampler.sample(tcfg.seed, step, micro))
            depths.append(T)
            x, y = self.data.batch(B, L, seed=tcfg.seed, step=step, micro=micro)  # global batch
            x, y = x[self.rows], y[self.rows]
            if device.type == "cuda":  # page-locked host memory makes the copy asynchronous
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            ddp = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            # one block: no_sync() is a generator context manager, which can be entered once
            with wrapped.no_sync() if ddp and micro < tcfg.grad_accum - 1 else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=tcfg.dtype == "bfloat16"):
                    res = training_loss(wrapped, x, y, T, tcfg)
                (res.loss / tcfg.grad_accum).backward()
            loss_sum += res.ce
            observed.append((T, res.ce, res.n_tokens))  # fed to the depth prior only if the step is kept
            for key, value in {"objective": float(res.loss.detach()), **res.extras}.items():
                extras[key] = extras.get(key, 0.0) + value / tcfg.grad_accum
        loss = mean_across_ranks(loss_sum / tcfg.grad_accum, env)  # the same on every rank, as is grad_norm
        grad_norm, lr, keep = self.optim.step(loss)  # a non-finite step is skipped; the batch is not retried
        prior: dict[str, float] = {}
        if keep:
            for obs in observed:
                self.sampler.observe(*obs)
            prior = self.sampler.update(reduce=(lambda t: all_reduce_sum(t, env)) if env.enabled else None)
            self.streak = 0
        else:
            self.skipped, self.streak = self.skipped + 1, self.streak + 1
        n_tok = B * L * tcfg.grad_accum
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "depths": depths,
                "tokens_per_s": n_tok / (time.time() - t0), **extras, **{f"prior_{k}": v for k, v in prior.items()},
                "skipped_steps": self.skipped, **({} if keep else {"skipped": True})}, n_tok

    def fit(self, trackers: Trackers, *, resume: bool, stop_after: int | None, progress: bool) -> dict[str, Any]:
        """Write config.json and tokenizer.json, run the steps (:class:`Fit`), return the summary."""
        cfg, tcfg, env, out = self.cfg, self.cfg.train, self.env, self.folder.path
        start = int(self.state["step"]) if self.state is not None else 0
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / CONFIG_FILE).write_text(cfg.to_json())
            (out / TOKENIZER_FILE).write_text(self.data.tokenizer_json)
            # TensorBoard / W&B / trackio (train.logger): the same records as metrics.jsonl
            trackers.open(tcfg.logger, out, cfg.to_dict(), name=cfg.name, start_step=start, resume=resume)
        # FSDP forward is collective: every rank evaluates
        eval_model = self.wrapped if env.enabled and tcfg.distributed == "fsdp" else unwrap(self.wrapped)
        self.wrapped.train()
        self.t_start, tokens = time.time(), 0
        fit = Fit(self.folder, start=start, total=tcfg.steps, stop_after=stop_after, ckpt_every=tcfg.ckpt_every,
                  save=self.checkpoint, desc=cfg.name, eval_every=tcfg.eval_every, progress=progress and env.is_main,
                  write=env.is_main)
        with fit:
            for step in fit:
                last, n_tok = self.step(step)
                tokens += n_tok
                if fit.evaluating(last["step"]):
                    last.update(self.data.validate(eval_model, tcfg.eval_depth, batch_size=tcfg.batch_size,
                                                   batches=tcfg.eval_batches, device=env.device))
                fit.log(last, loss=f"{last['loss']:.3f}", T=last["depths"][0], tok_s=f"{last['tokens_per_s']:.0f}",
                        skipped=self.skipped, **({"val_ppl": f"{last['val_ppl']:.1f}"} if "val_ppl" in last else {}))
                if env.is_main:
                    trackers.log(last)
                if self.streak >= tcfg.max_nonfinite_steps:
                    self._diverged(last)
        wall = time.time() - self.t_start
        summary = fit.summary({"name": cfg.name, "steps": tcfg.steps, "completed_steps": fit.end,
                               "skipped_steps": self.skipped, "params": self.n_params, "world_size": env.world_size,
                               "wall_s": self.wall_before + wall,
                               "train_tokens_per_s": tokens / wall if wall > 0 else 0.0,
                               "val_loss": fit.last.get("val_loss"), "val_ppl": fit.last.get("val_ppl"),
                               "out": str(out)})
        trackers.close(summary)  # the summary as run metadata
        shutdown(env)
        return summary

    def _diverged(self, last: dict[str, Any]) -> None:
        """Raises DivergenceError after ``train.max_nonfinite_steps`` skipped steps in a row."""
        newest = newest_valid_checkpoint(self.folder.path) if self.env.is_main else None
        shutdown(self.env)
        done, streak = last["step"], self.streak
        raise DivergenceError(
            f"training diverged: {streak} consecutive steps ({done - streak + 1}..{done}) had a non-finite "
            f"loss or gradient norm (last: loss {last['loss']}, grad norm {last['grad_norm']}); each was skipped, and "
            f"train.max_nonfinite_steps={self.cfg.train.max_nonfinite_steps} stops the run. Newest checkpoint (finite "
            f"weights): {newest or 'none'}. Lower optim.lr, raise optim.warmup_steps or set optim.grad_clip")
