"""The ``looplm`` command line: one console script, one registry line per command.

Each :class:`Cmd` names the function it drives; :func:`looplm.cli.core.add_options` makes its options from
that function's typed signature. Config fields are never listed here: each ``--SECTION.FIELD[.SUB] VALUE``
goes as a string to :func:`looplm.config.apply_overrides`. Commands build on first use, so ``looplm --help``
imports neither torch nor the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from looplm.cli.core import (CliError, InFile, NewDir, Opt, OutFile, Report, UsageError, add_command,
                             add_config_fields, add_options, exit_criteria, in_file, lazy_subparsers, option_strings,
                             out_file, prepare_outputs, split_config_overrides, subcommands)
from looplm.cli.texts import DESCRIPTIONS, GROUPS
from looplm.config import Config, ConfigError, apply_overrides, suggest


@dataclasses.dataclass(frozen=True)
class Cmd:
    """A command: its words, the function it drives (``module:name``), its help. ``run``: glue ``run(func,
    options, ...)`` (its keyword parameters are options too); ``report``: ``--checkpoint`` first and
    ``--quiet/--json/--out``; ``checkpoint``: ``--checkpoint`` first (default: ``report``); ``config``:
    ``"preset"`` or ``module:name`` of the base config; ``opts``: flags that differ from their parameter;
    ``out``: the default --out; ``extra``: the ``pip install 'looplm[EXTRA]'`` it needs."""

    name: str
    func: str
    help: str
    run: str | None = None
    report: bool = False
    checkpoint: bool | None = None
    config: str | None = None
    opts: dict[str, Opt] = dataclasses.field(default_factory=dict)
    out: Path | None = None
    extra: str | None = None

    def build(self, p: argparse.ArgumentParser) -> None:
        """Add the command's options to its parser ``p`` (on first use: :func:`looplm.cli.core.add_command`)."""
        func, glue = _resolve(self.func), _resolve(self.run) if self.run else None
        params, own = inspect.signature(func).parameters, inspect.signature(glue).parameters if glue else {}
        first = next(iter(params)) if (self.report if self.checkpoint is None else self.checkpoint) else None
        if first:  # the driven function's first parameter
            p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint, run directory or export folder")
            p.set_defaults(_inputs=("checkpoint",))  # an input a NewDir output stays apart from
        add_options(p, func, self.opts, skip={*own, first})
        if glue:
            add_options(p, glue, self.opts, skip={"report", *(["checkpoint"] if first else [])}, key="_glue")
        if self.report:
            p.add_argument("--out", type=out_file, metavar="FILE.json", default=self.out, help="write the JSON here "
                           "and the Markdown next to it as FILE.md" + (f" (default {self.out})" if self.out else ""))
            p.add_argument("--json", action="store_true", help="print the result as JSON (default: the Markdown)")
        if "progress" in params or "progress" in own:
            p.add_argument("--quiet", action="store_true", help="no progress output")
        if self.config == "preset":
            p.add_argument("--preset", help="named config to start from (`looplm info --list`); default: cpu")
        if self.config:
            p.add_argument("--config", type=in_file, metavar="FILE.json", help="a config file (JSON, as in every "
                           "checkpoint) to start from instead of " + ("a preset" if self.config == "preset" else
                                                                      "the built-in one"))
            p.add_argument("--print_config", "--print-config", action="store_true",
                           help="print the resolved config (base, then overrides) as JSON and exit")
            section = None if self.config == "preset" else _resolve(self.config)
            add_config_fields(p, "--preset or --config" if self.config == "preset" else "the built-in config "
                              "(`--print_config` shows it) or --config",
                              (section if isinstance(section, type) else Config)().fields_help())  # distill, rl train
        p.set_defaults(_cmd=self, _parser=p, _first=first)


_C = "looplm.cli.commands:"
_OPTION_HINT = ("; did you mean {}?", 0.6)  # suggest()'s form and cutoff for an option
_TASK = Opt(type=str, choices=("addition",), help="the task")
_RL = {"task": _TASK, "reward": Opt(choices=lambda: tuple(importlib.import_module("looplm.rl.rewards").REWARDS)),
       "digits": Opt(help="the task's operand width D (default: the starting checkpoint's task.json)")}
_IMPORT = {"src": Opt(positional=True, metavar="SRC", help="the downloaded Hugging Face folder"),
           "out": Opt(metavar="DIR", help="run folder to write; must not hold a checkpoint")}
