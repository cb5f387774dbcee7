#!/usr/bin/env bash
# The studies' data set, built once in WORK/seq128: the embedded State of the Union corpus at
# seq 128 with NSP, an 8,192-token vocabulary, 4 shards, 5% of documents held out.
#
#   PY=python bash benchmarks/studies/sotu_seq128.sh WORK
set -euo pipefail
WORK=$1
PY=${PY:-.venv/bin/python}
if [ ! -f "$WORK/seq128/manifest.json" ]; then
    mkdir -p "$WORK"
    $PY -m data_prep vocab --input embedded:sotu --vocab-size 8192 --output "$WORK/vocab.txt"
    $PY -m data_prep shards --input embedded:sotu --vocab "$WORK/vocab.txt" --output "$WORK/seq128" \
        --seq-len 128 --dupe-factor 1 --num-shards 4 --val-fraction 0.05
fi
