"""The ``looplm`` command line: one console script dispatching subcommands.

All argument parsing lives in this layer (this module, :mod:`looplm.cliutil` and the ``commands``
modules), on stdlib argparse with abbreviations refused. A command's options are generated from the
library function it drives (:func:`looplm.cliutil.add_function_options`: name, default and docstring
help per parameter), so ``looplm eval lambada`` offers exactly the options of
:func:`~looplm.eval.lambada.evaluate_lambada_checkpoint`. Config fields are never listed here: every
``--SECTION.FIELD[.SUB] VALUE`` pair goes as a string to :func:`looplm.config.apply_overrides`, which
parses and validates it; ``looplm train --help`` lists the fields walked from the config dataclasses.
Output paths are checked (and their folders created) before any work starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from looplm.cliutil import (CliError, Opt, Parser, add_command, add_function_options, call_with_options,
                            config_help, config_keys, lazy_subparsers, option_strings, prepare_out_dir,
                            prepare_out_file, split_config_overrides, subcommands, suggest)
from looplm.config import Config, ConfigError, apply_overrides

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


SPLITS = ("train", "valid", "test")
DATASET_HELP = ("brown, wikitext2, wikitext103, openwebtext or c4 (the last two from the Hugging Face hub, "
                "online; default: the checkpoint's training corpus, which may also be a text or hf corpus: its "
                "paths are in the checkpoint's config)")
DEVICE_HELP = "cpu, cuda or cuda:N"


def common_opts() -> dict[str, Opt]:
    """Option specs shared by the evaluation protocols (help where the function's docstring has none)."""
    return {
        "depths": Opt(type=parse_depths, metavar="T,T,...",
                      help=DEPTHS_HELP + "; 0 reads out the rule's initial state h_0 (no core step)"),
        "dataset": Opt(help=DATASET_HELP),
        "split": Opt(choices=SPLITS, help="split"),
        "batch_size": Opt(type=positive_int, metavar="N", help="windows per forward"),
        "max_tokens": Opt(type=positive_int, metavar="N", help="score only the first N tokens of the split "
                          "(default: all)"),
        "device": Opt(help=DEVICE_HELP),
    }


def _pick(specs: dict[str, Opt], *names: str) -> dict[str, Opt]:
    return {n: specs[n] for n in names}


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")


def _add_report_output(p: argparse.ArgumentParser, out_help: str = "write the JSON here and the Markdown "
                       "table next to it as FILE.md") -> None:
    p.add_argument("--out", type=out_file, metavar="FILE.json", help=out_help)
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: the Markdown report)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def emit_report(args: argparse.Namespace, result: dict[str, Any], written: Sequence[Path] = ()) -> None:
    """Print ``result`` (Markdown for people; JSON with --json) and the files written."""
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    else:
        print(result["markdown"])
    if written:
        print("wrote " + ", ".join(map(str, written)), file=sys.stderr if getattr(args, "json", False) else sys.stdout)


def write_report_files(out: Path | None, result: dict[str, Any]) -> list[Path]:
    """``out`` ← the result as JSON, ``out.md`` ← its Markdown; returns the paths (none without ``out``)."""
    from looplm.finite import write_json_markdown

    return [] if out is None else write_json_markdown(result, out)


def check_report_out(args: argparse.Namespace) -> None:
    """Before the work: --out FILE and FILE.md must be writable (their folder is created)."""
    if args.out is not None:
        prepare_out_file(args.out, "--out", companions=[args.out.with_suffix(".md")])


# ---------------------------------------------------------------- config-driven commands
def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="named config to start from (see `looplm info --list`); "
                   "default: cpu; not with --config")
    p.add_argument("--config", type=in_file, metavar="FILE.json",
                   help="a config file (JSON, as written into every checkpoint) to start from instead of a preset")
    p.add_argument("--print_config", "--print-config", action="store_true",
                   help="print the resolved config (preset or --config, then overrides) as JSON and exit")
    p.set_defaults(_takes_config=True)
    if isinstance(p, Parser):
        p.config_help = config_help