COMMANDS: tuple[Cmd, ...] = (
    Cmd("demo", "looplm.apps.demo:run_demo", "the main job: train looped and scse on Brown, compare PPL across depths",
        opts={"out": Opt(default=Path("results/demo"), help="results folder")}),
    Cmd("train", _C + "train", "train a model (any config field overridable as --SECTION.FIELD VALUE)",
        config="preset"),
    Cmd("eval ppl", "looplm.eval.runner:evaluate_checkpoint", "perplexity at every requested loop depth", report=True,
        opts={"stride": Opt(metavar="S", help="sliding-window stride (default: non-overlapping)"),
              "depths": Opt(help="comma-separated loop depths, e.g. 1,2,4,8; 0 reads out h_0 (no core step)")}),
    Cmd("eval kv-sharing", "looplm.eval.kvsharing:evaluate_kv_sharing_checkpoint",
        "terminal KV sharing: continuation PPL with a terminal KV cache vs the full forward", report=True,
        opts={"depths": Opt(default=[1, 2, 4, 8, 12, 16, 24, 32, 48], metavar="R,R,...")}),
    Cmd("eval lambada", "looplm.eval.lambada:evaluate_lambada_checkpoint",
        "LAMBADA target-token completion PPL and accuracies per depth", report=True),
    Cmd("eval adaptive", "looplm.eval.adaptive:adaptive_depth_checkpoint",
        "adaptive depth (hidden-update stopping rule) with a real early-exit run", report=True,
        opts={"targets": Opt(type=list[int], metavar="D,D,...", help="target mean loop budgets")}),
    Cmd("eval halting", "looplm.eval.halting:evaluate_halting_checkpoint", "logit-margin halting: calibrated "
        "threshold, timed dynamic batching, fixed-depth frontier", run=_C + "eval_halting", report=True),
    Cmd("eval distill", "looplm.distill.evaluate:evaluate_distill_checkpoint", "distilled prefill: continuation PPL "
        "after the teacher's, early-stopped and distilled prefills", report=True),
    Cmd("eval tasks", "looplm.eval.tasks:evaluate_task_checkpoint", "synthetic-task exact-match accuracy by loop "
        "depth x difficulty k (data.dataset=task checkpoints)", run=_C + "eval_tasks", report=True,
        opts={"split": Opt(type=str, choices=("valid", "test"), help="held-out split"), "ks": Opt(metavar="K,K,...")}),
    Cmd("generate", "looplm.eval.generate:generate_checkpoint", "continue text prompts with a checkpoint (KV cache, "
        "sampling, adaptive depth)", checkpoint=True, opts={"prompts_file": Opt(type=InFile), "out": Opt(type=OutFile),
        "exit": Opt(choices=lambda: ("none", *exit_criteria()))}),
    Cmd("consolidate", "looplm.run.checkpoint:consolidate_checkpoint",
        "add the full weights (model.safetensors) to a sharded checkpoint", checkpoint=True),
    Cmd("info", "looplm.analysis.flops:config_info", "parameter count and FLOP proxy of a config, as JSON",
        config="preset"),
    Cmd("bench", "looplm.apps.bench:run_bench", "throughput benchmarks with their targets (JSON + Markdown)", report=True,
        checkpoint=False, out=Path("benchmarks/results/bench.json")),
    Cmd("diagnose", "looplm.diagnostics.runner:diagnose_checkpoint", "mechanism diagnostics of a checkpoint: forcing "
        "bias, gain, anchor-start rollouts, hidden-state scale, visit alignment, token convergence",
        run=_C + "diagnose", report=True,
        opts={"steps": Opt(default=None, metavar="T,T", help="loop steps t for forcing bias and gain (default "
                           "0,DEPTH-1)")}),
    Cmd("gradcheck", "looplm.diagnostics.gradients:gradcheck_checkpoint", "gradient cosines of TBPTT-b and endpoint "
        "(Neumann-b) gradients against full BPTT, per parameter group", report=True),
    Cmd("sweep", "looplm.apps.sweep:sweep_file", "train and evaluate a grid of runs from a TOML sweep file (resumable)",
        opts={"file": Opt(positional=True, metavar="FILE.toml")}),
    Cmd("report", "looplm.analysis.report:write_report", "mean ± std tables, paired deltas and plots from a results "
        "database", run=_C + "report"),
    Cmd("export", "looplm.hf.export:export_checkpoint", "write a checkpoint as a Hugging Face folder (transformers, "
        "AutoTokenizer)", checkpoint=True, extra="hf", opts={"out": Opt(type=NewDir)}),
    Cmd("lm-eval", _C + "lm_eval", "lm-evaluation-harness tasks at one or several loop depths", report=True,
        extra="lmeval"),
    *(Cmd("import " + name, f"looplm.importers.{name}:import_{name}", text, opts=_IMPORT)
      for name, text in (("huginn", "Huginn-0125 (tomg-group-umd/huginn-0125)"),
                         ("ouro", "Ouro (ByteDance/Ouro-1.4B, Ouro-2.6B)"))),
    Cmd("rl pretrain", "looplm.rl.runner:pretrain_task", "pretrain a small looped model on a verifiable task "
        "(looplm's trainer on the task's stream)", config="looplm.rl.runner:PRETRAIN_CONFIG",
        opts={"task": _TASK, "out": Opt(default=None, help="run directory (required unless --print_config)")}),
    Cmd("rl train", _C + "rl_train", "Dr. GRPO post-training with full BPTT, recompute + Neumann-b or "
        "rollout-state reuse + Neumann-b", config="looplm.rl.config:RLConfig"),
    Cmd("rl eval", "looplm.rl.runner:rl_eval_checkpoint", "pass@1 / pass@k and greedy accuracy on the task's held-out "
        "problems", report=True, opts=_RL),
    Cmd("distill", _C + "distill", "train a distilled-prefill student for a looped teacher (LMDR eq. 4)",
        config="looplm.distill.config:DistillConfig"),
)


