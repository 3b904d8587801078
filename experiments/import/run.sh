#!/usr/bin/env bash
# The evidence of issue 14 §3 (experiments/import/README.md): import the two parity fixtures and a small
# looplm-trained model in the Huginn-0125 layout, then run `looplm diagnose`, `looplm eval kv-sharing` and
# `looplm eval halting` on each imported checkpoint from the command line. CPU, one thread, a few minutes.
# Usage: bash experiments/import/run.sh [WORK_DIR]   (default experiments/import/runs; outputs copied to out/)
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-experiments/import/runs}
OUT=experiments/import/out
export OMP_NUM_THREADS=1
mkdir -p "$W" "$OUT"
# `looplm` is the console script of `pip install -e .` (make test creates .venv with it)

# 1. a tiny looplm model with Huginn-0125's architecture options, trained on Brown (debug preset sizes)
if [ ! -f "$W/huginn-layout-run/latest" ]; then
  looplm train --preset debug --name huginn-layout --out "$W/huginn-layout-run" --quiet \
    --model.rule huginn_linear --model.n_prelude 2 --model.n_core 2 --model.n_coda 2 \
    --model.position.kind rope --model.position.theta 50000 --model.position.layout interleaved \
    --model.qk_bias true --model.block_norm pre_post --model.embed_scale 8 --model.exit_norm final \
    --model.options.adapter_bias false --model.options.step_norm false \
    --model.options.state_init truncated_normal --model.options.state_init_std 0.6324555320336759 \
    --train.steps 60 > "$W/train.json"
fi
# 2. written in the published Huginn-0125 layout, then imported like the real checkpoint
rm -rf "$W/huginn-layout-src" "$W/imported"
python experiments/import/to_huginn_layout.py "$W/huginn-layout-run" "$W/huginn-layout-src"
looplm import huginn "$W/huginn-layout-src" --out "$W/imported/huginn-layout" --quiet > "$OUT/import_huginn-layout.json"
looplm import huginn tests/fixtures/import/huginn --out "$W/imported/huginn-fixture" --quiet > "$OUT/import_huginn-fixture.json"
looplm import ouro tests/fixtures/import/ouro --out "$W/imported/ouro-fixture" --quiet > "$OUT/import_ouro-fixture.json"

# 3. the diagnostics commands on every imported checkpoint (Brown valid/test, small settings)
for m in huginn-layout huginn-fixture ouro-fixture; do
  ck="$W/imported/$m"
  looplm diagnose --checkpoint "$ck" --depth 16 --batches 2 --batch-size 4 --quiet --out "$OUT/$m/diagnose.json" > /dev/null
  looplm eval kv-sharing --checkpoint "$ck" --depths 1,2,4,8 --max-tokens 8192 --batch-size 8 --quiet \
    --out "$OUT/$m/kv_sharing.json" > /dev/null
  looplm eval halting --checkpoint "$ck" --n-calib 64 --n-timed 64 --batch-size 16 --quiet \
    --out "$OUT/$m/halting.json" > /dev/null
done
# Ouro's own exit rule as the halting criterion (the exit gate's cumulative exit probability)
looplm eval halting --checkpoint "$W/imported/ouro-fixture" --criterion exit_cdf --n-calib 64 --n-timed 64 \
  --batch-size 16 --quiet --out "$OUT/ouro-fixture/halting_exit_cdf/halting.json" > /dev/null
# 4. the imported Huginn-layout model is the trained one: the same PPL at every depth (Brown test)
for m in run imported; do
  ck="$W/huginn-layout-run"; [ "$m" = imported ] && ck="$W/imported/huginn-layout"
  looplm eval ppl --checkpoint "$ck" --depths 1,2,4,8,16 --max-tokens 16384 --quiet --out "$OUT/huginn-layout/ppl_$m.json" > /dev/null
done
echo "outputs in $OUT"
