"""The ``looplm`` command line: one console script dispatching subcommands.

All argument parsing lives here. Every config field can be overridden as ``--SECTION.FIELD VALUE``
(for example ``--model.rule looped --train.steps 200``); the field help texts come from the config
dataclasses, so ``looplm train --help`` lists them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from looplm.config import SECTIONS, Config, ConfigError, apply_overrides

DEPTHS_HELP = "comma-separated loop depths, e.g. 1,2,4,8,12,16,24,32,48"


MAX_DEPTH = 4096


def parse_depths(text: str) -> list[int]:
    """``"1,8,48"`` → [1, 8, 48]. Raises argparse.ArgumentTypeError on anything else."""
    parts = [s.strip() for s in text.split(",")]
    try:
        depths = [int(s) for s in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {DEPTHS_HELP}; got {text!r}") from None
    if min(depths) < 0 or max(depths) > MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"loop depths must be in 0..{MAX_DEPTH}; got {text!r}")
    return depths


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cpu", help="named config to start from (see `looplm info --list`); "
                   "default: cpu")
    p.add_argument("--config", type=Path, help="a config.json to start from instead of a preset")
    for section, cls in SECTIONS.items():
        g = p.add_argument_group(f"{section} config (override any field)")
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            g.add_argument(f"--{section}.{f.name}", dest=f"cfg:{section}.{f.name}", metavar="V",
                           help=f"{f.metadata.get('help', '')} [preset value; base default {default!r}]")


def _config_from_args(args: argparse.Namespace) -> Config:
    from looplm.presets import get_preset

    if args.config:
        try:
            cfg = Config.from_json(args.config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
    else:
        cfg = get_preset(args.preset)
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    if getattr(args, "name", None):
        overrides["name"] = args.name
    return apply_overrides(cfg, overrides)


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from looplm.analysis.flops import flops_per_token
    from looplm.model import LoopLM
    from looplm.presets import PRESETS

    if args.list:
        print(json.dumps({name: cfg.to_dict()["model"] for name, cfg in PRESETS.items()}, indent=2))
        return 0
    cfg = _config_from_args(args)
    with torch.device("meta"):
        model = LoopLM(cfg.model)
    info = {"preset": args.preset if not args.config else str(args.config), "name": cfg.name,
            "params": model.num_params(), "params_millions": round(model.num_params() / 1e6, 2),
            "flops_per_token": {str(T): flops_per_token(cfg.model, T) for T in args.depths},
            "config": cfg.to_dict()}
    print(json.dumps(info, indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from looplm.train.checkpoint import list_checkpoints
    from looplm.train.trainer import train

    cfg = _config_from_args(args)
    if args.resume:
        ignored = [k[4:] for k, v in vars(args).items() if k.startswith("cfg:") and v is not None]
        if ignored or args.config:
            print(f"looplm train: warning: --resume continues with the config saved in {args.out}; ignoring "
                  f"{', '.join(ignored) or '--config'}", file=sys.stderr)
    elif list_checkpoints(args.out):
        raise ValueError(f"--out {args.out} already holds a run; continue it with --resume or choose another --out")
    summary = train(cfg, args.out, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    progress = not args.quiet
    if args.task == "ppl":
        from looplm.eval.runner import evaluate_checkpoint

        result = evaluate_checkpoint(args.checkpoint, depths=args.depths, dataset=args.dataset, split=args.split,
                                     batch_size=args.batch_size, max_tokens=args.max_tokens, stride=args.stride,
                                     device=args.device, progress=progress)
    elif args.task == "lambada":
        from looplm.eval.lambada import evaluate_lambada_checkpoint

        result = evaluate_lambada_checkpoint(args.checkpoint, depths=args.depths, max_examples=args.max_examples,
                                             batch_size=args.batch_size, device=args.device, progress=progress)
    else:
        from looplm.eval.adaptive import adaptive_depth_checkpoint

        result = adaptive_depth_checkpoint(args.checkpoint, targets=args.targets, ceiling=args.ceiling,
                                           dataset=args.dataset, max_tokens=args.max_tokens,
                                           batch_size=args.batch_size, device=args.device, progress=progress)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".md").write_text(result["markdown"] + "\n")
        print(result["markdown"])
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    else:
        print(text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from looplm.bench import run_bench, write_results

    res = run_bench(preset=args.preset, depth=args.depth, batch_size=args.batch_size, steps=args.steps,
                    matmul_n=args.matmul_n, device=args.device, progress=not args.quiet)
    write_results(res, args.out)
    print(res["markdown"])
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from looplm.demo import run_demo

    run_demo(args.out, steps=args.steps, eval_tokens=args.eval_tokens, depths=args.depths,
             rules=args.rules, progress=not args.quiet)
    return 0


#: modules that add subcommands: each defines ``register(subparsers)`` (parsing stays in this layer).
COMMAND_MODULES: tuple[str, ...] = ("looplm.diagnostics.commands", "looplm.analysis.commands")


def build_parser() -> argparse.ArgumentParser:
    from looplm.eval.perplexity import DEFAULT_DEPTHS

    default_depths = ",".join(map(str, DEFAULT_DEPTHS))
    parser = argparse.ArgumentParser(
        prog="looplm", description="Build, train, evaluate and diagnose looped (shared-block, "
        "depth-recurrent) transformer language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="the main job: train looped and scse on Brown, compare PPL across depths",
                       description="Train the `looped` baseline and `scse` with the cpu preset on the Brown "
                       "train split (SPEC §11), evaluate both at every depth on Brown test and on held-out "
                       "WikiText-2 raw test, and write results.json, results.md and ppl_vs_depth.png. "
                       "Re-running skips finished training and resumes interrupted runs.")
    p.add_argument("--out", type=Path, default=Path("results/demo"), help="results folder (default results/demo)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps per model (default: the cpu preset's)")
    p.add_argument("--eval-tokens", type=positive_int, default=16384,
                   help="score at most this many tokens per evaluation split (default 16384)")
    p.add_argument("--depths", type=parse_depths, default=list(DEFAULT_DEPTHS), help=DEPTHS_HELP)
    p.add_argument("--rules", default="looped,scse", help="comma-separated recurrence rules to train")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="train a model (any config field overridable)",
                       description="Train a model into --out: checkpoints under OUT/checkpoints (atomic; "
                       "OUT/latest names the newest), metrics appended to OUT/metrics.jsonl, "
                       "OUT/summary.json at the end. --resume continues exactly from the newest valid "
                       "checkpoint.")
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("--name", help="run name (default: the preset's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop with a checkpoint after N steps of this invocation (continue with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="multi-depth perplexity, LAMBADA, or adaptive depth of a checkpoint",
                       description="--task ppl (default): perplexity at every requested loop depth from one "
                       "unroll per batch (SPEC §6), token-weighted; JSON has per-depth ppl, nll, tokens. "
                       "--task lambada: OpenAI LAMBADA target-token completion PPL, target-token accuracy "
                       "and exact last-word accuracy per depth (target_ppl, target_acc, exact_acc). "
                       "--task adaptive: the hidden-update stopping rule (max-token relative update < tau, "
                       "ceiling --ceiling), tau calibrated on the valid split per target mean depth, test PPL "
                       "and achieved depth, plus a real early-exit run with its speedup. Writes JSON (--out) "
                       "and a Markdown table next to it.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--task", choices=["ppl", "lambada", "adaptive"], default="ppl", help="what to evaluate")
    p.add_argument("--max-examples", type=positive_int, default=None, help="lambada: score only the first N passages")
    p.add_argument("--targets", type=parse_depths, default=[8, 16, 24],
                   help="adaptive: target mean loop budgets (default 8,16,24)")
    p.add_argument("--ceiling", type=positive_int, default=48, help="adaptive: loop ceiling (default 48)")
    p.add_argument("--depths", type=parse_depths, default=list(DEFAULT_DEPTHS), help=DEPTHS_HELP)
    p.add_argument("--dataset", default=None, help="brown, wikitext2, wikitext103, text, openwebtext or c4 "
                   "(the last two from the Hugging Face hub, online; default: the training corpus)")
    p.add_argument("--split", default="test", choices=["train", "valid", "test"], help="split (default test)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward (default 16)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="score only the first N tokens of the split")
    p.add_argument("--stride", type=positive_int, default=None,
                   help="sliding-window stride (default: non-overlapping)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--out", type=Path, help="write the JSON here (and FILE.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("info", help="parameter count and FLOP proxy of a config, as JSON",
                       description="Print JSON with `params` (trainable, tied embeddings once) and "
                       "`flops_per_token` → depth → {body, body_head} (SCSE eq. 20–21). Builds the "
                       "model on the meta device, so paper-size presets cost no memory.")
    p.add_argument("--depths", type=parse_depths, default=[8, 48], help=DEPTHS_HELP + " (default 8,48)")
    p.add_argument("--list", action="store_true", help="list the presets and their model configs")
    _add_config_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="throughput benchmarks with their targets (JSON + Markdown)",
                       description="Measure, in one run: the fp32/bf16 matmul peak, training tokens/s and "
                       "model FLOP utilization, bf16 speedup, loop overhead (looped at depth T vs an "
                       "unshared T-block model), SCSE vs looped throughput, and multi-depth evaluation vs "
                       "one evaluation at the largest depth. Writes FILE.json and FILE.md.")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench.json"), help="results JSON path")
    p.add_argument("--preset", default="cpu", help="model shape to measure (default cpu)")
    p.add_argument("--depth", type=positive_int, default=8, help="loop depth T for the training measurements")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per step")
    p.add_argument("--steps", type=positive_int, default=5, help="timed repetitions per measurement (median)")
    p.add_argument("--matmul-n", type=positive_int, default=2048, help="matmul size for the peak measurement")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench)

    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, KeyError, FileNotFoundError, ValueError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"looplm {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - surface checkpoint errors without a traceback
        from looplm.train.checkpoint import CheckpointError

        if isinstance(exc, CheckpointError):
            print(f"looplm {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise

