"""The ``looplm rl`` commands (registered by :mod:`looplm.cli`): ``pretrain``, ``train`` and ``eval``.

Only argument parsing lives here; the work is :func:`looplm.rl.runner.pretrain_task`,
:func:`looplm.rl.runner.rl_train` (options generated from :func:`looplm.rl.runner.rl_options`) and
:func:`looplm.rl.runner.rl_eval_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RL_HELP = {
    "pretrain": "pretrain a small looped model on a verifiable task (looplm's trainer on the task's stream)",
    "train": "Dr. GRPO post-training with full BPTT, recompute + Neumann-b or rollout-state reuse + Neumann-b",
    "eval": "pass@1 / pass@k and greedy accuracy on the task's held-out problems",
}


def register(sub) -> None:
    """Add ``looplm rl`` (with ``pretrain``, ``train``, ``eval``) to the ``looplm`` subparsers ``sub``."""
    from looplm.cliutil import add_command

    add_command(sub, "rl", _build_rl, help="RL post-training with rollout-state reuse (LMDR §3.1, §5.4): "
                + ", ".join(RL_HELP) + " (one subcommand each)",
                description="RL post-training of looped models on a verifiable synthetic task (multi-digit "
                "addition), LMDR §3.1 'Post-training' and §5.4 / Table 4: `looplm rl pretrain` trains the base "
                "model, `looplm rl train` runs Dr. GRPO with one of three update methods, `looplm rl eval` "
                "measures pass@k. `looplm rl COMMAND --help` for each.")


def _build_rl(p: argparse.ArgumentParser) -> None:
    from looplm.cliutil import add_command, lazy_subparsers

    cmds = lazy_subparsers(p, dest="rl_command", required=True, metavar="COMMAND")
    add_command(cmds, "pretrain", _build_pretrain, help=RL_HELP["pretrain"],
                description="Train a small looped model (default: huginn_linear 1 + 2xR + 1, d = 64, PLN-5 depths, "
                "TBPTT-4; `--print_config` shows it) on the task's token stream with looplm's trainer: "
                "checkpoints, metrics.jsonl and summary.json in --out, plus task.json (the task it learned, read "
                "by `looplm rl train` and `looplm rl eval`). The held-out problems never occur in the stream. "
                "--resume continues exactly; any config field is overridable as --SECTION.FIELD VALUE.")
    add_command(cmds, "train", _build_train, help=RL_HELP["train"],
                description="Dr. GRPO (group-relative advantages without std normalization, no per-response "
                "length normalization, one policy update per batch) from --checkpoint on its task: every update "
                "samples --group-size responses for each of --prompts-per-update training problems at depth "
                "--depth with the KV cache, saving each position's depth-R state, rewards them with --reward "
                "and updates with --method: bptt (re-score through all R recurrences with gradient), recompute "
                "(R recurrences without gradient, then --neumann-steps b with) or reuse (b recurrences from the "
                "saved rollout states, no replay). Reports per update the scoring + backward time, reward and, "
                "every --compare-every updates, all three methods' times and gradient cosines on the same "
                "batch; pass@1 / pass@k on the held-out problems before and after. Writes metrics.jsonl, "
                "results.json and rl.png into --out, with atomic checkpoints (--resume continues exactly).")
    add_command(cmds, "eval", _build_eval, help=RL_HELP["eval"],
                description="Sample --samples responses per held-out problem at depth --depth and report "
                "pass@1, pass@n (unbiased estimator) and greedy accuracy; prints the line (--json: the JSON), "
                "--out also writes it.")


def _build_pretrain(p: argparse.ArgumentParser) -> None:
    from looplm.cli import in_file, out_dir, positive_int
    from looplm.cliutil import Opt, add_function_options, config_help
    from looplm.rl.runner import pretrain_task

    p.add_argument("--out", type=out_dir, help="run directory (required unless --print_config)")
    p.add_argument("--config", type=in_file, metavar="FILE.json",
                   help="a config file (JSON) to start from instead of the built-in one")
    p.add_argument("--print_config", "--print-config", action="store_true",
                   help="print the resolved config as JSON and exit")
    add_function_options(p, pretrain_task, {
        "task": Opt(choices=("addition",), help="the task"),
        "digits": Opt(type=positive_int, metavar="D"),
        "train_records": Opt(type=positive_int, metavar="N"),
    })
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop with a checkpoint after N steps of this invocation (continue with --resume)")
    p.add_argument("--overwrite", action="store_true", help="replace the metrics of a run in --out that wrote no "
                   "checkpoint (it diverged or stopped before its first)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pretrain, _takes_config=True)
    p.config_help = lambda: config_help("the built-in config (`--print_config` shows it) or --config")


def cmd_pretrain(args: argparse.Namespace) -> int:
    from looplm.cliutil import call_with_options, prepare_out_dir
    from looplm.config import Config, apply_overrides
    from looplm.rl.runner import PRETRAIN_CONFIG, pretrain_task

    cfg = Config.from_json(args.config.read_text()) if args.config else PRETRAIN_CONFIG
    cfg = apply_overrides(cfg, dict(getattr(args, "config_overrides", {})))
    if args.print_config:
        print(cfg.to_json())
        return 0
    if args.out is None:
        args._parser.error("the following arguments are required: --out")
    prepare_out_dir(args.out, "--out")
    if args.resume and (args.config_overrides or args.config):
        print(f"looplm rl pretrain: warning: --resume continues with the config saved in {args.out}", file=sys.stderr)
    summary = call_with_options(pretrain_task, args, args.out, cfg, resume=args.resume, stop_after=args.stop_after,
                                progress=not args.quiet, overwrite=args.overwrite)
    print(json.dumps(summary, indent=2))
    return 0


def _build_train(p: argparse.ArgumentParser) -> None:
    from looplm.cli import out_dir, positive_int
    from looplm.cliutil import Opt, add_function_options
    from looplm.rl.grpo import UPDATE_METHODS
    from looplm.rl.rewards import REWARDS
    from looplm.rl.runner import rl_options

    p.add_argument("--checkpoint", type=Path, help="the starting checkpoint or run (e.g. a `looplm rl pretrain` run); "
                   "not needed with --resume")
    p.add_argument("--out", type=out_dir, required=True, help="the RL run directory")
    nonneg = Opt(type=int, metavar="N")
    add_function_options(p, rl_options, {
        "method": Opt(choices=UPDATE_METHODS),
        "depth": Opt(type=positive_int, metavar="R"),
        "neumann_steps": Opt(type=positive_int, metavar="B"),
        "group_size": Opt(type=positive_int, metavar="G"),
        "prompts_per_update": Opt(type=positive_int, metavar="P"),
        "updates": Opt(type=positive_int, metavar="N"),
        "train_problems": nonneg,
        "optimizer": Opt(choices=("adamw", "sgd")),
        "lr": Opt(type=float),
        "warmup": nonneg,
        "temperature": Opt(type=float),
        "reward": Opt(choices=tuple(REWARDS)),
        "seed": Opt(type=int),
        "task": Opt(choices=("addition",)),
        "digits": Opt(type=positive_int, metavar="D",
                      help="the task's operand width D (default: the starting checkpoint's task.json)"),
        "eval_problems": Opt(type=positive_int, metavar="N"),
        "eval_samples": Opt(type=positive_int, metavar="N"),
        "eval_seed": Opt(type=int),
        "compare_every": nonneg,
        "ckpt_every": nonneg,
        "grad_clip": Opt(type=float),
    })
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out, with "
                   "the options saved there")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop with a checkpoint after N updates of this invocation (continue with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from looplm.cliutil import call_with_options, prepare_out_dir
    from looplm.rl.runner import rl_train

    if args.checkpoint is None and not args.resume:
        args._parser.error("the following arguments are required: --checkpoint (unless --resume)")
    prepare_out_dir(args.out, "--out")
    if args.resume:
        print(f"looplm rl train: --resume continues with the options saved in {args.out}", file=sys.stderr)
    res = call_with_options(rl_train, args, args.checkpoint, args.out, resume=args.resume, stop_after=args.stop_after,
                            progress=not args.quiet, device=args.device)
    print(json.dumps(res, indent=2))
    return 0


def _build_eval(p: argparse.ArgumentParser) -> None:
    from looplm.cli import out_file, positive_int
    from looplm.cliutil import Opt, add_function_options
    from looplm.rl.rewards import REWARDS
    from looplm.rl.runner import rl_eval_checkpoint

    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    add_function_options(p, rl_eval_checkpoint, {
        "depth": Opt(type=positive_int, metavar="R"),
        "samples": Opt(type=positive_int, metavar="N"),
        "temperature": Opt(type=float),
        "problems": Opt(type=positive_int, metavar="N"),
        "task": Opt(choices=("addition",)),
        "digits": Opt(type=positive_int, metavar="D",
                      help="the task's operand width D (default: the checkpoint's task.json)"),
        "seed": Opt(type=int),
        "reward": Opt(choices=tuple(REWARDS)),
        "device": Opt(),
    })
    p.add_argument("--out", type=out_file, metavar="FILE.json", help="also write the JSON here")
    p.add_argument("--json", action="store_true", help="print the JSON (default: one line)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from looplm.cliutil import call_with_options, prepare_out_file
    from looplm.rl.runner import rl_eval_checkpoint

    if args.out is not None:
        prepare_out_file(args.out, "--out")
    res = call_with_options(rl_eval_checkpoint, args, args.checkpoint, progress=not args.quiet)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2) if args.json else res["markdown"])
    return 0
