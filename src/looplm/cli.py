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

from looplm.config import SECTIONS, Config, ConfigError, apply_overrides, options_help

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


def out_file(text: str) -> Path:
    """A file path to write (argparse type): not an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path such as {path / 'result.json'}")
    return path


def out_dir(text: str) -> Path:
    """A directory to write into (argparse type): not an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory path")
    return path


def in_file(text: str) -> Path:
    """An existing readable file (argparse type)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    return path


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cpu", help="named config to start from (see `looplm info --list`); "
                   "default: cpu")
    p.add_argument("--config", type=Path, help="a config.json to start from instead of a preset")
    for section, cls in SECTIONS.items():
        g = p.add_argument_group(f"{section} config (override any field)")
        for f in dataclasses.fields(cls):
            if f.name.startswith("_") or (section == "model" and f.name == "options"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            g.add_argument(f"--{section}.{f.name}", dest=f"cfg:{section}.{f.name}", metavar="V",
                           help=f"{f.metadata.get('help', '')} [preset value; base default {default!r}]")
        if section == "model":
            for key, text in options_help().items():
                g.add_argument(f"--{key}", dest=f"cfg:{key}", metavar="V", help=text)


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
    from looplm.model import build_model
    from looplm.presets import PRESETS

    if args.list:
        print(json.dumps({name: cfg.to_dict()["model"] for name, cfg in PRESETS.items()}, indent=2))
        return 0
    cfg = _config_from_args(args)
    with torch.device("meta"):
        model = build_model(cfg.model)
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
    if args.kv_sharing != "none" and args.task != "ppl":
        raise ValueError(f"--kv-sharing {args.kv_sharing} is its own perplexity protocol; use it with --task ppl, "
                         f"not --task {args.task}")
    if args.task != "ppl" or args.kv_sharing != "none":
        for flag, used in (("--scale-clamp", args.scale_clamp), ("--stride", args.stride is not None)):
            if used:
                raise ValueError(f"{flag} applies to --task ppl without --kv-sharing only (got --task {args.task}, "
                                 f"--kv-sharing {args.kv_sharing})")
    if args.kv_sharing == "terminal":
        from looplm.eval.kvsharing import evaluate_kv_sharing_checkpoint

        result = evaluate_kv_sharing_checkpoint(args.checkpoint, args.depths, None, split=args.split,
                                                max_tokens=args.max_tokens, batch_size=args.batch_size,
                                                dataset=args.dataset, device=args.device, progress=progress)
    elif args.task == "ppl":
        from looplm.eval.runner import evaluate_checkpoint

        result = evaluate_checkpoint(args.checkpoint, depths=args.depths, dataset=args.dataset, split=args.split,
                                     batch_size=args.batch_size, max_tokens=args.max_tokens, stride=args.stride,
                                     device=args.device, progress=progress, scale_clamp=args.scale_clamp)
    elif args.task == "lambada":
        from looplm.eval.lambada import evaluate_lambada_checkpoint

        result = evaluate_lambada_checkpoint(args.checkpoint, depths=args.depths, max_examples=args.max_examples,
                                             batch_size=args.batch_size, device=args.device, progress=progress)
    elif args.task == "halting":
        from looplm.eval.halting import evaluate_halting_checkpoint

        out_dir = args.out.parent if args.out else Path("results") / "halting"
        n = args.max_examples or 160
        result = evaluate_halting_checkpoint(args.checkpoint, out_dir, k_max=args.ceiling, split_calib="valid",
                                             split_timed=args.split, n_calib=n, n_timed=n,
                                             batch_size=args.batch_size, tolerance=args.tolerance,
                                             device=args.device, progress=progress,
                                             **({"dataset": args.dataset} if args.dataset else {}))
    else:
        from looplm.eval.adaptive import DEFAULT_CEILING, adaptive_depth_checkpoint

        result = adaptive_depth_checkpoint(args.checkpoint, targets=args.targets,
                                           ceiling=args.ceiling or DEFAULT_CEILING, dataset=args.dataset,
                                           max_tokens=args.max_tokens, batch_size=args.batch_size,
                                           device=args.device, progress=progress)
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


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt values, then the non-empty lines of --prompts-file (trailing newline dropped)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        lines = args.prompts_file.read_text().splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or a --prompts-file with one prompt per line")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import load_tokenizer_for
    from looplm.generate import build_exit_criterion, generate
    from looplm.train.checkpoint import load_checkpoint

    prompts = _read_prompts(args)
    model, cfg, _, ckpt = load_checkpoint(args.checkpoint, device=args.device)
    tok = load_tokenizer_for(ckpt)
    try:
        eos = eot_id(tok)
    except ValueError:
        eos = None
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    for p, i in zip(prompts, ids):
        if not i:
            raise ValueError(f"prompt {p!r} encodes to no tokens")
    depth = args.depth or cfg.train.eval_depth
    if args.temperature <= 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--top-k/--top-p shape sampling; give --temperature > 0 with them (0 = greedy)")
    if args.exit == "none" and (args.max_depth is not None or args.exit_tau is not None):
        raise ValueError("--max-depth/--exit-tau apply to per-token adaptive depth; give --exit relative|kl|entropy")
    if args.exit_tau is not None and args.exit_tau <= 0:
        raise ValueError(f"--exit-tau: must be > 0, got {args.exit_tau}")
    criterion = None if args.exit == "none" else build_exit_criterion(args.exit, args.exit_tau)
    gen = generate(model, ids, args.max_new_tokens, depth, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, cache_mode=args.kv_cache, exit_criterion=criterion,
                   max_depth=args.max_depth, eos_id=eos)
    results = []
    for n, (p, i, toks, depths) in enumerate(zip(prompts, ids, gen.tokens, gen.depths), 1):
        text = tok.decode(toks)
        mean = sum(depths) / len(depths) if depths else 0.0
        results.append({"prompt": p, "prompt_tokens": i, "continuation": text, "tokens": toks, "depths": depths,
                        "mean_depth": mean})
        print(f"=== [{n}/{len(prompts)}] {len(i)} prompt tokens -> {len(toks)} new tokens, "
              f"loops per token: mean {mean:.2f}")
        print(f"{p}\033[1m{text}\033[0m" if sys.stdout.isatty() else p + text)
    if args.json:
        settings = {"depth": depth, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "kv_cache": args.kv_cache,
                    "exit": args.exit, "exit_tau": None if criterion is None else criterion.tau,
                    "max_depth": (args.max_depth or depth) if criterion is not None else None, "eos_id": eos}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
                                         "settings": settings, "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from looplm.train.checkpoint import consolidate_checkpoint

    print(consolidate_checkpoint(args.checkpoint))
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
COMMAND_MODULES: tuple[str, ...] = ("looplm.diagnostics.commands", "looplm.analysis.commands", "looplm.hf_commands")


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
    p.add_argument("--out", type=out_dir, default=Path("results/demo"), help="results folder (default results/demo)")
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
    p.add_argument("--out", type=out_dir, required=True, help="run directory")
    p.add_argument("--name", help="run name (default: the preset's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop with a checkpoint after N steps of this invocation (continue with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="perplexity, terminal KV sharing, LAMBADA, adaptive depth or halting of a "
                       "checkpoint",
                       description="--task ppl (default): perplexity at every requested loop depth from one "
                       "unroll per batch (SPEC §6), token-weighted; JSON has per-depth ppl, nll, tokens. "
                       "--kv-sharing terminal (with --task ppl): the continuation protocol of terminal KV "
                       "sharing: prefill the first half of each full window into a terminal KV cache, score the "
                       "second half in one pass, and compare with the full forward on the same tokens; JSON has "
                       "per-depth ppl_full, ppl_terminal, sharing_penalty_pct = 100(PPL_terminal/PPL_full - 1), "
                       "kv_bytes_full and kv_bytes_terminal (per sequence prefix). "
                       "--task lambada: OpenAI LAMBADA target-token completion PPL, target-token accuracy "
                       "and exact last-word accuracy per depth (target_ppl, target_acc, exact_acc). "
                       "--task adaptive: the hidden-update stopping rule (max-token relative update < tau, "
                       "ceiling --ceiling), tau calibrated on the valid split per target mean depth, test PPL "
                       "and achieved depth, plus a real early-exit run with its speedup. "
                       "--task halting: logit-margin halting (smallest margin threshold keeping PPL within "
                       "--tolerance of the K_max PPL on valid windows, then a timed dynamic-batching run on "
                       "--split and the fixed-depth frontier); writes halting.json, halting.md and "
                       "halting_frontier.png into the folder of --out (default results/halting). "
                       "Writes JSON (--out) and a Markdown table next to it.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--task", choices=["ppl", "lambada", "adaptive", "halting"], default="ppl",
                   help="what to evaluate")
    p.add_argument("--kv-sharing", choices=["none", "terminal"], default="none",
                   help="ppl: none (default) = the ordinary forward; terminal = the terminal KV sharing "
                   "continuation protocol at each of --depths")
    p.add_argument("--max-examples", type=positive_int, default=None,
                   help="lambada: score only the first N passages; halting: N calibration and N timed windows "
                   "(default 160)")
    p.add_argument("--targets", type=parse_depths, default=[8, 16, 24],
                   help="adaptive: target mean loop budgets (default 8,16,24)")
    p.add_argument("--ceiling", type=positive_int, default=None,
                   help="adaptive: loop ceiling (default 48); halting: K_max (default the checkpoint's nominal "
                   "training depth: train.depth, depth_hi, or depth_mean rounded up for pln/learned)")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="halting: allowed relative PPL increase over K_max (default 0.01 = 1%%)")
    p.add_argument("--depths", type=parse_depths, default=list(DEFAULT_DEPTHS), help=DEPTHS_HELP)
    p.add_argument("--dataset", default=None, help="brown, wikitext2, wikitext103, text, openwebtext or c4 "
                   "(the last two from the Hugging Face hub, online; default: the training corpus)")
    p.add_argument("--split", default="test", choices=["train", "valid", "test"],
                   help="split (default test; halting: the timed split)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward (default 16)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="score only the first N tokens of the split")
    p.add_argument("--stride", type=positive_int, default=None,
                   help="sliding-window stride (default: non-overlapping)")
    p.add_argument("--scale-clamp", action="store_true",
                   help="--task ppl: rescale each token's state after every loop to its loop-1 RMS before "
                        "readout and recurrence (the readout-blind-spot diagnostic, SPEC §4)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--out", type=out_file, help="write the JSON here (and FILE.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="continue text prompts with a checkpoint (KV cache, sampling, adaptive "
                       "depth)",
                       description="Encode each prompt with the checkpoint's tokenizer, left-pad them into one "
                       "batch, prefill it through a KV cache and decode one token per step; print each prompt "
                       "followed by its continuation. Rows stop at <|endoftext|>. Prompt plus continuation must "
                       "fit the model's context (len(prompt) + max_new_tokens - 1 <= seq_len); longer prompts are "
                       "an error, never truncated silently.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", type=in_file, metavar="F", help="a text file with one prompt per line "
                   "(blank lines skipped), added after the --prompt values")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                   help="new tokens per prompt (default 32)")
    p.add_argument("--depth", type=positive_int, default=None, metavar="R",
                   help="loop depth of every forward (default: the checkpoint's train.eval_depth)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) = greedy argmax")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample only from the K most likely tokens (with --temperature > 0)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling: sample from the smallest set of most likely tokens whose "
                   "probability reaches P, in (0, 1] (with --temperature > 0; applied after --top-k)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--kv-cache", choices=["per_visit", "terminal"], default="per_visit",
                   help="per_visit (default): K/V of every loop visit, exact; terminal: terminal KV sharing, "
                   "one bank per physical layer holding each prefix token's last-visit K/V")
    p.add_argument("--exit", choices=["none", "relative", "kl", "entropy"], default="none",
                   help="per-token adaptive depth: each new token loops until the criterion holds or "
                   "--max-depth; relative = ||h_r - h_r-1|| / ||h_r-1|| < tau, kl = KL(p_r || p_r-1) < tau "
                   "(nats), entropy = |H(p_r) - H(p_r-1)| < tau (nats); none (default) = fixed --depth")
    p.add_argument("--exit-tau", type=float, default=None, metavar="TAU",
                   help="threshold of --exit (default: relative 0.02, kl 5e-4, entropy 1e-3)")
    p.add_argument("--max-depth", type=positive_int, default=None, metavar="R",
                   help="with --exit: loop ceiling per token, also the prompt's prefill depth (default --depth)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--json", type=out_file, metavar="OUT", help="also write prompts, token ids, continuations and "
                   "loops per token as JSON")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("consolidate", help="add the full weights (model.safetensors) to a sharded checkpoint",
                       description="Read the sharded (torch.distributed.checkpoint) weights of a checkpoint, "
                       "written under any number of ranks, and add them to it as model.safetensors (also "
                       "listed in its manifest), so the folder is a plain config.json + model.safetensors "
                       "model. Prints the file's path; does nothing when the checkpoint already has one. "
                       "Eval, diagnose and generate read sharded checkpoints without this step.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.set_defaults(func=cmd_consolidate)

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
    p.add_argument("--out", type=out_file, default=Path("benchmarks/results/bench.json"), help="results JSON path")
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
    except BrokenPipeError:  # e.g. `looplm info --list | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush must not raise again
        return 0
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

