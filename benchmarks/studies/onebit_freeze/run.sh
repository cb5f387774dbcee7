#!/usr/bin/env bash
# When may 1-bit LAMB freeze? LAMB against 1-bit LAMB frozen at 10/20/30/50% of a
# 300-step run and at "auto", on mini and tiny, 2 ranks, 2 seeds, equal samples (19,200), bf16.
# Each line is one bert-ablate command; run the script again to resume. Figures: RESULTS.md.
#
#   bash benchmarks/studies/onebit_freeze/run.sh [WORK]        # default /tmp/onebit_freeze
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/onebit_freeze}
PY=${PYTHON:-.venv/bin/python}
S=benchmarks/studies/onebit_freeze
PY=$PY bash benchmarks/studies/sotu_seq128.sh "$WORK"
for MODEL in mini tiny; do
    COMMON="--data $WORK/seq128 --model $MODEL --ranks 2 --samples 19200 --eval-every 25 --seeds 1 2
            --train-args=--num-workers=1 --out $WORK/freeze_$MODEL"
    $PY -m commodity_bert.ablate --configs $S/lamb.json $COMMON
    $PY -m commodity_bert.ablate --base $S/onebit_lamb.json --vary optimizer.params.freeze_step=30,60,90,150 $COMMON
    $PY -m commodity_bert.ablate --base $S/onebit_lamb_auto.json --vary optimizer.params.freeze_threshold=0.08 $COMMON
done