def _config_from_args(args: argparse.Namespace) -> Config:
    from looplm.presets import get_preset

    if args.config and args.preset:
        raise ConfigError("--preset and --config: give one starting config, not both (--config FILE.json "
                          "already holds a whole config)")
    if args.config:
        try:
            cfg = Config.from_json(args.config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
    else:
        cfg = get_preset(args.preset or "cpu")
    overrides: dict[str, Any] = dict(getattr(args, "config_overrides", {}))
    if getattr(args, "name", None):
        overrides["name"] = args.name
    try:
        return apply_overrides(cfg, overrides)
    except ConfigError as exc:
        msg = str(exc)
        key = msg.split(":", 1)[0]
        if "unknown" in msg and "did you mean" not in msg and f"{key}" in overrides:
            hint = suggest("--" + key, config_keys())
            if hint:
                raise ConfigError(f"--{key}: unknown config field{hint} ({msg})") from None
        raise


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from looplm.analysis.flops import flops_per_token
    from looplm.model import build_model
    from looplm.presets import PRESETS

    if args.list:
        print(json.dumps({name: cfg.to_dict()["model"] for name, cfg in PRESETS.items()}, indent=2))
        return 0
    cfg = _config_from_args(args)
    if args.print_config:
        print(cfg.to_json())
        return 0
    with torch.device("meta"):
        model = build_model(cfg.model)
    info = {"preset": (args.preset or "cpu") if not args.config else str(args.config), "name": cfg.name,
            "params": model.num_params(), "params_millions": round(model.num_params() / 1e6, 2),
            "flops_per_token": {str(T): flops_per_token(cfg.model, T) for T in args.depths},
            "config": cfg.to_dict()}
    print(json.dumps(info, indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args)
    if args.print_config:
        print(cfg.to_json())
        return 0
    created = not args.out.exists()
    prepare_out_dir(args.out, "--out")

    from looplm.run.checkpoint import list_checkpoints
    from looplm.train.trainer import train

    steps = cfg.train.steps if args.resume and "train.steps" in args.config_overrides else None
    if args.resume:
        ignored = [k for k in args.config_overrides if k != "train.steps"]  # train.steps: train on to it
        if ignored or args.config:
            print(f"looplm train: warning: --resume continues with the config saved in {args.out}; ignoring "
                  f"{', '.join(ignored) or '--config'}", file=sys.stderr)
    elif list_checkpoints(args.out):
        raise ValueError(f"--out {args.out} already holds a run; continue it with --resume or choose another --out")
    try:
        summary = train(cfg, args.out, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after,
                        steps=steps, init_from=args.init_from, overwrite=args.overwrite)
    except BaseException:
        if created and not any(args.out.iterdir()):
            args.out.rmdir()  # nothing was written: leave no empty folder behind
        raise
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2))
    return 0


# ---------------------------------------------------------------- eval: one subcommand per protocol
def _eval_command(module: str, name: str):
    """The command of an eval protocol driven by ``module.name(checkpoint, **options)``: check the output
    paths, run, print (Markdown or --json) and write the report files."""

    def cmd(args: argparse.Namespace) -> int:
        check_report_out(args)
        func = getattr(importlib.import_module(module), name)
        result = call_with_options(func, args, args.checkpoint, progress=not args.quiet)
        emit_report(args, result, write_report_files(args.out, result))
        return 0

    return cmd


cmd_eval_ppl = _eval_command("looplm.eval.runner", "evaluate_checkpoint")
cmd_eval_kv_sharing = _eval_command("looplm.eval.kvsharing", "evaluate_kv_sharing_checkpoint")
cmd_eval_lambada = _eval_command("looplm.eval.lambada", "evaluate_lambada_checkpoint")
cmd_eval_adaptive = _eval_command("looplm.eval.adaptive", "adaptive_depth_checkpoint")
cmd_eval_distill = _eval_command("looplm.distill.evaluate", "evaluate_distill_checkpoint")


def cmd_eval_halting(args: argparse.Namespace) -> int:
    folder = args.out.parent if args.out else Path("results") / "halting"
    prepare_out_dir(folder, "--out", shown=args.out)
    check_report_out(args)
    from looplm.eval.halting import evaluate_halting_checkpoint

    if args.max_examples is not None:
        args.n_calib = args.n_timed = args.max_examples
    result = call_with_options(evaluate_halting_checkpoint, args, args.checkpoint, folder, progress=not args.quiet)
    written = [Path(p) for p in result.get("files", {}).values()]
    written += [p for p in write_report_files(args.out, result) if p not in written]
    emit_report(args, result, written)
    return 0


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    check_report_out(args)
    from looplm.eval.tasks import evaluate_task_checkpoint

    plot = args.out.with_suffix(".png") if args.out else None
    result = call_with_options(evaluate_task_checkpoint, args, args.checkpoint, progress=not args.quiet, plot=plot)
    emit_report(args, result, write_report_files(args.out, result) + ([plot] if plot else []))
    return 0


EVAL_PROTOCOLS: dict[str, str] = {
    "ppl": "perplexity at every requested loop depth (the default protocol)",
    "kv-sharing": "terminal KV sharing: continuation PPL with a terminal KV cache vs the full forward",
    "lambada": "LAMBADA target-token completion PPL and accuracies per depth",
    "adaptive": "adaptive depth (hidden-update stopping rule) with a real early-exit run",
    "halting": "logit-margin halting: calibrated threshold, timed dynamic batching, fixed-depth frontier",
    "distill": "distilled prefill: continuation PPL after the teacher's, early-stopped and distilled prefills",
    "tasks": "synthetic-task exact-match accuracy by loop depth x difficulty k (data.dataset=task checkpoints)",
}


