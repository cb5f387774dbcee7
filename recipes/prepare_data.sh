#!/usr/bin/env bash
# Phase-1 (seq 128) and phase-2 (seq 512) shards from your corpus, as NVIDIA's and MLPerf's
# BERT recipes use them (static masking, NSP, 20 / 80 masked positions).
#   INPUT        corpus paths (files, directories, HF dataset directories), space separated
#   OUT          output root (default data/pretrain); makes $OUT/seq128 and $OUT/seq512
#   VOCAB        vocab.txt (default: the embedded BERT-base uncased vocabulary)
#   NUM_SHARDS   training shards per phase: a multiple of your total GPU count (default 256)
#   WORKERS      processes (default: all cores)
# Re-running the same command resumes an interrupted run.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${INPUT:?set INPUT to your corpus (files or directories)}"
PY=${PY:-${VENV:-.venv}/bin/python}
OUT=${OUT:-data/pretrain}
VOCAB=${VOCAB:-embedded:bert-base-uncased}
NUM_SHARDS=${NUM_SHARDS:-256}
WORKERS=${WORKERS:-$(nproc)}
# shellcheck disable=SC2086  # INPUT may list several paths
$PY -m data_prep shards --input $INPUT --vocab "$VOCAB" --output "$OUT/seq128" --seq-len 128 \
    --max-predictions 20 --dupe-factor 5 --num-shards "$NUM_SHARDS" --workers "$WORKERS"
# shellcheck disable=SC2086
$PY -m data_prep shards --input $INPUT --vocab "$VOCAB" --output "$OUT/seq512" --seq-len 512 \
    --max-predictions 80 --dupe-factor 5 --num-shards "$NUM_SHARDS" --workers "$WORKERS"
$PY -m data_prep inspect "$OUT/seq128"
$PY -m data_prep inspect "$OUT/seq512"
