#!/usr/bin/env bash
# Phase-1 (seq 128) and phase-2 (seq 512) shards from your corpus, as NVIDIA's and MLPerf's
# BERT recipes use them (static masking, NSP, 20 / 80 masked positions).
#   INPUT        corpus paths (files, directories, HF dataset directories) or hf:NAME[:CONFIG], space separated
#   HF_DATA_FILES  for INPUT=hf:json|hf:parquet|hf:text: the files (globs allowed), space separated
#   TEXT_FIELD   the text's field in .jsonl, parquet and HF inputs (default text)
#   OUT          output root (default data/pretrain); makes $OUT/seq128 and $OUT/seq512
#   VOCAB        vocab.txt (default: the embedded BERT-base uncased vocabulary)
#   NUM_SHARDS   training shards per phase, any count (default 256): each of W ranks reads n/W whole
#                shards and a share of the n mod W left over (docs/data.md)
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
set -f  # INPUT and HF_DATA_FILES are split into words, their globs left to bert-data-prep
# shellcheck disable=SC2206
INPUTS=(--input $INPUT ${HF_DATA_FILES:+--hf-data-files $HF_DATA_FILES} --text-field "${TEXT_FIELD:-text}")
set +f
$PY -m data_prep shards "${INPUTS[@]}" --vocab "$VOCAB" --output "$OUT/seq128" --seq-len 128 \
    --max-predictions 20 --dupe-factor 5 --num-shards "$NUM_SHARDS" --workers "$WORKERS"
$PY -m data_prep shards "${INPUTS[@]}" --vocab "$VOCAB" --output "$OUT/seq512" --seq-len 512 \
    --max-predictions 80 --dupe-factor 5 --num-shards "$NUM_SHARDS" --workers "$WORKERS"
$PY -m data_prep inspect "$OUT/seq128"
$PY -m data_prep inspect "$OUT/seq512"