def _register_eval(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "eval", _build_eval,
                help="evaluate a checkpoint: " + ", ".join(EVAL_PROTOCOLS) + " (one subcommand each)",
                description="Evaluate a checkpoint with one protocol; each protocol is its own subcommand "
                "with only its own options (`looplm eval PROTOCOL --help`). Prints the Markdown report "
                "(--json: the JSON); --out FILE.json also writes the JSON and FILE.md.")


def _build_eval(ev: argparse.ArgumentParser) -> None:
    protocols = lazy_subparsers(ev, dest="protocol", required=True, metavar="PROTOCOL")
    add_command(protocols, "ppl", _build_eval_ppl, help=EVAL_PROTOCOLS["ppl"],
                description="Perplexity at every requested loop depth from one unroll per batch "
                "(SPEC §6), token-weighted; JSON has per-depth ppl, nll, tokens, flops_per_token.")
    add_command(protocols, "kv-sharing", _build_eval_kv_sharing, help=EVAL_PROTOCOLS["kv-sharing"],
                description="The continuation protocol of terminal KV sharing (SPEC §6): prefill the "
                "first half of each full window into a terminal KV cache, score the second half in "
                "one pass, and compare with the full forward on the same tokens. JSON has per-depth "
                "ppl_full, ppl_terminal, sharing_penalty_pct = 100(PPL_terminal/PPL_full - 1), "
                "kv_bytes_full and kv_bytes_terminal (per sequence prefix).")
    add_command(protocols, "lambada", _build_eval_lambada, help=EVAL_PROTOCOLS["lambada"],
                description="OpenAI LAMBADA completion with the checkpoint's tokenizer: target-token "
                "PPL, target-token accuracy and exact last-word accuracy per depth (target_ppl, "
                "target_acc, exact_acc; SCSE Table 16 layout).")
    add_command(protocols, "adaptive", _build_eval_adaptive, help=EVAL_PROTOCOLS["adaptive"],
                description="The hidden-update stopping rule (stop when the max-token relative update "
                "< tau, at most --ceiling loops): tau calibrated on the valid split per target mean "
                "depth, test PPL and achieved depth (Table 9/10 layout), plus a real early-exit run "
                "with its speedup.")
    add_command(protocols, "halting", _build_eval_halting, help=EVAL_PROTOCOLS["halting"],
                description="Logit-margin halting: the smallest margin threshold keeping PPL within "
                "--tolerance of the K_max PPL on calibration windows, then a timed dynamic-batching "
                "run and the fixed-depth frontier. Writes halting.json, halting.md and "
                "halting_frontier.png into the folder of --out (default results/halting).")
    add_command(protocols, "distill", _build_eval_distill, help=EVAL_PROTOCOLS["distill"],
                description="Distilled prefill (LMDR Table 5 layout): each full window is cut in half; the "
                "prompt half is prefilled by the teacher at its depth R, by the teacher stopped after 3, 2 "
                "and 1 recurrences (--early-depths) and by the distilled student plus one recurrence, each "
                "into a terminal KV cache; the teacher then scores the continuation at R with terminal KV "
                "sharing. JSON per path: ppl (first continuation token from the prefill's readout, plus the "
                "rest), ppl_first, ppl_rest, prefill_ms per batch, kv_bytes; and the uncached full forward.")

    add_command(protocols, "tasks", _build_eval_tasks, help=EVAL_PROTOCOLS["tasks"],
                description="Exact-match accuracy of the answer tokens on the held-out instances of each "
                "difficulty k, at every loop depth T from one unroll (looplm.eval.tasks). JSON has accuracy "
                "per k and T; --out FILE.json also writes FILE.md and the heatmap FILE.png.")


_SCALE_CLAMP = Opt(help="rescale each token's state after every loop to its loop-1 RMS before readout and "
                   "recurrence (the readout-blind-spot diagnostic, SPEC §4)")


def _build_eval_ppl(p: argparse.ArgumentParser) -> None:
    from looplm.eval.runner import EVAL_DTYPES, evaluate_checkpoint

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, evaluate_checkpoint, {
        **_pick(o, "depths", "dataset", "split", "batch_size", "max_tokens"),
        "stride": Opt(type=positive_int, metavar="S", help="sliding-window stride (default: non-overlapping)"),
        "scale_clamp": _SCALE_CLAMP,
        "device": o["device"], "dtype": Opt(choices=EVAL_DTYPES)})
    _add_report_output(p)
    p.set_defaults(func=cmd_eval_ppl, _family="eval")


