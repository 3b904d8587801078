"""The ``--help`` descriptions of the ``looplm`` commands (one entry per registry line of :mod:`looplm.cli`)."""

DESCRIPTIONS: dict[str, str] = {
    'eval ppl': (
        'Perplexity at every requested loop depth from one unroll per batch (SPEC §6), token-weighted; JSON has '
        'per-depth ppl, nll, tokens, flops_per_token.'),
    'eval kv-sharing': (
        'The continuation protocol of terminal KV sharing (SPEC §6): prefill the first half of each full window '
        'into a terminal KV cache, score the second half in one pass, and compare with the full forward on the '
        'same tokens. JSON has per-depth ppl_full, ppl_terminal, sharing_penalty_pct = 100(PPL_terminal/PPL_full '
        '- 1), kv_bytes_full and kv_bytes_terminal (per sequence prefix).'),
    'eval lambada': (
        "OpenAI LAMBADA completion with the checkpoint's tokenizer: target-token PPL, target-token accuracy and "
        'exact last-word accuracy per depth (target_ppl, target_acc, exact_acc; SCSE Table 16 layout).'),
    'eval adaptive': (
        'The hidden-update stopping rule (stop when the max-token relative update < tau, at most --ceiling '
        'loops): tau calibrated on the valid split per target mean depth, test PPL and achieved depth (Table 9/10'
        ' layout), plus a real early-exit run with its speedup.'),
    'eval halting': (
        'Logit-margin halting: the smallest margin threshold keeping PPL within --tolerance of the K_max PPL on '
        'calibration windows, then a timed dynamic-batching run and the fixed-depth frontier. Writes '
        'halting.json, halting.md and halting_frontier.png into the folder of --out (default results/halting).'),
    'eval distill': (
        'Distilled prefill (LMDR Table 5 layout): each full window is cut in half; the prompt half is prefilled '
        'by the teacher at its depth R, by the teacher stopped after 3, 2 and 1 recurrences (--early-depths) and '
        'by the distilled student plus one recurrence, each into a terminal KV cache; the teacher then scores the'
        ' continuation at R with terminal KV sharing. JSON per path: ppl (first continuation token from the '
        "prefill's readout, plus the rest), ppl_first, ppl_rest, prefill_ms per batch, kv_bytes; and the uncached"
        ' full forward.'),
    'eval tasks': (
        'Exact-match accuracy of the answer tokens on the held-out instances of each difficulty k, at every loop '
        'depth T from one unroll (looplm.eval.tasks). JSON has accuracy per k and T; --out FILE.json also writes '
        'FILE.md and the heatmap FILE.png.'),
    'demo': (
        'Train the `looped` baseline and `scse` with the cpu preset on the Brown train split (SPEC §11), evaluate'
        ' both at every depth on Brown test and on held-out WikiText-2 raw test, and write results.json, '
        'results.md and ppl_vs_depth.png. Re-running skips finished training and resumes interrupted runs.'),
    'train': (
        'Train a model into --out: checkpoints under OUT/checkpoints (atomic; OUT/latest names the newest), '
        'metrics appended to OUT/metrics.jsonl, OUT/summary.json at the end. --resume continues exactly from the '
        'newest valid checkpoint. The config is the preset (or --config FILE) with every --SECTION.FIELD VALUE '
        'override applied; --print_config shows it.'),
    'generate': (
        "Encode each prompt with the checkpoint's tokenizer, left-pad them into one batch, prefill it through a "
        'KV cache and decode one token per step; print each prompt followed by its continuation. Rows stop at '
        "<|endoftext|>. Prompt plus continuation must fit the model's context (len(prompt) + max_new_tokens - 1 "
        '<= seq_len); longer prompts are an error, never truncated silently.'),
    'consolidate': (
        'Read the sharded (torch.distributed.checkpoint) weights of a checkpoint, written under any number of '
        'ranks, and add them to it as model.safetensors (also listed in its manifest), so the folder is a plain '
        "config.json + model.safetensors model. Prints the file's path; does nothing when the checkpoint already "
        'has one. Eval, diagnose and generate read sharded checkpoints without this step. looplm reads a sharded '
        "folder's DCP metadata with a restricted unpickler (DCP metadata types only), but DCP is a format for "
        'your own storage: share the consolidated model.safetensors.'),
    'convert-train-state': (
        'Resuming (train, rl train, distill) loads train_state.pt as data only (torch.load weights_only=True) and'
        ' refuses a file that holds other pickled objects, since unpickling them could run code. For a run folder'
        ' you trust, this command unpickles the file once, rewrites it as tensors, numbers, strings and '
        'containers, and updates the manifest, so the run resumes. Every train_state.pt written by looplm already'
        ' loads as data.'),
    'info': (
        'Print JSON with `params` (trainable, tied embeddings once) and `flops_per_token` → depth → {body, '
        'body_head} (SCSE eq. 20–21). Builds the model on the meta device, so paper-size presets cost no memory.'),
    'bench': (
        'Measure, in one run: the fp32/bf16 matmul peak, training tokens/s and model FLOP utilization, bf16 '
        'speedup, loop overhead (looped at depth T vs an unshared T-block model), SCSE vs looped throughput, '
        'multi-depth evaluation vs one evaluation at the largest depth, truncated-BPTT memory, cached decoding '
        'and terminal KV bytes, and at the Huginn shape MFU, decoding tokens/s (batch 1 and 8, 512 and 2,048 '
        'context, eager and compiled) and peak training memory. Each figure is a ratio or a rate from the same '
        'run. Writes FILE.json and FILE.md.'),
    'sweep': (
        'Train and evaluate every run of a sweep file, one after another,\n'
        'with an overall progress bar; resumable.\n'
        '\n'
        'sweep file format (TOML):\n'
        '\n'
        '  name = "scse-vs-looped"       # optional; default: the file name\n'
        '  seeds = [0, 1, 2]             # training seeds; default [0, 1, 2]\n'
        '  baseline = "looped"           # report baseline; default: the first variant\n'
        '\n'
        '  [base]\n'
        '  preset = "cpu"                # or config = "path/config.json"\n'
        '  "train.steps" = 400           # any config field as "section.field" = value\n'
        '\n'
        '  [variants]                    # name -> config overrides on top of the base\n'
        '  looped = {"model.rule" = "looped"}\n'
        '  scse = {"model.rule" = "scse"}\n'
        '  unshared = {"model.architecture" = "unshared", "model.n_layers" = 4}\n'
        '\n'
        '  [grid]                        # optional: each combination is a separate run\n'
        '  "optim.lr" = [1e-3, 2e-3]\n'
        '\n'
        '  [eval]\n'
        '  depths = [1, 2, 4, 8, 16, 32, 48]\n'
        '  datasets = ["brown", "wikitext2"]   # default: the training corpus\n'
        '  splits = ["test"]                   # default ["test"]\n'
        '  max_tokens = 16384                  # default: the whole split\n'
        '  tag = "v1"                          # default ""\n'
        '  batch_size = 16                     # windows per forward; default 16\n'
        '  stride = 64                         # optional sliding-window stride; default: non-overlapping\n'
        '  device = "auto"                     # cpu, cuda or auto; default auto\n'
        '  diagnose = true                     # optional: forcing bias + gain (shared models)\n'
        '  lambada = {max_examples = 500}      # optional: LAMBADA completion (true or kwargs)\n'
        '\n'
        'The grid is variants x seeds x grid fields. Each run trains into OUT/runs/<run-id>/\n'
        '(<variant>[-<field>=<value>...]-s<seed>); evaluations go to OUT/results.db and a report\n'
        'to OUT/report/. Re-running skips finished runs (training complete, evaluations stored)\n'
        'and resumes killed ones from their newest valid checkpoint.\n'
        '\n'
        "In parallel (several processes, or a scheduler's array jobs), into one results DB:\n"
        '  looplm sweep FILE --out OUT --shard 0/4 & ... & looplm sweep FILE --out OUT --shard 3/4\n'
        '  looplm sweep FILE --out OUT --plan      # one `looplm sweep FILE --out OUT --only RUN_ID` per pending run\n'
        '  looplm report --db OUT/results.db       # when all are done\n'
        ''),
    'report': (
        'Aggregate a results database (written by `looplm sweep`) into report.md, report.json and\n'
        'PNG plots in --out:\n'
        '\n'
        '  - per dataset/split and metric: rows = variants, columns = loop depths T,\n'
        '    cells "mean ± std" over seeds (sample std);\n'
        '  - paired deltas variant - baseline matched by (seed, depth), cells\n'
        '    "mean ± 95% t half-width [95% paired-bootstrap percentile interval]"\n'
        '    (10,000 resamples, fixed seed: deterministic);\n'
        '  - parameter count and FLOP proxy (SCSE eq. 20-21) per variant;\n'
        '  - PPL vs loop depth on a log2 axis per dataset/split, seed means with ±std bands.\n'
        ''),
    'gradcheck': (
        'Gradient estimators of a looped checkpoint (LMDR §3.1, A.2) on the first --batches windows of a split '
        '(dropout off): the terminal-CE gradient of full BPTT at depth R against TBPTT-b (the last b of the R '
        'recurrences) and endpoint / Neumann-b (R recurrences without gradient, then b with gradient from the '
        'detached endpoint; the loss read at R + b), for each b of --steps: cosine of the batch-summed gradients '
        '(and the per-batch min), per parameter group (embeddings/readout, prelude, core, rule, coda) and '
        'overall, with the norm ratio, the CEs and the endpoint residual. Prints the Markdown table (--json: the '
        'JSON); --out writes both.'),
    'diagnose': (
        "Mechanism diagnostics (SPEC §7) of a looped checkpoint, in the model's own anchor coordinates, averaged "
        'over the first --batches windows of a split (dropout off, float64): forcing bias b_t = T_t(0; e), raw '
        'pre-mask response, energy ratio R_t and anchor energy at --steps; random-direction gain (eps 1e-3, 4 '
        'seeded directions) at the same steps; anchor-start rollouts (delta_0 = 0) to --depth with their cosine '
        "to the forcing ray t*b_0(e); and the dose response to the rule's injection scaled by 0, 0.5, 1, 2; per-"
        'loop hidden-state scale (token RMS percentiles, radial-gradient fraction of the immediate readout loss, '
        'final radial derivative g_K, radial increment) over --scale-loops loops; the visit alignment kappa_R of '
        "the core's weight gradients at that depth; and token convergence along the --depth unroll. Prints the "
        'Markdown tables (SCSE Tables 3 and 22 layout, then scale, alignment and convergence; --json: the JSON), '
        'writes the JSON to --out and the Markdown and three plots (R_t bars, Figure 5 style; 2-D PCA of '
        'rollouts, Figure 4 style; per-loop RMS and the convergence curve) to --plots-dir.'),
    'distill': (
        'Distilled prefill (Looped Models Done Right §3.2, §5.5): train a student S_psi (default 2 blocks '
        "initialized from the teacher's core) that maps the teacher's prelude output e to its endpoint z^R, with "
        'the loss of eq. 4: ||z_hat - z^R||_F^2 / (N d sigma_T^2) + token-mean KL(p_t || p_hat_t), each term '
        'weighted (0 = off). The teacher is frozen; data are windows of its training corpus; the default budget '
        'is a quarter of its training tokens. Checkpoints (atomic, resumable) go to --out, by default student/ '
        "next to the teacher's run; they record the teacher's weights fingerprint, and loading the student with "
        'another teacher is an error. Then: `looplm generate --prefill distilled`, `looplm eval distill`. '
        'Config fields: --distill.FIELD and --optim.FIELD.'),
    'export': (
        'Write a checkpoint (or run directory) as a Hugging Face folder: config.json (model_type looplm, '
        'auto_map, the looplm config), model.safetensors, generation_config.json, tokenizer.json + '
        'tokenizer_config.json (PreTrainedTokenizerFast) and the remote code (generated from looplm: loads '
        'without it). Load it with LoopLMForCausalLM.from_pretrained / AutoModelForCausalLM.from_pretrained; '
        'every looplm command also accepts the folder as --checkpoint. Needs looplm[hf].'),
    'lm-eval': (
        "Run lm-evaluation-harness tasks on a checkpoint (or export) through looplm's harness backend (model name"
        " 'looplm'), at every depth of --depths from one unroll per batch: the harness runs once per depth on "
        'memoized per-depth scores. Prints one table per depth; --out writes the JSON (harness results per '
        'depth), --db stores every task metric per depth in a looplm results database (protocol lm_eval). Needs '
        'looplm[lmeval].'),
    'rl pretrain': (
        'Train a small looped model (default: huginn_linear 1 + 2xR + 1, d = 64, PLN-5 depths, TBPTT-4; '
        "`--print_config` shows it) on the task's token stream with looplm's trainer: checkpoints, metrics.jsonl "
        'and summary.json in --out, plus task.json (the task it learned, read by `looplm rl train` and `looplm rl'
        ' eval`). The held-out problems never occur in the stream. --resume continues exactly; any config field '
        'is overridable as --SECTION.FIELD VALUE.'),
    'rl train': (
        'Dr. GRPO (group-relative advantages without std normalization, no per-response length normalization, one'
        ' policy update per batch) from --checkpoint on its task: every update samples --rl.group_size responses'
        ' for each of --rl.prompts_per_update training problems at depth --rl.depth with the KV cache, saving each '
        "position's depth-R state, rewards them with --rl.reward and updates with --rl.method: bptt (re-score "
        'through all R recurrences with gradient), recompute (R recurrences without gradient, then '
        '--rl.neumann_steps b with) or reuse (b recurrences from the saved rollout states, no replay). Reports '
        "per update the scoring + backward time, reward and, every --rl.compare_every updates, all three methods' "
        'times and gradient cosines on the same batch; pass@1 / pass@k on the held-out problems before and '
        'after. Writes metrics.jsonl, results.json and rl.png into --out, with atomic checkpoints (--resume '
        'continues exactly). Config fields: --rl.FIELD and --optim.FIELD (AdamW; RL defaults: no weight decay, '
        'betas 0.9/0.98, a constant lr after the warm-up).'),
    'rl eval': (
        'Sample --samples responses per held-out problem at depth --depth and report pass@1, pass@n (unbiased '
        'estimator) and greedy accuracy; prints the line (--json: the JSON), --out also writes it.'),
    'import huginn': (
        'Import Huginn-0125 (tomg-group-umd/huginn-0125, RavenForCausalLM) from its downloaded Hugging Face '
        'folder SRC (config.json, safetensors shards, tokenizer.json) as a looplm checkpoint in --out: every '
        'tensor mapped (rule huginn_linear, 2 prelude / 4 core / 2 coda pre_post blocks, interleaved RoPE checked'
        ' against the stored freqs_cis, tied head), loading strict (an unknown or missing tensor or config key is'
        " an error naming it), the tokenizer copied, provenance in import.json. The checkpoint's depth is "
        'mean_recurrence (32). Then `looplm eval ppl|kv-sharing|halting`, `looplm diagnose` and `looplm generate`'
        ' take --checkpoint OUT. Layout: docs/importers-layout.md; usage and parity: docs/importers.md.'),
    'import ouro': (
        'Import Ouro (ByteDance/Ouro-1.4B or Ouro-2.6B, OuroForCausalLM) from its downloaded Hugging Face folder '
        'SRC (config.json, safetensors shards, tokenizer.json) as a looplm checkpoint in --out: every tensor '
        'mapped (rule plain, every layer in the core, sandwich blocks, rotate-half RoPE, GQA, final norm after '
        'every step, exit gate, untied head), loading strict (an unknown or missing tensor or config key is an '
        "error naming it), the tokenizer copied, provenance in import.json. The checkpoint's depth is "
        "total_ut_steps (4); Ouro's threshold rule is `--exit exit_cdf --exit-tau early_exit_threshold` in looplm"
        ' generate. Layout: docs/importers-layout.md; usage and parity: docs/importers.md.'),
}
#: help (``{}``: the member commands) and description of each command group
GROUPS: dict[str, tuple[str, str]] = {
    'eval': ('evaluate a checkpoint: {} (one subcommand each)',
            ('Evaluate a checkpoint with one protocol; each protocol is its own subcommand with only its own options '
            '(`looplm eval PROTOCOL --help`). Prints the Markdown report (--json: the JSON); --out FILE.json also '
            'writes the JSON and FILE.md.')),
    'rl': ('RL post-training with rollout-state reuse (LMDR §3.1, §5.4): {} (one subcommand each)',
            ('RL post-training of looped models on a verifiable synthetic task (multi-digit addition), LMDR §3.1 '
            "'Post-training' and §5.4 / Table 4: `looplm rl pretrain` trains the base model, `looplm rl train` runs "
            'Dr. GRPO with one of three update methods, `looplm rl eval` measures pass@k. `looplm rl COMMAND --help` '
            'for each.')),
    'import': ('import a published looped model (Huginn-0125, Ouro) as a looplm checkpoint',
            ('Import a published looped language model from its downloaded Hugging Face folder as a looplm checkpoint,'
            ' with numerical parity to the original (docs/importers.md): `looplm import huginn SRC --out DIR`, '
            '`looplm import ouro SRC --out DIR`.')),
}
