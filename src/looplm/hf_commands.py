"""The ``looplm export`` and ``looplm lm-eval`` subcommands; registered by ``looplm.cli``
(``COMMAND_MODULES``). Parsing only: the work is in :mod:`looplm.hf.export` and
:mod:`looplm.hf.harness`, imported when a command runs (transformers / lm-eval are optional). This
module lives outside :mod:`looplm.hf` because importing that package imports transformers (to register
the Auto classes), which every ``looplm`` invocation would then pay for."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _depths(text: str) -> list[int]:
    from looplm.cli import parse_depths

    return parse_depths(text.replace(";", ","))


def _need(module: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(f"needs the {module} package: pip install 'looplm[{extra}]'") from None


def cmd_export(args: argparse.Namespace) -> int:
    from looplm.cliutil import prepare_out_dir

    _need("transformers", "hf")
    prepare_out_dir(args.out, "--out")  # before any work (export_checkpoint refuses a non-empty one first thing)
    from looplm.hf.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, num_steps=args.num_steps, kv_cache=args.kv_cache,
                            device=args.device, overwrite=args.overwrite)
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained; "
          "trust_remote_code=True works without importing looplm)")
    return 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    from looplm.cliutil import prepare_out_file
    from looplm.finite import write_json_markdown

    _need("lm_eval", "lmeval")
    if args.out:  # before any work
        prepare_out_file(args.out, "--out", [args.out.with_suffix(".md")])
    if args.db:
        prepare_out_file(args.db, "--db")
    from looplm.hf.harness import LOCAL_TASKS, evaluate_harness

    try:
        res = evaluate_harness(args.checkpoint, tasks=args.tasks.split(","), depths=args.depths,
                               include_path=args.include_path, num_fewshot=args.num_fewshot, limit=args.limit,
                               batch_size=args.batch_size, device=args.device, db=args.db, tag=args.tag,
                               kv_cache=args.kv_cache, seed=args.seed, include_defaults=not args.only_include_path,
                               bootstrap_iters=args.bootstrap_iters)
    except OSError as exc:  # datasets / requests / the hub each raise their own ConnectionError
        if not any(c.__name__ == "ConnectionError" for c in type(exc).__mro__):
            raise
        raise ValueError(f"--tasks {args.tasks}: the harness could not download the task data "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); offline, "
                         f"use the tasks over the data folder: --tasks {','.join(LOCAL_TASKS)}") from None
    print(res["markdown"])
    if args.out:
        plain = json.loads(json.dumps({k: v for k, v in res.items() if k != "markdown"}, default=str))  # numpy → JSON
        write_json_markdown(plain, args.out, markdown=res["markdown"])
        print(f"wrote {args.out}")
    if args.db:
        print(f"stored {res['stored']} evaluations in {args.db}")
    return 0


def register(sub) -> None:
    """Add ``export`` and ``lm-eval`` to the ``looplm`` subparsers."""
    from looplm.cli import DEPTHS_HELP, out_dir, out_file, positive_int

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face folder (transformers, AutoTokenizer)",
                       description="Write a checkpoint (or run directory) as a Hugging Face folder: config.json "
                       "(model_type looplm, auto_map, the looplm config), model.safetensors, generation_config.json, "
                       "tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast) and the remote code (generated from looplm: loads without it). "
                       "Load it with LoopLMForCausalLM.from_pretrained / AutoModelForCausalLM.from_pretrained; every "
                       "looplm command also accepts the folder as --checkpoint. Needs looplm[hf].")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run directory")
    p.add_argument("--out", type=out_dir, required=True, help="the Hugging Face folder to write")
    p.add_argument("--num-steps", type=positive_int, default=None, metavar="T",
                   help="default recurrence depth of the exported model (default: the checkpoint's train.eval_depth)")
    p.add_argument("--kv-cache", choices=["per_visit", "terminal"], default="per_visit",
                   help="KV cache layout generate() uses by default (default per_visit)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (files of the same names are replaced, old weight files removed)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.set_defaults(func=cmd_export, _parser=p)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks at one or several loop depths",
                       description="Run lm-evaluation-harness tasks on a checkpoint (or export) through looplm's "
                       "harness backend (model name 'looplm'), at every depth of --depths from one unroll per "
                       "batch: the harness runs once per depth on memoized per-depth scores. Prints one table per "
                       "depth; --out writes the JSON (harness results per depth), --db stores every task metric "
                       "per depth in a looplm results database (protocol lm_eval). Needs looplm[lmeval].")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint, run directory or export folder")
    p.add_argument("--tasks", required=True,
                   help="comma-separated harness task names; looplm_lambada and looplm_wikitext run offline over "
                   "the data folder (lambada/lambada_test.jsonl, wikitext-2-raw/wiki.test.raw; lambada_openai's "
                   "format, WikiText articles undetokenized)")
    p.add_argument("--depths", type=_depths, default=None, metavar="T,T,...",
                   help=DEPTHS_HELP + " (default: train.eval_depth)")
    p.add_argument("--include-path", default=None, metavar="DIR", help="a folder of extra task YAMLs")
    p.add_argument("--only-include-path", action="store_true",
                   help="look tasks up in --include-path only (skips indexing the harness's own tasks: faster)")
    p.add_argument("--bootstrap-iters", type=int, default=1000, metavar="N",
                   help="bootstrap resamples for the standard errors of non-mean metrics (0: none; default 1000)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="few-shot examples (default: the task's)")
    p.add_argument("--limit", type=float, default=None, metavar="N",
                   help="documents per task, or a fraction of each task if < 1 (default: all)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="requests per forward (default 16)")
    p.add_argument("--kv-cache", choices=["per_visit", "terminal"], default=None,
                   help="generate_until: KV cache layout (default: an export's config.json kv_cache, else per_visit)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the harness's samplers (default 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--db", type=out_file, default=None, metavar="FILE",
                   help="a looplm results database to add the results to")
    p.add_argument("--tag", default="", help="free label of the stored evaluations")
    p.add_argument("--out", type=out_file, default=None, metavar="FILE.json", help="write the JSON here (and FILE.md)")
    p.set_defaults(func=cmd_lm_eval, _parser=p)