def _build_eval_kv_sharing(p: argparse.ArgumentParser) -> None:
    from looplm.eval.kvsharing import evaluate_kv_sharing_checkpoint
    from looplm.eval.perplexity import DEFAULT_DEPTHS

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, evaluate_kv_sharing_checkpoint, {
        "depths": Opt(type=parse_depths, help=DEPTHS_HELP, metavar="R,R,...", default=list(DEFAULT_DEPTHS)),
        **_pick(o, "dataset", "split", "batch_size", "max_tokens", "device"),
        "doc_aware": Opt(help="score only second-half targets that continue the document begun in the prompt "
                         "(LMDR's protocol; --no-doc-aware scores every second-half target)")})
    _add_report_output(p)
    p.set_defaults(func=cmd_eval_kv_sharing, _family="eval")


def _build_eval_lambada(p: argparse.ArgumentParser) -> None:
    from looplm.eval.lambada import evaluate_lambada_checkpoint

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, evaluate_lambada_checkpoint, {
        "depths": o["depths"],
        "max_examples": Opt(type=positive_int, metavar="N", help="score only the first N passages (default: all)"),
        **_pick(o, "batch_size", "device")})
    _add_report_output(p)
    p.set_defaults(func=cmd_eval_lambada, _family="eval")


def _build_eval_tasks(p: argparse.ArgumentParser) -> None:
    from looplm.eval.tasks import evaluate_task_checkpoint

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, evaluate_task_checkpoint, {
        "depths": Opt(type=parse_depths, metavar="T,T,...", help=DEPTHS_HELP + " (default 1 .. 2x training depth)"),
        "ks": Opt(type=parse_depths, metavar="K,K,...", help="difficulties k (default 1 .. 2x data.task_k)"),
        "split": Opt(choices=("valid", "test"), help="held-out split"),
        "max_examples": Opt(type=positive_int, metavar="N", help="instances per k (default: all held out)"),
        **_pick(o, "batch_size", "device")})
    _add_report_output(p)
    p.set_defaults(func=cmd_eval_tasks, _family="eval")


def _criterion_opt(default_help: str) -> Opt:
    from looplm.eval.exits import EXIT_CRITERIA

    return Opt(choices=tuple(EXIT_CRITERIA), metavar="NAME",
               help=f"exit criterion ({', '.join(EXIT_CRITERIA)}; looplm.eval.exits); default {default_help}")


def _build_eval_adaptive(p: argparse.ArgumentParser) -> None:
    from looplm.eval.adaptive import adaptive_depth_checkpoint

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, adaptive_depth_checkpoint, {
        "targets": Opt(type=parse_depths, metavar="D,D,...", help="target mean loop budgets"),
        "ceiling": Opt(type=positive_int, metavar="R", help="loop ceiling"),
        "criterion": _criterion_opt("hidden_update: the max-token relative hidden update"),
        "scale_clamp": _SCALE_CLAMP,
        **_pick(o, "dataset", "max_tokens", "batch_size", "device")})
    _add_report_output(p)
    p.set_defaults(func=cmd_eval_adaptive, _family="eval")


def _build_eval_halting(p: argparse.ArgumentParser) -> None:
    from looplm.eval.halting import evaluate_halting_checkpoint

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, evaluate_halting_checkpoint, {
        "k_max": Opt(type=positive_int, metavar="K",
                     help="K_max, the loop ceiling (default: the checkpoint's nominal training depth: train.depth, "
                     "depth_hi, or depth_mean rounded up for pln/learned)"),
        "tolerance": Opt(type=float, help="allowed relative PPL increase over K_max"),
        "split_calib": Opt(choices=SPLITS, help="split of the calibration windows"),
        "split_timed": Opt(choices=SPLITS, help="split of the timed windows"),
        "n_calib": Opt(type=positive_int, metavar="N", help="calibration windows"),
        "n_timed": Opt(type=positive_int, metavar="N", help="timed windows"),
        "criterion": _criterion_opt("margin: the logit margin"),
        "scale_clamp": _SCALE_CLAMP,
        "repeats": Opt(type=positive_int, metavar="N", help="timed passes per mode (interleaved; seconds are "
                       "their median)"),
        **_pick(o, "batch_size", "dataset", "device")})
    p.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                   help="shorthand for --n-calib N --n-timed N")
    _add_report_output(p, "write the JSON here and FILE.md; halting.json, halting.md and halting_frontier.png "
                       "go into its folder (default folder results/halting)")
    p.set_defaults(func=cmd_eval_halting, _family="eval")


