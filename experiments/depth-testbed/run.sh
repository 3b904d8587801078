#!/usr/bin/env bash
# Probe (1 seed): train a 1-block looped model on one task with the preset task-$TASK for $STEPS steps, then
# accuracy by depth x k on the held-out test instances. Usage: experiments/depth-testbed/run.sh varchain 500
# Writes probe-$TASK/{curve.json, acc.json, acc.md, acc.png}; the run folder stays in runs/ (not committed).
set -euo pipefail
TASK=${1:?task}; STEPS=${2:?steps}
HERE=$(cd "$(dirname "$0")" && pwd); OUT=$HERE/probe-$TASK; RUN=${RUN_DIR:-$HERE/runs}/$TASK
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
nice -n 10 looplm train --quiet --preset "task-$TASK" --out "$RUN" --train.steps "$STEPS" --train.eval_every 50 \
  --optim.warmup_steps 50 --train.ckpt_every 100 --train.num_threads 1
nice -n 10 looplm eval tasks --quiet --checkpoint "$RUN" --out "$OUT/acc.json" > /dev/null
python - "$RUN/metrics.jsonl" "$RUN/summary.json" "$OUT/curve.json" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
curve = [{k: r[k] for k in ("step", "val_loss", "val_acc")} for r in rows if "val_acc" in r]
summary = json.load(open(sys.argv[2]))
json.dump({"wall_s": summary["wall_s"], "params": summary["params"], "validation": curve}, open(sys.argv[3], "w"), indent=1)
PY
