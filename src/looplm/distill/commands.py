"""The ``looplm distill`` subcommand (registered by :mod:`looplm.cli`): train a distilled-prefill student
for a teacher checkpoint (LMDR §3.2, §5.5). Its options are the fields of
:class:`looplm.distill.config.DistillConfig` (name, default, help), plus the run's folder and resume.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_distill(args: argparse.Namespace) -> int:
    from looplm.cliutil import call_with_options, prepare_out_dir
    from looplm.distill.config import DistillConfig
    from looplm.distill.student import default_student_dir
    from looplm.distill.train import distill

    out = args.out or default_student_dir(args.checkpoint)
    prepare_out_dir(out, "--out")
    cfg = call_with_options(DistillConfig, args)
    summary = distill(args.checkpoint, out, cfg, resume=args.resume, stop_after=args.stop_after,
                      progress=not args.quiet)
    print(json.dumps(summary, indent=2))
    return 0


def _build(p: argparse.ArgumentParser) -> None:
    from looplm.cli import out_dir, positive_int
    from looplm.cliutil import Opt, add_function_options
    from looplm.distill.config import DistillConfig

    p.add_argument("--checkpoint", type=Path, required=True, help="the teacher: run directory or checkpoint")
    p.add_argument("--out", type=out_dir, default=None,
                   help="the student's run directory (default: student/ next to the teacher's run)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid student checkpoint in --out (its saved config wins)")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop with a checkpoint after N steps of this invocation (continue with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    helps = DistillConfig.fields_help()
    choices = {"init": ("teacher", "random"), "schedule": ("cosine", "wsd"), "device": ("cpu", "cuda", "auto")}
    add_function_options(p, DistillConfig, {name: Opt(help=text, choices=choices.get(name))
                                            for name, text in helps.items()}, group="distillation")
    p.set_defaults(func=cmd_distill)


def register(sub) -> None:
    """Add ``distill`` to the ``looplm`` subparsers object ``sub`` (options built on first use)."""
    from looplm.cliutil import add_command

    add_command(
        sub, "distill", _build,
        help="train a distilled-prefill student for a looped teacher (LMDR eq. 4)",
        description="Distilled prefill (Looped Models Done Right §3.2, §5.5): train a student S_psi (default "
        "2 blocks initialized from the teacher's core) that maps the teacher's prelude output e to its "
        "endpoint z^R, with the loss of eq. 4: ||z_hat - z^R||_F^2 / (N d sigma_T^2) + token-mean "
        "KL(p_t || p_hat_t), each term weighted (0 = off). The teacher is frozen; data are windows of its "
        "training corpus; the default budget is a quarter of its training tokens. Checkpoints (atomic, "
        "resumable) go to --out, by default student/ next to the teacher's run; they record the teacher's "
        "weights fingerprint, and loading the student with another teacher is an error. Then: "
        "`looplm generate --prefill distilled`, `looplm eval distill`.")