def _build_eval_distill(p: argparse.ArgumentParser) -> None:
    from looplm.distill.evaluate import evaluate_distill_checkpoint

    o = common_opts()
    _add_checkpoint(p)
    add_function_options(p, evaluate_distill_checkpoint, {
        "student": Opt(type=Path, metavar="DIR", help="the student's run directory or checkpoint (default: "
                       "student/ next to the teacher's run)"),
        "early_depths": Opt(type=parse_depths, metavar="R,R,...", help="early-stopped teacher prefill depths"),
        "teacher_only": Opt(help="only the teacher rows (no student needed)"),
        **_pick(o, "dataset", "split", "batch_size", "max_tokens", "device"),
        "doc_aware": Opt(help="score only continuation targets that continue the document begun in the prompt "
                         "(LMDR's protocol; --no-doc-aware scores every continuation target)")})
    _add_report_output(p)
    p.set_defaults(func=cmd_eval_distill, _family="eval")


# ---------------------------------------------------------------- generate and the rest
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
    prompts = _read_prompts(args)
    if args.temperature <= 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--top-k/--top-p shape sampling; give --temperature > 0 with them (0 = greedy)")
    if args.exit == "none" and (args.max_depth is not None or args.exit_tau is not None):
        raise ValueError("--max-depth/--exit-tau apply to per-token adaptive depth; give --exit with an exit "
                         "criterion (see --help)")
    if args.exit_tau is not None and args.exit_tau <= 0:
        raise ValueError(f"--exit-tau: must be > 0, got {args.exit_tau}")
    if args.prefill == "teacher" and args.student is not None:
        raise ValueError("--student applies to --prefill distilled")
    if args.prefill == "distilled" and args.kv_cache == "per_visit":
        raise ValueError("--prefill distilled fills terminal KV banks (the student predicts only the endpoint); "
                         "use --kv-cache terminal (its default)")
    if args.kv_cache is None:  # an export's own default (config.json kv_cache), as transformers uses
        from looplm.run.hf_folder import export_kv_cache

        args.kv_cache = "terminal" if args.prefill == "distilled" else export_kv_cache(args.checkpoint) or "per_visit"
    if args.out is not None:
        prepare_out_file(args.out, "--out")

    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import load_tokenizer_for
    from looplm.generate import build_exit_criterion, generate
    from looplm.run.checkpoint import load_checkpoint

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
    student = student_depth = None
    if args.prefill == "distilled":
        from looplm.distill.student import default_student_dir, load_student

        student, record, _ = load_student(args.student or default_student_dir(args.checkpoint), model)
        student_depth = record.distill.depth
    depth = args.depth or student_depth or cfg.train.eval_depth
    criterion = None if args.exit == "none" else build_exit_criterion(args.exit, args.exit_tau)
    gen = generate(model, ids, args.max_new_tokens, depth, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, cache_mode=args.kv_cache, exit_criterion=criterion,
                   max_depth=args.max_depth, eos_id=eos, student=student, student_depth=student_depth,
                   static_step=args.static_step)
    results = []
    for n, (p, i, toks, depths) in enumerate(zip(prompts, ids, gen.tokens, gen.depths), 1):
        text = tok.decode(toks)
        mean = sum(depths) / len(depths) if depths else 0.0
        results.append({"prompt": p, "prompt_tokens": i, "continuation": text, "tokens": toks, "depths": depths,
                        "mean_depth": mean})
        print(f"=== [{n}/{len(prompts)}] {len(i)} prompt tokens -> {len(toks)} new tokens, "
              f"loops per token: mean {mean:.2f}")
        print(f"{p}\033[1m{text}\033[0m" if sys.stdout.isatty() else p + text)
    if args.out is not None:
        settings = {"depth": depth, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "kv_cache": args.kv_cache,
                    "prefill": args.prefill, "student_depth": student_depth,
                    "exit": args.exit, "exit_tau": None if criterion is None else criterion.tau,
                    "max_depth": (args.max_depth or depth) if criterion is not None else None, "eos_id": eos,
                    "static_step": args.static_step}
        args.out.write_text(json.dumps({"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
                                        "settings": settings, "results": results}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from looplm.run.checkpoint import consolidate_checkpoint

    print(consolidate_checkpoint(args.checkpoint))
    return 0


def cmd_convert_train_state(args: argparse.Namespace) -> int:
    from looplm.run.checkpoint import convert_train_state

    if not args.trust_pickle:
        raise CliError("convert-train-state unpickles the file, which can run any code it holds: pass "
                       "--trust-pickle only for a run folder you trust")
    print(convert_train_state(args.checkpoint))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    prepare_out_file(args.out, "--out", companions=[args.out.with_suffix(".md")])
    from looplm.bench import run_bench, write_results

    res = call_with_options(run_bench, args, progress=not args.quiet)
    write_results(res, args.out)
    print(res["markdown"])
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    prepare_out_dir(args.out, "--out")
    from looplm.demo import run_demo

    call_with_options(run_demo, args, args.out, progress=not args.quiet)
    return 0


#: modules that add subcommands: each defines ``register(subparsers)`` (parsing stays in this layer).
COMMAND_MODULES: tuple[str, ...] = ("looplm.diagnostics.commands", "looplm.analysis.commands", "looplm.hf_commands",
                                     "looplm.importers.commands", "looplm.rl.commands", "looplm.distill.commands")


def _build_demo(p: argparse.ArgumentParser) -> None:
    from looplm.demo import run_demo

    p.add_argument("--out", type=out_dir, default=Path("results/demo"), help="results folder (default results/demo)")
    add_function_options(p, run_demo, {
        "steps": Opt(type=positive_int, metavar="N", help="training steps per model (default: the cpu preset's)"),
        "eval_tokens": Opt(type=positive_int, metavar="N", help="score at most this many tokens per evaluation split"),
        "depths": Opt(type=parse_depths, metavar="T,T,...", help=DEPTHS_HELP),
        "rules": Opt(help="comma-separated recurrence rules to train")})
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_demo)


def _build_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=out_dir, help="run directory (required unless --print_config)")
    p.add_argument("--name", help="run name (default: the preset's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --out "
                   "(with --train.steps N: train a finished run on to N; the LR schedule follows the new total)")
    p.add_argument("--init-from", type=Path, metavar="CKPT", help="start from these weights (run, checkpoint or HF "
                   "export folder; its model config is used); fresh optimizer and schedule")
    p.add_argument("--overwrite", action="store_true", help="replace the metrics of a run in --out that wrote no "
                   "checkpoint (it diverged or stopped before its first)")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="N",
                   help="stop with a checkpoint after N steps of this invocation (continue with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)


