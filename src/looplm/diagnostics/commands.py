"""The ``looplm diagnose`` subcommand (mechanism diagnostics, SPEC §6–7); registered by ``looplm.cli``."""

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


def cmd_diagnose(args: argparse.Namespace) -> int:
    from looplm.diagnostics.runner import diagnose_checkpoint

    plots_dir = args.plots_dir or (args.out.parent if args.out else None)
    stem = args.out.stem if args.out else "diagnose"
    result = diagnose_checkpoint(args.checkpoint, steps=args.steps, depth=args.depth, dataset=args.dataset,
                                 split=args.split, batches=args.batches, batch_size=args.batch_size,
                                 out_dir=plots_dir, device=args.device, progress=not args.quiet, stem=stem,
                                 scale_loops=args.scale_loops, convergence_tau=args.convergence_tau)
    print(result["markdown"])
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}" + "".join(f", {p}" for p in result.get("files", {}).values()))
    else:
        print(text)
    return 0


def register(sub) -> None:
    """Add the ``diagnose`` subparser to the ``looplm`` subparsers object ``sub``."""
    from looplm.cli import out_file  # the CLI module imports this one at call time, not at import
    p = sub.add_parser(
        "diagnose", help="mechanism diagnostics of a checkpoint: forcing bias, gain, anchor-start rollouts, "
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
        "unroll. Prints Markdown tables (SCSE Tables 3 and 22 layout, then scale, alignment and "
        "convergence), writes the JSON to --out and the Markdown and three plots (R_t bars, Figure 5 "
        "style; 2-D PCA of rollouts, Figure 4 style; per-loop RMS and the convergence curve) to "
        "--plots-dir.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--out", type=out_file, help="write the JSON here (FILE.json); Markdown and plots go next "
                   "to it as FILE.md, FILE_forcing_ratio.png, FILE_rollouts.png, FILE_scale.png")
    p.add_argument("--steps", type=parse_steps, default=None,
                   help="loop steps t for forcing bias and gain (default 0,DEPTH-1, i.e. 0,47)")
    p.add_argument("--depth", type=int, default=48,
                   help="unroll / rollout depth T, also the token-convergence horizon R_obs (default 48)")
    p.add_argument("--scale-loops", type=int, default=None, metavar="K",
                   help="loop count K of the scale diagnostic and depth R of the visit alignment "
                   "(default: the checkpoint's training depth, the sampler's maximum)")
    p.add_argument("--convergence-tau", type=float, default=0.02, metavar="TAU",
                   help="token-convergence threshold tau on the relative change rho (default 0.02)")
    p.add_argument("--dataset", default=None, help="corpus (default: the checkpoint's training corpus)")
    p.add_argument("--split", default="valid", choices=["train", "valid", "test"], help="split (default valid)")
    p.add_argument("--batches", type=int, default=4, help="measured batches (default 4)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per batch (default 8)")
    p.add_argument("--plots-dir", type=Path, default=None,
                   help="folder for the Markdown and plots (default: next to --out; none without --out)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_diagnose)
