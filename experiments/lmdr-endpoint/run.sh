#!/usr/bin/env bash
# Gradient cosines of TBPTT-b and endpoint (Neumann-b) gradients against full BPTT (issue 12 §1).
# Three 300-step Huginn-style CPU models at fixed depth R = 5, one per training estimator, and one
# 1-step run (≈ initialization); then `looplm gradcheck` on the checkpoints at steps 200 and 300 (the
# trainer keeps the newest two) and `looplm eval ppl` at R = 1..64. One process, one thread (a shared
# 2-core machine). Run from the repository root with looplm on PATH; then
# `python experiments/lmdr-endpoint/summarize.py` writes results.md.
set -euo pipefail
export OMP_NUM_THREADS=1
EXP=experiments/lmdr-endpoint
RUNS=$EXP/runs            # not committed (experiments/*/runs/ is ignored)
COMMON=(--preset huginn-cpu --quiet --depth.sampler fixed --depth.depth 5 --train.num_threads 1
        --train.steps 300 --train.ckpt_every 100 --train.eval_every 100 --train.eval_depth 5)
declare -A EST=([bptt]="--train.gradient.kind bptt" [tbptt2]="--train.gradient.kind tbptt --train.gradient.steps 2"
                [endpoint2]="--train.gradient.kind endpoint --train.gradient.steps 2")
mkdir -p $EXP/results
for v in bptt tbptt2 endpoint2; do
  [ -f $RUNS/$v/summary.json ] || looplm train --out $RUNS/$v --name $v "${COMMON[@]}" ${EST[$v]}
  cp $RUNS/$v/summary.json $EXP/results/train_$v.json
  for s in 200 300; do
    looplm gradcheck --checkpoint $RUNS/$v/checkpoints/step-000$s --depth 5 --steps 1,2,4,8 \
      --batches 4 --batch-size 8 --quiet --out $EXP/results/gradcheck_${v}_step$s.json > /dev/null
  done
  looplm eval ppl --checkpoint $RUNS/$v --depths 1,2,3,4,5,6,7,8,12,16,32,64 --max-tokens 8192 --quiet \
    --out $EXP/results/ppl_$v.json > /dev/null
done
[ -f $RUNS/init/summary.json ] || looplm train --out $RUNS/init --name init "${COMMON[@]}" --train.steps 1 \
  --train.eval_every 0 > /dev/null
looplm gradcheck --checkpoint $RUNS/init --depth 5 --steps 1,2,4,8 --batches 4 --batch-size 8 --quiet \
  --out $EXP/results/gradcheck_init_step1.json > /dev/null