def _build_generate(p: argparse.ArgumentParser) -> None:
    _add_checkpoint(p)
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", type=in_file, metavar="F", help="a text file with one prompt per line "
                   "(blank lines skipped), added after the --prompt values")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                   help="new tokens per prompt (default 32)")
    p.add_argument("--depth", type=positive_int, default=None, metavar="R",
                   help="loop depth of every forward, >= 1 (default: the checkpoint's train.eval_depth); "
                   "generation always runs the core, the depth-0 readout of h_0 is an eval diagnostic "
                   "(looplm eval ppl --depths 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) = greedy argmax")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample only from the K most likely tokens (with --temperature > 0)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling: sample from the smallest set of most likely tokens whose "
                   "probability reaches P, in (0, 1] (with --temperature > 0; applied after --top-k)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--kv-cache", choices=["per_visit", "terminal"], default=None,
                   help="per_visit (the default with --prefill teacher, unless an export's config.json says "
                   "otherwise): K/V of every loop visit, exact; terminal "
                   "(the default, and the only cache, with --prefill distilled): terminal KV sharing, one bank per "
                   "physical layer holding each prefix token's last-visit K/V")
    p.add_argument("--prefill", choices=["teacher", "distilled"], default="teacher",
                   help="teacher (default): the model prefills the prompt at --depth; distilled: the student "
                   "(looplm distill) predicts the endpoint z^R, one recurrence and the coda fill the terminal KV "
                   "banks, then the model decodes unchanged (LMDR distilled prefill)")
    p.add_argument("--student", type=Path, default=None, metavar="DIR",
                   help="with --prefill distilled: the student's run directory or checkpoint (default: student/ "
                   "next to the checkpoint's run)")
    from looplm.eval.exits import EXIT_CRITERIA

    p.add_argument("--exit", choices=["none", *EXIT_CRITERIA], default="none",
                   help="per-token adaptive depth (looplm.eval.exits): each new token loops until the criterion "
                   "fires or --max-depth; relative / hidden_update = ||h_r - h_r-1|| / ||h_r-1|| < tau, kl = "
                   "KL(p_r || p_r-1) < tau (nats), entropy = |H(p_r) - H(p_r-1)| < tau (nats), margin = top-1 "
                   "minus top-2 logit >= tau, exit_gate = the learned exit probability >= tau (models trained "
                   "with train.supervision=exit_weighted), exit_cdf = Ouro's rule on the same gate, the "
                   "cumulative exit probability 1 - prod(1 - lambda_k) >= tau; none (default) = fixed --depth")
    p.add_argument("--exit-tau", type=float, default=None, metavar="TAU",
                   help="threshold of --exit (default: " + ", ".join(
                       f"{n} {c.default_tau:g}" for n, c in EXIT_CRITERIA.items()) + ")")
    p.add_argument("--max-depth", type=positive_int, default=None, metavar="R",
                   help="with --exit: loop ceiling per token, also the prompt's prefill depth (default --depth)")
    p.add_argument("--static-step", choices=["eager", "compile", "cuda_graph"], default=None,
                   help="fixed-depth decoding with a per_visit cache: run each token step as one static region, "
                   "compile = one torch.compile graph (compiling takes seconds to minutes: pays over long "
                   "generations), cuda_graph = one captured CUDA graph; default: the eager cached path")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--out", type=out_file, metavar="FILE.json",
                   help="also write prompts, token ids, continuations and loops per token as JSON")
    p.set_defaults(func=cmd_generate)


