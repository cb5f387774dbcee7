#!/usr/bin/env bash
# LAMB against 1-bit LAMB against LAMB with bucket-wise clipping, on real text, 2 ranks, equal
# samples: one bert-ablate command over the configs of benchmarks/studies/onebit_freeze/.
# (It replaces benchmarks/onebit_vs_lamb.py.) Table: ABL/results.md; plots: ABL/*.png.
#
#   bash benchmarks/onebit_vs_lamb.sh [ABL] [MODEL] [SAMPLES]     # defaults: /tmp/onebit_vs_lamb mini 19200
#
# Run it again to resume; SEEDS="1 2" for a seed spread.
set -euo pipefail
cd "$(dirname "$0")/.."
ABL=${1:-/tmp/onebit_vs_lamb}
MODEL=${2:-mini}
SAMPLES=${3:-19200}
PY=${PYTHON:-.venv/bin/python}
DATA=$ABL/data
if [ ! -f "$DATA/seq128/manifest.json" ]; then
    mkdir -p "$DATA"
    $PY -m data_prep vocab --input embedded:sotu --vocab-size 8192 --output "$DATA/vocab.txt"
    $PY -m data_prep shards --input embedded:sotu --vocab "$DATA/vocab.txt" --output "$DATA/seq128" \
        --seq-len 128 --dupe-factor 1 --num-shards 4 --val-fraction 0.05
fi
S=benchmarks/studies/onebit_freeze
$PY -m commodity_bert.ablate --configs $S/lamb.json $S/onebit_lamb.json $S/lamb_bucketwise_clip.json \
    --data "$DATA/seq128" --model "$MODEL" --ranks 2 --samples "$SAMPLES" --seeds ${SEEDS:-1} \
    --eval-every 25 --train-args "--num-workers 1" --out "$ABL"