def _resolve(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _config(args: argparse.Namespace, overrides: dict[str, str]) -> Any:
    """--preset (default cpu), --config or the command's built-in config, then the overrides (and --name)."""
    preset = getattr(args, "preset", None)
    if args.config and preset:
        raise ConfigError("--preset and --config: give one starting config, not both")
    base = None if args._cmd.config == "preset" else _resolve(args._cmd.config)
    base = base() if isinstance(base, type) else base  # a RunSection class (distill, rl train): its defaults
    if args.config:
        try:
            cfg = (Config if base is None else type(base)).from_json(args.config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--config {args.config}: expected a JSON config file ({exc})") from None
    elif args._cmd.config == "preset":
        from looplm.presets import get_preset  # builds every preset: not for `looplm --help`

        cfg = get_preset(preset or "cpu")
    else:
        cfg = base
    overrides = dict(overrides, **({"name": args.name} if getattr(args, "name", None) else {}))
    return apply_overrides(cfg, overrides) if isinstance(cfg, Config) else cfg.with_overrides(overrides)


def build_parser() -> argparse.ArgumentParser:
    """The ``looplm`` parser; each command's options are added when the command is first looked up."""
    parser = argparse.ArgumentParser(prog="looplm", allow_abbrev=False, description="Build, train, evaluate and "
                                     "diagnose looped (shared-block, depth-recurrent) transformer language models.")
    subs = {"": lazy_subparsers(parser, dest="command", required=True, metavar="COMMAND")}
    for cmd in COMMANDS:
        group, _, name = cmd.name.rpartition(" ")
        if group not in subs:
            members = ", ".join(c.name.split()[1] for c in COMMANDS if c.name.startswith(group + " "))
            p = add_command(subs[""], group, lambda p: None, help=GROUPS[group][0].format(members),
                            description=GROUPS[group][1])
            subs[group] = lazy_subparsers(p, dest=group + "_command", required=True, metavar="COMMAND")
        text = DESCRIPTIONS.get(cmd.name, "")
        raw = "\n" in text  # an example whose layout must stay
        add_command(subs[group], name, cmd.build, help=cmd.help, description=text if raw else
                    f"{cmd.help[0].upper()}{cmd.help[1:]}. {text}",
                    epilog=f"details: docs/commands.md#looplm-{cmd.name.replace(' ', '-')}",
                    formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter)
    return parser


def _command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command that ``argv``'s leading words name (``parser`` when none does)."""
    for tok in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if tok.startswith("-") or not subs or tok not in subs[0].choices:
            break
        parser = subs[0].choices[tok]
    return parser


def _unknown_options_error(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Exit 2 naming the unknown options, the closest valid option and the sibling commands that take it."""
    leaf, msg = args._parser, f"unrecognized arguments: {' '.join(extras)}"
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
    if flags:
        group = args._cmd.name.rpartition(" ")[0]
        owners = [p.prog for p in (subcommands(_command_parser(parser, [group])) if group else [])
                  if p is not leaf and flags[0] in option_strings(p)]
        msg += (f" ({flags[0]} is an option of {', '.join(owners)})" if owners else
                suggest(flags[0], option_strings(leaf), *_OPTION_HINT))
    leaf.error(msg)


def _run(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    """Resolve the config, check the outputs, then call the command's glue or driven function."""
    cmd, leaf = args._cmd, args._parser
    func, glue = _resolve(cmd.func), _resolve(cmd.run) if cmd.run else None
    options = {n: getattr(args, n) for n in args._params}
    own = {n: getattr(args, n) for n in getattr(args, "_glue", ())}
    if hasattr(args, "quiet"):
        (own if glue and "progress" in inspect.signature(glue).parameters else options)["progress"] = not args.quiet
    if cmd.config:
        cfg = _config(args, overrides)
        if getattr(getattr(cfg, "data", None), "dataset", None) == "task":  # the family's k range, as train checks it
            from looplm.tasks import get_task

            get_task(cfg.data.task).check_k(cfg.data.task_k, "data.task_k")
        if args.print_config:
            print(cfg.to_json())
            return 0
        options["cfg"] = cfg
        if "overrides" in inspect.signature(func).parameters:
            options["overrides"] = overrides
        if "out" in vars(args) and args.out is None and hasattr(cfg, "train"):  # distill: a default --out
            leaf.error("the following arguments are required: --out")
        ignored = [f"--{n}" for n in ("preset", "config") if getattr(args, n, None)]
        ignored += [k for k in overrides if k != "train.steps"]  # train.steps: train a finished run on to it
        if getattr(args, "resume", False) and ignored:
            print(f"{leaf.prog}: warning: --resume continues with the config saved in {args.out}; ignoring "
                  f"{', '.join(ignored)}", file=sys.stderr)
    prepare_outputs(args)
    first = (args.checkpoint,) if args._first else ()
    report = Report(args.out, args.json) if cmd.report else None
    if report:
        report.check()
    if glue:
        return glue(func, options, *first, **({"report": report} if report else {}), **own) or 0
    result = func(*first, **options, **own)
    if report:
        return report.emit(result)
    if isinstance(result, dict):
        print(json.dumps(result, indent=2))
    elif result is not None and not isinstance(result, int):
        print(result)
    return result if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, overrides = split_config_overrides(argv)
    except CliError as exc:  # reported by the (sub)command it was given to, with that command's usage
        _command_parser(parser, argv).error(str(exc))
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_options_error(parser, args, extras)
    leaf = args._parser
    if overrides and not args._cmd.config:
        key, takers = "--" + next(iter(overrides)), [f"`looplm {c.name}`" for c in COMMANDS if c.config]
        leaf.error(f"{key}: {leaf.prog} takes no config overrides (--SECTION.FIELD applies to {', '.join(takers[:-1])} "
                   f"and {takers[-1]}){suggest(key, option_strings(leaf), *_OPTION_HINT)}")
    try:
        return int(_run(args, overrides) or 0)
    except UsageError as exc:
        leaf.error(str(exc))
    except BrokenPipeError:  # e.g. `looplm info --list | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush must not raise again
        return 0
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; nothing more is written (no checkpoint)
        out = getattr(args, "out", None)
        hint = ("; --resume continues from the newest checkpoint" + (f" in {out}" if out else "")
                if getattr(args, "resume", None) is not None else "")
        print(f"{leaf.prog}: interrupted{hint}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    except Exception as exc:
        from looplm.run.checkpoint import CheckpointError

        if isinstance(exc, ImportError) and args._cmd.extra:
            exc = ValueError(f"needs the {exc.name} package: pip install 'looplm[{args._cmd.extra}]'")
        elif not isinstance(exc, (ConfigError, KeyError, FileNotFoundError, ValueError, CheckpointError)):
            raise
        print(f"{leaf.prog}: error: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}", file=sys.stderr)
        return 2