def _build_consolidate(p: argparse.ArgumentParser) -> None:
    _add_checkpoint(p)
    p.set_defaults(func=cmd_consolidate)


def _build_convert_train_state(p: argparse.ArgumentParser) -> None:
    _add_checkpoint(p)
    p.add_argument("--trust-pickle", action="store_true",
                   help="required: you vouch that the file comes from a source you trust")
    p.set_defaults(func=cmd_convert_train_state)


def _build_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--depths", type=parse_depths, default=[8, 48], help=DEPTHS_HELP + " (default 8,48)")
    p.add_argument("--list", action="store_true", help="list the presets and their model configs")
    _add_config_args(p)
    p.set_defaults(func=cmd_info)


def _build_bench(p: argparse.ArgumentParser) -> None:
    from looplm.bench import run_bench

    p.add_argument("--out", type=out_file, default=Path("benchmarks/results/bench.json"), metavar="FILE.json",
                   help="results JSON path; the Markdown goes to FILE.md (default benchmarks/results/bench.json)")
    add_function_options(p, run_bench, {
        "preset": Opt(help="model shape to measure"),
        "depth": Opt(type=positive_int, metavar="T", help="loop depth T for the training measurements"),
        "batch_size": Opt(type=positive_int, metavar="N", help="sequences per step"),
        "steps": Opt(type=positive_int, metavar="N", help="timed repetitions per measurement (median)"),
        "matmul_n": Opt(type=positive_int, metavar="N", help="matmul size for the peak measurement"),
        "device": Opt(help="cpu, cuda or auto"),
        "rounds": Opt(type=positive_int, metavar="N", help="interleaved A/B/B/A rounds per timed ratio"),
        "quick": Opt(help="smoke test at toy shapes (seconds): every measurement runs, the values mean nothing")})
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench)


