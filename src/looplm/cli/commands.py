"""Glue of the commands whose work is more than one library call (registered in :mod:`looplm.cli`).

A function here is driven like a library function: its typed keyword parameters are its command's
options. Glue ``run(func, options, ...)`` wraps the driven library function ``func`` (``options``: its
parsed options); the rest are commands of their own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from looplm.cli.core import (
    CliError,
    OutDir,
    OutFile,
    Report,
    UsageError,
    prepare_out_dir,
)

CacheMode = Literal["per_visit", "terminal"]


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
        overwrite: replace the metrics of a run in --out that wrote no checkpoint (it diverged or stopped before
            its first)
        stop_after: stop with a checkpoint after N steps of this invocation (continue with --resume)
    """
    import os

    from looplm.run.checkpoint import list_checkpoints
    from looplm.train.trainer import train as run_train

    assert out is not None
    if not resume and list_checkpoints(out):
        raise ValueError(f"--out {out} already holds a run; continue it with --resume or choose another --out")
    created = not any(out.iterdir())
    steps = cfg.train.steps if resume and "train.steps" in overrides else None  # train a finished run on to it
    try:
        summary = run_train(cfg, out, resume=resume, progress=progress, stop_after=stop_after,
                            steps=steps, init_from=init_from, overwrite=overwrite)
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # nothing was written: leave no empty folder behind
        raise
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2))
    return 0


def info(cfg: Any, *, depths: Sequence[int] = (8, 48), list: bool = False) -> int:
    """Print the parameter count and FLOP proxy of ``cfg`` as JSON.

    Args:
        depths: comma-separated loop depths of the FLOP proxy
        list: list the presets and their model configs
    """
    import torch

    from looplm.analysis.flops import flops_per_token
    from looplm.model import build_model
    from looplm.presets import PRESETS

    if list:
        print(json.dumps({name: c.to_dict()["model"] for name, c in PRESETS.items()}, indent=2))
        return 0
    with torch.device("meta"):
        model = build_model(cfg)
    print(json.dumps({"name": cfg.name, "params": model.num_params(), "params_millions":
                      round(model.num_params() / 1e6, 2), "flops_per_token": {str(T): flops_per_token(cfg.model, T)
                                                                              for T in depths},
                      "config": cfg.to_dict()}, indent=2))
    return 0


def convert_train_state(checkpoint: Path, *, trust_pickle: bool = False) -> Path:
    """Rewrite a trusted checkpoint's pickled train_state.pt as data.

    Args:
        trust_pickle: required: you vouch that the file comes from a source you trust
    """
    from looplm.run.checkpoint import convert_train_state as convert

    if not trust_pickle:
        raise CliError("convert-train-state unpickles the file, which can run any code it holds: pass "
                       "--trust-pickle only for a run folder you trust")
    return convert(checkpoint)


def eval_halting(func: Callable[..., dict], options: dict[str, Any], checkpoint: Path, report: Report, *,
                 max_examples: int | None = None) -> int:
    """halting.json, .md and the frontier plot go into the folder of --out (default results/halting).

    Args:
        max_examples: shorthand for --n-calib N --n-timed N
    """
    folder = report.out.parent if report.out else Path("results") / "halting"
    prepare_out_dir(folder, "--out", shown=report.out)
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
    """The Markdown and plots go to --plots-dir (default: next to --out, named after it).

    Args:
        plots_dir: folder for the Markdown and plots (default: next to --out; none without --out)
    """
    folder = plots_dir or (report.out.parent if report.out else None)
    result = func(checkpoint, out_dir=folder, stem=report.out.stem if report.out else "diagnose", **options)
    return report.emit(result, result.get("files", {}).values())


def sweep(file: Path, *, out: OutDir | None = None, plan: bool = False, shard: str | None = None,
          only: str | None = None, progress: bool = True) -> int:
    """Run (or plan) the sweep in ``file``.

    Args:
        file: sweep file (format below)
        out: output folder (default results/<sweep name>): runs/, results.db, report/
        plan: run nothing: print one `looplm sweep FILE --out OUT --only RUN_ID` command per pending run (not
            trained, or an evaluation missing from the results DB)
        shard: I/N: run (or with --plan, list) only the runs whose index in the run order is I mod N (0 <= I < N);
            shards 0/N … N-1/N can run at the same time into one --out and results DB; no report is written (run
            `looplm report --db OUT/results.db` at the end)
        only: RUN_ID[,RUN_ID...]: run only these runs (run ids as in --plan); no report is written
    """
    from looplm.sweep import (
        load_sweep,
        parse_shard,
        plan_commands,
        plan_sweep,
        run_sweep,
    )

    spec = load_sweep(file)
    out = out if out is not None else Path("results") / spec.name
    shards = parse_shard(shard) if shard is not None else None
    runs = [r for r in only.split(",") if r] if only is not None else None
    if plan:
        if runs is not None:
            raise ValueError("--only and --plan do not go together (--plan lists the pending runs)")
        pending = plan_sweep(spec, out, shard=shards)
        for line in plan_commands(file, out, pending):
            print(line)
        print(f"# {len(pending)} pending of {len(spec.runs())} runs; afterwards: looplm report --db "
              f"{out / 'results.db'}", file=sys.stderr)
        return 0
    prepare_out_dir(out, "--out")
    partial = runs is not None or shards is not None
    result = run_sweep(spec, out, progress=progress, only=runs, shard=shards, report=not partial)
    print(json.dumps(result.summary(), indent=2))
    if partial:
        print(f"part of the sweep: no report written; when every part is done: looplm report --db {result.db}",
              file=sys.stderr)
    return 0


