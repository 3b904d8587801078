#!/usr/bin/env bash
# Distilled prefill at CPU scale (issue 12 §3; LMDR §3.2, §5.5, Table 5). Two Huginn-style teachers on Brown
# (preset huginn-cpu: huginn_linear, 1 + 2×R + 1 blocks, d = 192, 4.03M parameters):
#   learned  LMDR's learned depth prior (inv_ppl reward with the advantage scale; not LMDR's recipe, which is
#            preset lmdr: docs/presets.md), TBPTT b = 2, 1,000 steps × 16×128 tokens (the lmdr-ablation variant
#            learned_tbptt2, seed 0); R = 5
#   fixed5   fixed depth R = 5, full BPTT, 1,000 steps (the lmdr-ablation variant fixed5_bptt, seed 0)
# Per teacher: a 2-block student initialized from its core, trained with eq. 4 (hidden + KL) on a quarter
# of the teacher's tokens (250 steps × 16×128, the default budget); for `learned` also a randomly
# initialized student (LMDR's init ablation). Then `looplm eval distill` on Brown valid, Brown test and
# WikiText-2 test (first 65,536 tokens each; 64-token prompts, 64-token continuations), and the prefill
# latency of every path at 512 / 2,048 tokens (latency.py, the bench's prefill case).
# One process at a time, one thread (a shared 2-core machine). Run from the repository root with looplm on
# PATH; then `python experiments/lmdr-distill/summarize.py` writes results.md and the plots.
set -euo pipefail
export OMP_NUM_THREADS=1
EXP=experiments/lmdr-distill
RUNS=$EXP/runs            # not committed (experiments/*/runs/ is ignored)
RES=$EXP/results
mkdir -p $RES
COMMON=(--preset huginn-cpu --quiet --train.steps 1000 --optim.warmup_steps 50 --train.eval_every 100
        --train.ckpt_every 100 --train.num_threads 1)
declare -A TEACHER=(
  [learned]="--depth.sampler learned --depth.mean 5.0 --depth.cap 64 --depth.reward inv_ppl --depth.scale true
             --depth.scale_window 8 --train.gradient.kind tbptt --train.gradient.steps 2"
  [fixed5]="--depth.sampler fixed --depth.depth 5 --train.gradient.kind bptt")
for t in learned fixed5; do
  [ -f $RUNS/$t/summary.json ] || looplm train --out $RUNS/$t --name $t "${COMMON[@]}" ${TEACHER[$t]}
  cp $RUNS/$t/summary.json $RES/train_$t.json
  looplm eval ppl --checkpoint $RUNS/$t --depths 1,2,3,4,5,6,8,16 --split valid --quiet --out $RES/ppl_$t.json > /dev/null
  # the student: 2 blocks from the teacher core, hidden + KL, a quarter of the teacher's tokens
  [ -f $RUNS/$t/student/summary.json ] || looplm distill --checkpoint $RUNS/$t --distill.num_threads 1 --quiet > /dev/null
  cp $RUNS/$t/student/summary.json $RES/distill_$t.json
  cp $RUNS/$t/student/metrics.jsonl $RES/distill_${t}_metrics.jsonl
done
# LMDR's init ablation on the LMDR-style teacher: a randomly initialized student, same loss and budget
t=learned
[ -f $RUNS/$t/student-random/summary.json ] || looplm distill --checkpoint $RUNS/$t --out $RUNS/$t/student-random \
  --distill.init random --distill.num_threads 1 --quiet > /dev/null
cp $RUNS/$t/student-random/summary.json $RES/distill_${t}_random.json
cp $RUNS/$t/student-random/metrics.jsonl $RES/distill_${t}_random_metrics.jsonl
for t in learned fixed5; do
  for ds in "brown valid" "brown test" "wikitext2 test"; do
    set -- $ds
    looplm eval distill --checkpoint $RUNS/$t --dataset $1 --split $2 --max-tokens 65536 --quiet \
      --out $RES/eval_${t}_$1_$2.json > /dev/null
    if [ $t = learned ]; then
      looplm eval distill --checkpoint $RUNS/$t --student $RUNS/$t/student-random --dataset $1 --split $2 \
        --max-tokens 65536 --early-depths 1 --quiet --out $RES/eval_${t}_random_$1_$2.json > /dev/null
    fi
  done
done
python $EXP/latency.py --out $RES/latency.json
looplm generate --checkpoint $RUNS/learned --prefill distilled --prompt "The jury said that the city" \
  --max-new-tokens 24 --out $RES/generate_learned_distilled.json
looplm generate --checkpoint $RUNS/learned --kv-cache terminal --prompt "The jury said that the city" \
  --max-new-tokens 24 --out $RES/generate_learned_teacher.json