def build_parser() -> Parser:
    """The ``looplm`` parser. Each command's options are added when the command is first looked up
    (:func:`looplm.cliutil.add_command`), so a run imports only the modules its command drives;
    :func:`looplm.cliutil.build_all` adds them all."""
    parser = Parser(
        prog="looplm", description="Build, train, evaluate and diagnose looped (shared-block, "
        "depth-recurrent) transformer language models.")
    sub = lazy_subparsers(parser, dest="command", required=True, metavar="COMMAND")

    add_command(sub, "demo", _build_demo,
                help="the main job: train looped and scse on Brown, compare PPL across depths",
                description="Train the `looped` baseline and `scse` with the cpu preset on the Brown "
                "train split (SPEC §11), evaluate both at every depth on Brown test and on held-out "
                "WikiText-2 raw test, and write results.json, results.md and ppl_vs_depth.png. "
                "Re-running skips finished training and resumes interrupted runs.")
    add_command(sub, "train", _build_train,
                help="train a model (any config field overridable as --SECTION.FIELD VALUE)",
                description="Train a model into --out: checkpoints under OUT/checkpoints (atomic; "
                "OUT/latest names the newest), metrics appended to OUT/metrics.jsonl, "
                "OUT/summary.json at the end. --resume continues exactly from the newest valid "
                "checkpoint. The config is the preset (or --config FILE) with every --SECTION.FIELD "
                "VALUE override applied; --print_config shows it.")
    _register_eval(sub)
    add_command(sub, "generate", _build_generate,
                help="continue text prompts with a checkpoint (KV cache, sampling, adaptive "
                "depth)",
                description="Encode each prompt with the checkpoint's tokenizer, left-pad them into one "
                "batch, prefill it through a KV cache and decode one token per step; print each prompt "
                "followed by its continuation. Rows stop at <|endoftext|>. Prompt plus continuation must "
                "fit the model's context (len(prompt) + max_new_tokens - 1 <= seq_len); longer prompts are "
                "an error, never truncated silently.")
    add_command(sub, "consolidate", _build_consolidate,
                help="add the full weights (model.safetensors) to a sharded checkpoint",
                description="Read the sharded (torch.distributed.checkpoint) weights of a checkpoint, "
                "written under any number of ranks, and add them to it as model.safetensors (also "
                "listed in its manifest), so the folder is a plain config.json + model.safetensors "
                "model. Prints the file's path; does nothing when the checkpoint already has one. "
                "Eval, diagnose and generate read sharded checkpoints without this step. looplm reads a "
                "sharded folder's DCP metadata with a restricted unpickler (DCP metadata types only), but "
                "DCP is a format for your own storage: share the consolidated model.safetensors.")
    add_command(sub, "convert-train-state", _build_convert_train_state,
                help="rewrite a trusted checkpoint's pickled train_state.pt as data",
                description="Resuming (train, rl train, distill) loads train_state.pt as data only "
                "(torch.load weights_only=True) and refuses a file that holds other pickled objects, since "
                "unpickling them could run code. For a run folder you trust, this command unpickles the "
                "file once, rewrites it as tensors, numbers, strings and containers, and updates the "
                "manifest, so the run resumes. Every train_state.pt written by looplm already loads as data.")
    add_command(sub, "info", _build_info,
                help="parameter count and FLOP proxy of a config, as JSON",
                description="Print JSON with `params` (trainable, tied embeddings once) and "
                "`flops_per_token` → depth → {body, body_head} (SCSE eq. 20–21). Builds the "
                "model on the meta device, so paper-size presets cost no memory.")
    add_command(sub, "bench", _build_bench,
                help="throughput benchmarks with their targets (JSON + Markdown)",
                description="Measure, in one run: the fp32/bf16 matmul peak, training tokens/s and "
                "model FLOP utilization, bf16 speedup, loop overhead (looped at depth T vs an "
                "unshared T-block model), SCSE vs looped throughput, multi-depth evaluation vs "
                "one evaluation at the largest depth, truncated-BPTT memory, cached decoding and "
                "terminal KV bytes, and at the Huginn shape MFU, decoding tokens/s (batch 1 and 8, "
                "512 and 2,048 context, eager and compiled) and peak training memory. Each figure is "
                "a ratio or a rate from the same run. Writes FILE.json and FILE.md.")

    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _leaf_family(parser: argparse.ArgumentParser, family: str) -> list[argparse.ArgumentParser]:
    """Every leaf parser below ``parser`` whose ``_family`` is ``family`` (built as needed)."""
    out = []
    for child in subcommands(parser):
        if child.get_default("_family") == family:
            out.append(child)
        out += _leaf_family(child, family)
    return out


def _unknown_options_error(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Exit 2 naming the unknown options, the closest valid option and the commands that do take it."""
    leaf = getattr(args, "_parser", parser)
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
    msg = f"unrecognized arguments: {' '.join(extras)}"
    if flags:
        owners: list[str] = []
        family = getattr(args, "_family", None)
        if family:  # e.g. an option of another eval protocol
            top = next(a.choices[args.command] for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            owners = [p.prog for p in _leaf_family(top, family) if p is not leaf and flags[0] in option_strings(p)]
        if owners:
            msg += f" ({flags[0]} is an option of {', '.join(owners)})"
        else:
            msg += suggest(flags[0], option_strings(leaf) + (config_keys() if getattr(args, "_takes_config", False)
                                                              else []))
    leaf.error(msg)


def _command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command that ``argv``'s leading words name (``parser`` when none does)."""
    leaf = parser
    for tok in argv:
        subs = [a for a in leaf._actions if isinstance(a, argparse._SubParsersAction)]
        if tok.startswith("-") or not subs or tok not in subs[0].choices:
            break
        leaf = subs[0].choices[tok]
    return leaf


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
    if overrides and not getattr(args, "_takes_config", False):
        leaf = getattr(args, "_parser", parser)
        key = "--" + next(iter(overrides))
        leaf.error(f"{key}: {leaf.prog} takes no config overrides (--SECTION.FIELD applies to `looplm train`, "
                   f"`looplm info` and `looplm rl pretrain`){suggest(key, option_strings(leaf))}")
    args.config_overrides = overrides
    if args.command == "train" and args.out is None and not args.print_config:
        args._parser.error("the following arguments are required: --out")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `looplm info --list | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush must not raise again
        return 0
    except (ConfigError, KeyError, FileNotFoundError, ValueError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{getattr(args, '_parser', parser).prog}: error: {msg}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - surface checkpoint errors without a traceback
        from looplm.run.checkpoint import CheckpointError

        if isinstance(exc, CheckpointError):
            print(f"{getattr(args, '_parser', parser).prog}: error: {exc}", file=sys.stderr)
            return 2
        raise
