#!/usr/bin/env bash
# RL post-training with rollout-state reuse at CPU scale (issue 12 §2; LMDR §3.1, §5.4, Table 4).
# A 0.28M-parameter Huginn-style looped model pretrained on 3-digit addition, then Dr. GRPO at R = 6 with
# three update methods (full BPTT, recompute + Neumann-4, reuse + Neumann-4) x 3 seeds. One process,
# one thread (a shared 2-core machine). Run from the repository root with looplm on PATH; resumes
# where it stopped. Then `python experiments/lmdr-rl/summarize.py` writes results.md and the plots.
set -euo pipefail
export OMP_NUM_THREADS=1
EXP=experiments/lmdr-rl
RUNS=$EXP/runs            # not committed (experiments/*/runs/ is ignored)
BASE=$RUNS/base
mkdir -p $EXP/results
if [ ! -f $BASE/summary.json ]; then
  if [ -d $BASE/checkpoints ]; then looplm rl pretrain --out $BASE --resume --quiet; else looplm rl pretrain --out $BASE --quiet; fi
fi
cp $BASE/summary.json $EXP/results/pretrain_summary.json
[ -f $EXP/results/base_eval.json ] || looplm rl eval --checkpoint $BASE --problems 500 --samples 8 --out $EXP/results/base_eval.json --quiet
COMMON=(--rl.depth 6 --rl.neumann_steps 4 --rl.group_size 16 --rl.prompts_per_update 8 --rl.updates ${UPDATES:-300}
        --optim.lr ${LR:-5e-5} --optim.warmup_steps 10 --rl.compare_every 10 --rl.eval_problems 500 --rl.eval_samples 8
        --quiet)
for seed in ${SEEDS:-0 1 2}; do
  for method in ${METHODS:-bptt recompute reuse}; do
    out=$RUNS/$method-s$seed
    if [ ! -f $out/results.json ]; then
      if [ -d $out/checkpoints ]; then looplm rl train --out $out --resume --quiet > /dev/null
      else looplm rl train --checkpoint $BASE --out $out --rl.method $method --rl.seed $seed "${COMMON[@]}" > /dev/null; fi
    fi
    cp $out/results.json $EXP/results/$method-s$seed.json
    cp $out/metrics.jsonl $EXP/results/$method-s$seed.metrics.jsonl
  done
done
