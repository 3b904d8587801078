"""The ``--help`` descriptions of the ``looplm`` commands (what each writes, an example); each --help
ends with a pointer to its longer explanation in docs/commands.md."""

DESCRIPTIONS: dict[str, str] = {
    "eval kv-sharing": "Per depth (SPEC §6): ppl_full, ppl_terminal, sharing_penalty_pct and KV bytes.",
    "eval halting": "Writes halting.json, halting.md and halting_frontier.png into the folder of --out (default "
                    "results/halting).",
    "eval distill": "Prefills by the teacher, the teacher stopped early (--early-depths) and the student, each "
                    "into a terminal KV cache (LMDR Table 5).",
    "eval tasks": "--out FILE.json also writes FILE.md and the heatmap FILE.png.",
    "demo": "Writes results.json, results.md and ppl_vs_depth.png into --out; re-running skips finished training "
            "and resumes interrupted runs.",
    "train": "Checkpoints go to OUT/checkpoints (OUT/latest names the newest), metrics to OUT/metrics.jsonl, "
             "OUT/summary.json at the end; --resume continues exactly. Example: looplm train --preset cpu --out "
             "runs/a --train.steps 400 (--print_config shows the config).",
    "generate": "Prints each prompt and its continuation (--out: also as JSON). Example: looplm generate "
                "--checkpoint runs/a --prompt 'The jury' --max-new-tokens 20.",
    "consolidate": "Adds model.safetensors (and its manifest entry) to a checkpoint written sharded; prints its "
                   "path.",
    "info": "Prints params and flops_per_token per depth (SCSE eq. 20–21); builds the model on the meta device. "
            "Example: looplm info --preset scse-22m --depths 8,48.",
    "bench": "Throughput, MFU, loop overhead, decoding and memory figures, each a ratio or rate from the same run; "
             "writes FILE.json and FILE.md.",
    "sweep": """Train and evaluate every run of a sweep file; resumable. Example (the whole format:
`python -m pydoc looplm.apps.sweep`):

  [base]
  preset = "cpu"                 # or config = "path/config.json"
  "train.steps" = 400            # any config field as "section.field" = value

  [variants]                     # name -> config overrides on top of the base
  looped = {"model.rule" = "looped"}
  scse = {"model.rule" = "scse"}

Runs train into OUT/runs/<run-id>/, evaluations go to OUT/results.db, the report to OUT/report/.
In parallel: looplm sweep FILE --out OUT --shard I/N (or --plan), then looplm report --db OUT/results.db.
""",
    "report": "Writes report.md, report.json and PNG plots to --out: mean ± std over seeds per variant and depth, "
              "paired deltas against the baseline, params and FLOPs.",
    "diagnose": "Writes the JSON to --out and the Markdown and plots to --plots-dir (SPEC §7).",
    "distill": "Trains a student S_psi mapping the teacher's e to z^R (LMDR eq. 4) into --out (default: student/ "
               "next to the teacher's run); then `looplm generate --prefill distilled`. Config fields: "
               "--distill.FIELD and --optim.FIELD.",
    "export": "Writes config.json, model.safetensors, the tokenizer and the remote code; every looplm command "
              "takes the folder as --checkpoint. Needs looplm[hf].",
    "lm-eval": "Runs the harness once per depth of --depths on memoized per-depth scores; --db stores every "
               "metric (protocol lm_eval). Needs looplm[lmeval].",
    "rl pretrain": "Trains the base model on the task's token stream into --out, with task.json for `looplm rl "
                   "train` and `looplm rl eval`.",
    "rl train": "Writes metrics.jsonl, results.json and rl.png into --out, with atomic checkpoints (--resume "
                "continues exactly). Config fields: --rl.FIELD and --optim.FIELD (AdamW; RL defaults: no weight "
                "decay, betas 0.9/0.98, a constant lr after the warm-up).",
    "import huginn": "Writes a looplm checkpoint (depth mean_recurrence) into --out; then e.g. looplm eval ppl "
                     "--checkpoint OUT. Layout and parity: docs/importers.md.",
    "import ouro": "Writes a looplm checkpoint (depth total_ut_steps) into --out; Ouro's exit rule is `--exit "
                   "exit_cdf` in looplm generate. Layout and parity: docs/importers.md.",
}
#: help (``{}``: the member commands) and description of each command group
GROUPS: dict[str, tuple[str, str]] = {
    "eval": ("evaluate a checkpoint: {} (one subcommand each)", "Each protocol prints its Markdown report (--json: "
             "the JSON); --out FILE.json also writes the JSON and FILE.md."),
    "rl": ("RL post-training with rollout-state reuse (LMDR §3.1, §5.4): {} (one subcommand each)",
           "`looplm rl pretrain` trains the base model, `rl train` runs Dr. GRPO, `rl eval` measures pass@k."),
    "import": ("import a published looped model (Huginn-0125, Ouro) as a looplm checkpoint",
               "Example: looplm import huginn SRC --out DIR (docs/importers.md)."),
}
