"""The ``looplm import`` subcommand (``looplm import huginn SRC --out DIR``, ``looplm import ouro SRC --out DIR``);
registered by ``looplm.cli`` (``COMMAND_MODULES``). Parsing only: the options are generated from
:func:`looplm.importers.huginn.import_huginn` and :func:`looplm.importers.ouro.import_ouro` (names, defaults
and the docstrings' ``Args:`` help); the work is done there."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_DESCRIPTION = {
    "huginn": "Import Huginn-0125 (tomg-group-umd/huginn-0125, RavenForCausalLM) from its downloaded Hugging Face "
    "folder SRC (config.json, safetensors shards, tokenizer.json) as a looplm checkpoint in --out: every tensor "
    "mapped (rule huginn_linear, 2 prelude / 4 core / 2 coda pre_post blocks, interleaved RoPE checked against "
    "the stored freqs_cis, tied head), loading strict (an unknown or missing tensor or config key is an error "
    "naming it), the tokenizer copied, provenance in import.json. The checkpoint's depth is mean_recurrence "
    "(32). Then `looplm eval ppl|kv-sharing|halting`, `looplm diagnose` and `looplm generate` take --checkpoint "
    "OUT. Layout: docs/importers-layout.md; usage and parity: docs/importers.md.",
    "ouro": "Import Ouro (ByteDance/Ouro-1.4B or Ouro-2.6B, OuroForCausalLM) from its downloaded Hugging Face "
    "folder SRC (config.json, safetensors shards, tokenizer.json) as a looplm checkpoint in --out: every tensor "
    "mapped (rule plain, every layer in the core, sandwich blocks, rotate-half RoPE, GQA, final norm after every "
    "step, exit gate, untied head), loading strict (an unknown or missing tensor or config key is an error "
    "naming it), the tokenizer copied, provenance in import.json. The checkpoint's depth is total_ut_steps (4); "
    "Ouro's threshold rule is `--exit exit_cdf --exit-tau early_exit_threshold` in looplm generate. Layout: "
    "docs/importers-layout.md; usage and parity: docs/importers.md.",
}
_HELP = {"huginn": "Huginn-0125 (tomg-group-umd/huginn-0125)", "ouro": "Ouro (ByteDance/Ouro-1.4B, Ouro-2.6B)"}


def cmd_import(args: argparse.Namespace) -> int:
    from looplm.cliutil import call_with_options, prepare_out_dir
    from looplm.importers import get_importer
    from looplm.importers.common import check_out

    check_out(args.out)  # before any work: no checkpoint there yet, and a writable folder
    prepare_out_dir(args.out, "--out")
    summary = call_with_options(get_importer(args.importer), args, args.src, args.out, progress=not args.quiet)
    print(json.dumps(summary, indent=2))
    print(f"next: looplm eval ppl --checkpoint {args.out}  (or diagnose, eval kv-sharing, eval halting, generate)",
          file=sys.stderr)
    return 0


def _builder(name: str):
    def build(p: argparse.ArgumentParser) -> None:
        from looplm.cli import out_dir, positive_int
        from looplm.cliutil import Opt, add_function_options
        from looplm.importers import get_importer
        from looplm.importers.common import STORE_DTYPES

        p.add_argument("src", type=Path, metavar="SRC", help="the downloaded Hugging Face folder")
        p.add_argument("--out", type=out_dir, required=True, metavar="DIR",
                       help="run folder to write (DIR/latest, DIR/checkpoints/step-000000); must not hold a checkpoint")
        opts = {"seq_len": Opt(type=positive_int, metavar="N"),
                "dtype": Opt(choices=STORE_DTYPES)}
        if name == "huginn":
            from looplm.importers.huginn import INITIAL_STATES

            opts["initial_state"] = Opt(choices=INITIAL_STATES)
            opts["rope_tolerance"] = Opt(type=float, metavar="X")
        add_function_options(p, get_importer(name), opts)
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(func=cmd_import, importer=name)

    return build


def register(sub) -> None:
    """Add ``import`` (with one subcommand per importer) to the ``looplm`` subparsers."""
    from looplm.cliutil import add_command, lazy_subparsers

    def build(p: argparse.ArgumentParser) -> None:
        from looplm.importers import IMPORTERS

        kinds = lazy_subparsers(p, dest="importer_kind", required=True, metavar="MODEL")
        for name in IMPORTERS:
            add_command(kinds, name, _builder(name), help=_HELP[name], description=_DESCRIPTION[name])

    add_command(sub, "import", build,
                help="import a published looped model (Huginn-0125, Ouro) as a looplm checkpoint",
                description="Import a published looped language model from its downloaded Hugging Face folder as "
                "a looplm checkpoint, with numerical parity to the original (docs/importers.md): "
                "`looplm import huginn SRC --out DIR`, `looplm import ouro SRC --out DIR`.")
