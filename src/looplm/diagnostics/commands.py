"""The ``looplm diagnose`` subcommand (mechanism diagnostics, SPEC §6–7) and ``looplm gradcheck``
(gradient cosines of TBPTT-b and Neumann-b against full BPTT, LMDR §3.1); registered by ``looplm.cli``.

Their options are generated from :func:`looplm.diagnostics.runner.diagnose_checkpoint` and
:func:`looplm.diagnostics.gradients.gradcheck_checkpoint` (names, defaults and the docstring's ``Args:``
help).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_steps(text: str) -> list[int]:
    """``"0,47"`` → [0, 47]. Raises argparse.ArgumentTypeError on anything else."""
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--steps: expected comma-separated loop steps like 0,47; got {text!r}") from None
    if not steps or min(steps) < 0:
        raise argparse.ArgumentTypeError(f"--steps: need loop steps >= 0; got {text!r}")
    return steps


def parse_ints(text: str) -> list[int]:
    """``"1,2,4,8"`` → [1, 2, 4, 8] (each >= 1). Raises argparse.ArgumentTypeError on anything else."""
    try:
        vals = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 like 1,2,4,8; got {text!r}")
    return vals


def parse_estimators(text: str) -> list[str]:
    """``"tbptt,endpoint"`` → ["tbptt", "endpoint"]."""
    from looplm.diagnostics.gradients import ESTIMATORS

    vals = [s.strip() for s in text.split(",") if s.strip()]
    if not vals or any(v not in ESTIMATORS for v in vals):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(ESTIMATORS)}; got {text!r}")
    return vals


def cmd_gradcheck(args: argparse.Namespace) -> int:
    from looplm.cli import check_report_out, emit_report, write_report_files
    from looplm.cliutil import call_with_options
    from looplm.diagnostics.gradients import gradcheck_checkpoint

    check_report_out(args)
    result = call_with_options(gradcheck_checkpoint, args, args.checkpoint, progress=not args.quiet)
    emit_report(args, result, write_report_files(args.out, result))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from looplm.cli import emit_report
    from looplm.cliutil import call_with_options, prepare_out_dir, prepare_out_file

    plots_dir = args.plots_dir or (args.out.parent if args.out else None)
    if args.out is not None:
        prepare_out_file(args.out, "--out")
    if plots_dir is not None:
        prepare_out_dir(plots_dir, "--plots-dir" if args.plots_dir else "--out", shown=args.plots_dir or args.out)
    stem = args.out.stem if args.out else "diagnose"

    from looplm.diagnostics.runner import diagnose_checkpoint

    result = call_with_options(diagnose_checkpoint, args, args.checkpoint, out_dir=plots_dir,
                               progress=not args.quiet, stem=stem)
    written = []
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        written = [args.out, *map(Path, result.get("files", {}).values())]
    emit_report(args, result, written)
    return 0


def register(sub) -> None:
    """Add the ``diagnose`` and ``gradcheck`` commands to the ``looplm`` subparsers object ``sub`` (options
    built on first use)."""
    from looplm.cliutil import add_command

    add_command(
        sub, "gradcheck", _build_gradcheck,
        help="gradient cosines of TBPTT-b and endpoint (Neumann-b) gradients against full BPTT, per "
        "parameter group",
        description="Gradient estimators of a looped checkpoint (LMDR §3.1, A.2) on the first --batches "
        "windows of a split (dropout off): the terminal-CE gradient of full BPTT at depth R against "
        "TBPTT-b (the last b of the R recurrences) and endpoint / Neumann-b (R recurrences without "
        "gradient, then b with gradient from the detached endpoint; the loss read at R + b), for each b "
        "of --steps: cosine of the batch-summed gradients (and the per-batch min), per parameter group "
        "(embeddings/readout, prelude, core, rule, coda) and overall, with the norm ratio, the CEs and "
        "the endpoint residual. Prints the Markdown table (--json: the JSON); --out writes both.")

    add_command(
        sub, "diagnose", _build,
        help="mechanism diagnostics of a checkpoint: forcing bias, gain, anchor-start rollouts, "
        "hidden-state scale, visit alignment, token convergence",
        description="Mechanism diagnostics (SPEC §7) of a looped checkpoint, in the model's own anchor "
        "coordinates, averaged over the first --batches windows of a split (dropout off, float64): "
        "forcing bias b_t = T_t(0; e), raw pre-mask response, energy ratio R_t and anchor energy at "
        "--steps; random-direction gain (eps 1e-3, 4 seeded directions) at the same steps; "
        "anchor-start rollouts (delta_0 = 0) to --depth with their cosine to the forcing ray t*b_0(e); "
        "and the dose response to the rule's injection scaled by 0, 0.5, 1, 2; per-loop hidden-state "
        "scale (token RMS percentiles, radial-gradient fraction of the immediate readout loss, final "
        "radial derivative g_K, radial increment) over --scale-loops loops; the visit alignment "
        "kappa_R of the core's weight gradients at that depth; and token convergence along the --depth "
        "unroll. Prints the Markdown tables (SCSE Tables 3 and 22 layout, then scale, alignment and "
        "convergence; --json: the JSON), writes the JSON to --out and the Markdown and three plots (R_t "
        "bars, Figure 5 style; 2-D PCA of rollouts, Figure 4 style; per-loop RMS and the convergence "
        "curve) to --plots-dir.")


def _build_gradcheck(p: argparse.ArgumentParser) -> None:
    from looplm.cli import out_file, positive_int
    from looplm.cliutil import Opt, add_function_options
    from looplm.diagnostics.gradients import gradcheck_checkpoint

    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--out", type=out_file, metavar="FILE.json", help="write the JSON here and the Markdown to FILE.md")
    add_function_options(p, gradcheck_checkpoint, {
        "depth": Opt(type=positive_int, metavar="R",
                     help="depth R of full BPTT and the endpoint (default: the checkpoint's nominal training depth)"),
        "steps": Opt(type=parse_ints, metavar="B,B", help="the b to measure (default 1,2,4,8)"),
        "estimators": Opt(type=parse_estimators, metavar="NAME,NAME", help="tbptt and/or endpoint (default both)"),
        "dataset": Opt(help="corpus (default: the checkpoint's training corpus)"),
        "split": Opt(choices=("train", "valid", "test"), help="split"),
        "batches": Opt(type=positive_int, metavar="N", help="measured batches"),
        "batch_size": Opt(type=positive_int, metavar="N", help="windows per batch"),
        "dtype": Opt(choices=("float32", "float64")),
        "device": Opt(help="cpu, cuda or cuda:N"),
    })
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: the Markdown table)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_gradcheck)


def _build(p: argparse.ArgumentParser) -> None:
    from looplm.cli import out_file, positive_int  # the CLI module imports this one at call time
    from looplm.cliutil import Opt, add_function_options
    from looplm.diagnostics.runner import diagnose_checkpoint

    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--out", type=out_file, metavar="FILE.json",
                   help="write the JSON here; Markdown and plots go next to it as FILE.md, "
                   "FILE_forcing_ratio.png, FILE_rollouts.png, FILE_scale.png")
    add_function_options(p, diagnose_checkpoint, {
        "steps": Opt(type=parse_steps, default=None, metavar="T,T",
                     help="loop steps t for forcing bias and gain (default 0,DEPTH-1, i.e. 0,47)"),
        "depth": Opt(type=positive_int, metavar="T",
                     help="unroll / rollout depth T, also the token-convergence horizon R_obs"),
        "scale_loops": Opt(type=positive_int, metavar="K",
                           help="loop count K of the scale diagnostic and depth R of the visit alignment "
                           "(default: the checkpoint's nominal training depth)"),
        "convergence_tau": Opt(type=float, metavar="TAU"),
        "dataset": Opt(help="corpus (default: the checkpoint's training corpus)"),
        "split": Opt(choices=("train", "valid", "test"), help="split"),
        "batches": Opt(type=positive_int, metavar="N", help="measured batches"),
        "batch_size": Opt(type=positive_int, metavar="N", help="windows per batch"),
        "dtype": Opt(choices=("float64", "float32")),
        "seed": Opt(type=int, help="seed of the random gain directions and rollouts"),
        "device": Opt(help="cpu, cuda or cuda:N"),
    })
    p.add_argument("--plots-dir", type=Path, default=None,
                   help="folder for the Markdown and plots (default: next to --out; none without --out)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: the Markdown report)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_diagnose)
