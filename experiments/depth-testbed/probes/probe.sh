#!/usr/bin/env bash
# Learning-curve probe (1 seed): train preset task-$TASK for $STEPS steps with extra overrides, then accuracy by
# depth x k on the VALID held-out instances (never test). Usage: probes/probe.sh NAME TASK STEPS [--key value ...]
# Writes probes/NAME/{args.txt, curve.json, acc.json, acc.md, acc.png}; the run folder stays in runs/ (not committed).
set -euo pipefail
NAME=${1:?name}; TASK=${2:?task}; STEPS=${3:?steps}; shift 3
HERE=$(cd "$(dirname "$0")" && pwd); OUT=$HERE/$NAME; RUN=${RUN_DIR:-$HERE/../runs}/probe-$NAME
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
echo "$TASK $STEPS $*" > "$OUT/args.txt"
nice -n 10 looplm train --quiet --preset "task-$TASK" --out "$RUN" --train.steps "$STEPS" --train.ckpt_every 250 \
  --train.num_threads 1 "$@"
nice -n 10 looplm eval tasks --quiet --checkpoint "$RUN" --split valid --out "$OUT/acc.json" > /dev/null
python - "$RUN/metrics.jsonl" "$RUN/summary.json" "$OUT/curve.json" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
curve = [{k: r[k] for k in ("step", "val_loss", "val_acc")} for r in rows if "val_acc" in r]
summary = json.load(open(sys.argv[2]))
json.dump({"wall_s": summary["wall_s"], "params": summary["params"], "validation": curve}, open(sys.argv[3], "w"), indent=1)
PY
