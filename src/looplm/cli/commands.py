"""Glue of the commands whose work is more than one library call (:mod:`looplm.cli`); glue ``run(func, options,
...)`` wraps the driven function ``func`` (``options``: its parsed options)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from looplm.cli.core import OutDir, OutFile, Report, UsageError, prepare_out_dir


def train(cfg: Any, overrides: dict[str, str], *, out: OutDir | None = None, name: str | None = None,
          resume: bool = False, init_from: Path | None = None, overwrite: bool = False,
          stop_after: int | None = None, progress: bool = True) -> int:
    """Train ``cfg`` into ``out``.

    Args:
        out: run directory (required unless --print_config)
        name: run name (default: the preset's)
        resume: continue from the newest valid checkpoint in --out (with --train.steps N: train a finished run on
            to N; the LR schedule follows the new total)
        init_from: start from these weights (run, checkpoint or HF export folder; its model config is used);
            fresh optimizer and schedule
        overwrite: replace the files a run writes (config.json, tokenizer.json, summary.json, metrics.jsonl) in an
            --out that holds no checkpoint (a run that wrote none, or a folder of yours)
        stop_after: stop with a checkpoint after N steps of this invocation (continue with --resume)
    """
    import os

    from looplm.train.trainer import train as run_train

    assert out is not None
    created = not any(out.iterdir())
    steps = cfg.train.steps if resume and "train.steps" in overrides else None  # train a finished run on to it
    try:
        data = None  # the trainer sets model.vocab_size from the tokenizer: a fresh run's override must agree
        if "model.vocab_size" in overrides and not resume and init_from is None:
            data = _vocab_checked_data(cfg, progress)
        summary = run_train(cfg, out, resume=resume, progress=progress, stop_after=stop_after,
                            steps=steps, init_from=init_from, overwrite=overwrite, data=data)
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # nothing was written: leave no empty folder behind
        raise
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2))
    return 0


def _vocab_checked_data(cfg: Any, progress: bool) -> Any:
    """The training data of ``cfg`` (:func:`looplm.train.trainer.prepare_data`). ConfigError: ``model.vocab_size``
    differs from the size of the tokenizer (which the trainer would use instead)."""
    import os

    from looplm.config import ConfigError
    from looplm.train.trainer import prepare_data

    data = prepare_data(cfg, progress=progress and os.environ.get("RANK", "0") == "0")
    given, d = cfg.model.vocab_size, cfg.data
    if given != data.vocab_size:
        source = (f"data.task={d.task}" if d.dataset == "task" else
                  "data.bpe_vocab_size" if d.tokenizer == "bpe" else f"data.tokenizer={d.tokenizer}")
        raise ConfigError(f"--model.vocab_size {given}: the tokenizer has {data.vocab_size} entries (set by {source}) "
                          "and training sets model.vocab_size from it; leave --model.vocab_size out"
                          + (" (to change it, set --data.bpe_vocab_size)" if source == "data.bpe_vocab_size" else ""))
    return data


def eval_halting(func: Callable[..., dict], options: dict[str, Any], checkpoint: Path, report: Report, *,
                 max_examples: int | None = None) -> int:
    """Its files go into the folder of --out (default results/halting).

    Args:
        max_examples: shorthand for --n-calib N --n-timed N
    """
    folder = prepare_out_dir(report.out.parent if report.out else Path("results/halting"), "--out", shown=report.out)
    if max_examples is not None:
        options.update(n_calib=max_examples, n_timed=max_examples)
    result = func(checkpoint, folder, **options)
    return report.emit(result, result.get("files", {}).values())


def eval_tasks(func: Callable[..., dict], options: dict[str, Any], checkpoint: Path, report: Report) -> int:
    """--out FILE.json also writes the heatmap FILE.png."""
    plot = report.out.with_suffix(".png") if report.out else None
    return report.emit(func(checkpoint, plot=plot, **options), [plot] if plot else [])


def diagnose(func: Callable[..., dict], options: dict[str, Any], checkpoint: Path, report: Report, *,
             plots_dir: OutDir | None = None) -> int:
    """The Markdown and plots go to --plots-dir.

    Args:
        plots_dir: folder for the Markdown and plots (default: next to --out; none without --out)
    """
    out = report.out
    result = func(checkpoint, out_dir=plots_dir or (out.parent if out else None), stem=out.stem if out else "diagnose",
                  **options)
    return report.emit(result, result.get("files", {}).values())


def report(func: Callable[..., dict], options: dict[str, Any], *, db: Path, out: OutDir | None = None) -> int:
    """Write the report of results database ``db``.

    Args:
        db: results database (e.g. results/NAME/results.db)
        out: output folder (default: report/ next to the database)
    """
    if not db.is_file():
        raise FileNotFoundError(f"--db {db}: the results database does not exist")
    res = func(db, out or prepare_out_dir(db.parent / "report", "--out"), **options)
    print(res["markdown"].read_text())
    print(f"wrote {res['markdown']}, {res['json']}" + "".join(f", {p}" for p in res["plots"]))
    return 0


def lm_eval(checkpoint: Path, *, tasks: Sequence[str], depths: Sequence[int] | None = None,
            include_path: Path | None = None, only_include_path: bool = False, bootstrap_iters: int = 1000,
            num_fewshot: int | None = None, limit: float | None = None, batch_size: int = 16,
            kv_cache: Literal["per_visit", "terminal"] | None = None, seed: int = 0, device: str = "cpu",
            db: OutFile | None = None, tag: str = "") -> dict[str, Any]:
    """Harness tasks at every depth (:func:`looplm.hf.harness.evaluate_harness`).

    Args:
        tasks: comma-separated harness task names (looplm_lambada, looplm_wikitext: offline, the data folder)
        depths: comma-separated loop depths (default: train.eval_depth)
        include_path: a folder of extra task YAMLs
        only_include_path: look tasks up in --include-path only (faster: skips indexing the harness's tasks)
        bootstrap_iters: bootstrap resamples for the standard errors of non-mean metrics (0: none)
        num_fewshot: few-shot examples (default: the task's)
        limit: documents per task, or a fraction of each task if < 1 (default: all)
        kv_cache: generate_until's KV cache layout (default: an export's config.json kv_cache, else per_visit)
        db: a looplm results database to add the results to
        tag: free label of the stored evaluations
    """
    from looplm.hf.harness import LOCAL_TASKS, evaluate_harness

    try:
        res = evaluate_harness(checkpoint, tasks=tasks, depths=depths, include_path=include_path,
                               num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, device=device, db=db,
                               tag=tag, kv_cache=kv_cache, seed=seed, include_defaults=not only_include_path,
                               bootstrap_iters=bootstrap_iters)
    except OSError as exc:  # datasets / requests / the hub each raise their own ConnectionError
        if not any(c.__name__ == "ConnectionError" for c in type(exc).__mro__):
            raise
        raise ValueError(f"--tasks {','.join(tasks)}: the harness could not download the task data "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); offline, "
                         f"use the tasks over the data folder: --tasks {','.join(LOCAL_TASKS)}") from None
    if db:
        print(f"stored {res['stored']} evaluations in {db}", file=sys.stderr)
    return json.loads(json.dumps(res, default=str))  # numpy → JSON


def rl_train(cfg: Any, *, checkpoint: Path | None = None, out: OutDir, device: str = "cpu", resume: bool = False,
             stop_after: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Dr. GRPO from ``checkpoint`` into ``out`` with the config ``cfg`` (``--rl.FIELD``, ``--optim.FIELD``).

    Args:
        checkpoint: the starting checkpoint or run (e.g. a `looplm rl pretrain` run); not needed with --resume
        out: the RL run directory
        resume: continue from the newest valid checkpoint in --out, with the config saved there
        stop_after: stop with a checkpoint after N updates of this invocation (continue with --resume)
    """
    from looplm.rl.runner import rl_train as run

    if checkpoint is None and not resume:
        raise UsageError("the following arguments are required: --checkpoint (unless --resume)")
    return run(checkpoint, out, cfg, resume=resume, stop_after=stop_after, progress=progress, device=device)


def distill(cfg: Any, *, checkpoint: Path, out: OutDir | None = None, resume: bool = False,
            stop_after: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Train a student for teacher ``checkpoint`` with the config ``cfg`` (``--distill.FIELD``, ``--optim.FIELD``).

    Args:
        checkpoint: the teacher: run directory or checkpoint
        out: the student's run directory (default: student/ next to the teacher's run)
        resume: continue from the newest valid student checkpoint in --out (its saved config wins)
        stop_after: stop with a checkpoint after N steps of this invocation (continue with --resume)
    """
    from looplm.distill.student import default_student_dir
    from looplm.distill.train import distill as run

    out = out or prepare_out_dir(default_student_dir(checkpoint), "--out")
    return run(checkpoint, out, cfg, resume=resume, stop_after=stop_after, progress=progress)
