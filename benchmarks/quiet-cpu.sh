#!/usr/bin/env bash
# The CPU timings of issue 28 that need a quiet machine, in one run (33 min on the 2-core machine of
# results/quiet-cpu-2core-*, before every quarter of a round lasted >= 1 s: by that run's per-call times about
# 3 min more per bench now, an estimate; start it before any sweep, and run nothing else meanwhile): two
# `looplm bench` runs and their agreement (§3: within 5% on every ratio), then greedy decoding side by side with
# Huginn's own modeling file (§1: batch 1 >= 3x Huginn).
# Usage: benchmarks/quiet-cpu.sh [NAME]   (default NAME: quiet-cpu-2core; writes benchmarks/results/NAME-*)
# Needs: the project's .venv (make install); network access to the package index once, for transformers
# 4.51.3 (Huginn's file does not run with transformers 5) into /tmp/tf451; Huginn's raven_modeling_minimal.py
# and raven_config_minimal.py (seal-rg/recurrent-pretraining at 59e0b69, recpre/) in $HUGINN_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-quiet-cpu-2core}
OUT=benchmarks/results/$NAME
PY=${PYTHON:-.venv/bin/python}
HUGINN_DIR=${HUGINN_DIR:-/tmp/huginn}
[ -f "$HUGINN_DIR/raven_modeling_minimal.py" ] || { echo "quiet-cpu: no $HUGINN_DIR/raven_modeling_minimal.py" >&2; exit 2; }
[ -d /tmp/tf451/transformers ] || "$PY" -m pip install -q --target /tmp/tf451 --no-deps transformers==4.51.3 \
  'tokenizers<0.22,>=0.21' 'huggingface_hub<1.0'
uptime
for run in a b; do
  "$PY" -m looplm bench --quiet --out "$OUT-bench-$run.json" > /dev/null
done
"$PY" benchmarks/bench_agreement.py "$OUT-bench-a.json" "$OUT-bench-b.json" --out "$OUT-bench-agreement" || true
PYTHONPATH=/tmp/tf451:src OMP_NUM_THREADS=1 "$PY" benchmarks/huginn_side_by_side.py \
  "$HUGINN_DIR/raven_modeling_minimal.py" --out "$OUT-huginn-side-by-side"
uptime