def report(func: Callable[..., dict], options: dict[str, Any], *, db: Path, out: OutDir | None = None) -> int:
    """Write the report of results database ``db``.

    Args:
        db: results database (e.g. results/NAME/results.db)
        out: output folder (default: report/ next to the database)
    """
    if not db.is_file():
        raise FileNotFoundError(f"--db {db}: the results database does not exist")
    out = out if out is not None else prepare_out_dir(db.parent / "report", "--out")
    res = func(db, out, **options)
    print(res["markdown"].read_text())
    print(f"wrote {res['markdown']}, {res['json']}" + "".join(f", {p}" for p in res["plots"]))
    return 0


def _need(module: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(f"needs the {module} package: pip install 'looplm[{extra}]'") from None


def export(checkpoint: Path, *, out: OutDir, num_steps: int | None = None, kv_cache: CacheMode = "per_visit",
           device: str = "cpu", overwrite: bool = False) -> int:
    """Export (options as :func:`looplm.hf.export.export_checkpoint`'s, which imports transformers).

    Args:
        out: the Hugging Face folder to write
        num_steps: default recurrence depth of the exported model (default: the checkpoint's train.eval_depth)
        kv_cache: KV cache layout generate() uses by default
        overwrite: write into a non-empty --out (files of the same names are replaced, old weight files removed)
    """
    _need("transformers", "hf")
    from looplm.hf.export import export_checkpoint

    written = export_checkpoint(checkpoint, out, num_steps=num_steps, kv_cache=kv_cache, device=device,
                                overwrite=overwrite)
    print(f"wrote {written} (load with transformers.AutoModelForCausalLM.from_pretrained; "
          "trust_remote_code=True works without importing looplm)")
    return 0


def lm_eval(checkpoint: Path, *, tasks: Sequence[str], depths: Sequence[int] | None = None,
            include_path: Path | None = None, only_include_path: bool = False, bootstrap_iters: int = 1000,
            num_fewshot: int | None = None, limit: float | None = None, batch_size: int = 16,
            kv_cache: CacheMode | None = None, seed: int = 0, device: str = "cpu", db: OutFile | None = None,
            tag: str = "") -> dict[str, Any]:
    """Harness tasks at every depth (options as :func:`looplm.hf.harness.evaluate_harness`'s, which imports lm-eval).

    Args:
        tasks: comma-separated harness task names; looplm_lambada and looplm_wikitext run offline over the data
            folder (lambada/lambada_test.jsonl, wikitext-2-raw/wiki.test.raw)
        depths: comma-separated loop depths (default: train.eval_depth)
        include_path: a folder of extra task YAMLs
        only_include_path: look tasks up in --include-path only (skips indexing the harness's own tasks: faster)
        bootstrap_iters: bootstrap resamples for the standard errors of non-mean metrics (0: none)
        num_fewshot: few-shot examples (default: the task's)
        limit: documents per task, or a fraction of each task if < 1 (default: all)
        kv_cache: generate_until: KV cache layout (default: an export's config.json kv_cache, else per_visit)
        seed: seed of the harness's samplers
        db: a looplm results database to add the results to
        tag: free label of the stored evaluations
    """
    _need("lm_eval", "lmeval")
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


def import_model(func: Callable[..., dict], options: dict[str, Any]) -> int:
    """Import, print the summary and what to run next."""
    from looplm.importers.common import check_out

    check_out(options["out"])
    print(json.dumps(func(**options), indent=2))
    print(f"next: looplm eval ppl --checkpoint {options['out']}  (or diagnose, eval kv-sharing, eval halting, "
          "generate)", file=sys.stderr)
    return 0


def rl_train(cfg: Any, *, checkpoint: Path | None = None, out: OutDir, device: str = "cpu", resume: bool = False,
             stop_after: int | None = None, progress: bool = True) -> int:
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
    print(json.dumps(run(checkpoint, out, cfg, resume=resume, stop_after=stop_after, progress=progress,
                         device=device), indent=2))
    return 0


def distill(cfg: Any, *, checkpoint: Path, out: OutDir | None = None, resume: bool = False,
            stop_after: int | None = None, progress: bool = True) -> int:
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
    print(json.dumps(run(checkpoint, out, cfg, resume=resume, stop_after=stop_after, progress=progress), indent=2))
    return 0
