"""Subcommands ``looplm sweep`` and ``looplm report`` (registered by :mod:`looplm.cli`).

Only argument parsing lives here; the work is done by :mod:`looplm.sweep` and
:mod:`looplm.analysis.report` (imported when the command runs, so ``--help`` stays fast).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SWEEP_EXAMPLE = """\
sweep file format (TOML):

  name = "scse-vs-looped"       # optional; default: the file name
  seeds = [0, 1, 2]             # training seeds; default [0, 1, 2]
  baseline = "looped"           # report baseline; default: the first variant

  [base]
  preset = "cpu"                # or config = "path/config.json"
  "train.steps" = 400           # any config field as "section.field" = value

  [variants]                    # name -> config overrides on top of the base
  looped = {"model.rule" = "looped"}
  scse = {"model.rule" = "scse"}
  unshared = {"model.architecture" = "unshared", "model.n_layers" = 4}

  [grid]                        # optional: each combination is a separate run
  "train.lr" = [1e-3, 2e-3]

  [eval]
  depths = [1, 2, 4, 8, 16, 32, 48]
  datasets = ["brown", "wikitext2"]   # default: the training corpus
  splits = ["test"]                   # default ["test"]
  max_tokens = 16384                  # default: the whole split
  tag = "v1"                          # default ""
  batch_size = 16                     # windows per forward; default 16
  stride = 64                         # optional sliding-window stride; default: non-overlapping
  device = "auto"                     # cpu, cuda or auto; default auto
  diagnose = true                     # optional: forcing bias + gain (shared models)
  lambada = {max_examples = 500}      # optional: LAMBADA completion (true or kwargs)

The grid is variants x seeds x grid fields. Each run trains into OUT/runs/<run-id>/
(<variant>[-<field>=<value>...]-s<seed>); evaluations go to OUT/results.db and a report
to OUT/report/. Re-running skips finished runs (training complete, evaluations stored)
and resumes killed ones from their newest valid checkpoint.

In parallel (several processes, or a scheduler's array jobs), into one results DB:
  looplm sweep FILE --out OUT --shard 0/4 & ... & looplm sweep FILE --out OUT --shard 3/4
  looplm sweep FILE --out OUT --plan      # one `looplm sweep FILE --out OUT --only RUN_ID` per pending run
  looplm report --db OUT/results.db       # when all are done
"""

REPORT_DESCRIPTION = """\
Aggregate a results database (written by `looplm sweep`) into report.md, report.json and
PNG plots in --out:

  - per dataset/split and metric: rows = variants, columns = loop depths T,
    cells "mean ± std" over seeds (sample std);
  - paired deltas variant - baseline matched by (seed, depth), cells
    "mean ± 95% t half-width [95% paired-bootstrap percentile interval]"
    (10,000 resamples, fixed seed: deterministic);
  - parameter count and FLOP proxy (SCSE eq. 20-21) per variant;
  - PPL vs loop depth on a log2 axis per dataset/split, seed means with ±std bands.
"""


def cmd_sweep(args: argparse.Namespace) -> int:
    import sys

    from looplm.cliutil import prepare_out_dir
    from looplm.sweep import load_sweep, parse_shard, plan_commands, plan_sweep, run_sweep

    sweep = load_sweep(args.file)
    out = args.out if args.out is not None else Path("results") / sweep.name
    shard = parse_shard(args.shard) if args.shard is not None else None
    only = [r for r in args.only.split(",") if r] if args.only is not None else None
    if args.plan:
        if only is not None:
            raise ValueError("--only and --plan do not go together (--plan lists the pending runs)")
        plan = plan_sweep(sweep, out, shard=shard)
        for cmd in plan_commands(args.file, out, plan):
            print(cmd)
        print(f"# {len(plan)} pending of {len(sweep.runs())} runs; afterwards: looplm report --db "
              f"{out / 'results.db'}", file=sys.stderr)
        return 0
    prepare_out_dir(out, "--out")
    partial = only is not None or shard is not None
    result = run_sweep(sweep, out, progress=not args.quiet, only=only, shard=shard, report=not partial)
    print(json.dumps(result.summary(), indent=2))
    if partial:
        print(f"part of the sweep: no report written; when every part is done: looplm report --db {result.db}",
              file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from looplm.analysis.report import write_report

    from looplm.cliutil import call_with_options, prepare_out_dir

    if not args.db.is_file():
        raise FileNotFoundError(f"--db {args.db}: the results database does not exist")
    out = args.out if args.out is not None else args.db.parent / "report"
    prepare_out_dir(out, "--out")
    res = call_with_options(write_report, args, args.db, out)
    print(res["markdown"].read_text())
    print(f"wrote {res['markdown']}, {res['json']}" + "".join(f", {p}" for p in res["plots"]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` and ``report`` commands to the ``looplm`` subparsers ``sub`` (options built on use)."""
    from looplm.cliutil import add_command

    add_command(sub, "sweep", _build_sweep,
                help="train and evaluate a grid of runs from a TOML sweep file (resumable)",
                description="Train and evaluate every run of a sweep file, one after another,\n"
                "with an overall progress bar; resumable.", epilog=SWEEP_EXAMPLE,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_command(sub, "report", _build_report,
                help="mean ± std tables, paired deltas and plots from a results database",
                description=REPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)


def _build_sweep(p: argparse.ArgumentParser) -> None:
    from looplm.cli import out_dir

    p.add_argument("file", type=Path, metavar="FILE.toml", help="sweep file (format below)")
    p.add_argument("--out", type=out_dir, default=None,
                   help="output folder (default results/<sweep name>): runs/, results.db, report/")
    p.add_argument("--quiet", action="store_true", help="no progress bars or per-run lines; print the summary")
    p.add_argument("--plan", action="store_true",
                   help="run nothing: print one `looplm sweep FILE --out OUT --only RUN_ID` command per pending "
                   "run (not trained, or an evaluation missing from the results DB)")
    p.add_argument("--shard", metavar="I/N", default=None,
                   help="run (or with --plan, list) only the runs whose index in the run order is I mod N "
                   "(0 <= I < N); shards 0/N … N-1/N can run at the same time into one --out and results DB; "
                   "no report is written (run `looplm report --db OUT/results.db` at the end)")
    p.add_argument("--only", metavar="RUN_ID[,RUN_ID...]", default=None,
                   help="run only these runs (run ids as in --plan); no report is written")
    p.set_defaults(func=cmd_sweep)


def _build_report(p: argparse.ArgumentParser) -> None:
    from looplm.analysis.report import write_report
    from looplm.cli import out_dir
    from looplm.cliutil import Opt, add_function_options

    p.add_argument("--db", type=Path, required=True, help="results database (e.g. results/NAME/results.db)")
    p.add_argument("--out", type=out_dir, default=None, help="output folder (default: report/ next to the database)")
    add_function_options(p, write_report, {
        "baseline": Opt(metavar="VARIANT", help="variant the paired deltas compare with (default: the sweep's "
                        "first variant)"),
        "sweep": Opt(metavar="NAME", help="only the runs of this sweep (a database can hold several)")})
    p.set_defaults(func=cmd_report)
