#!/usr/bin/env bash
# CPU quickstart on the embedded corpus (233 State of the Union addresses, public domain):
# set up the environment, make phase-1 shards, inspect and verify them.
# Training (train.py) joins this recipe in the next release.
set -euo pipefail
cd "$(dirname "$0")/.."
bash recipes/setup_env.sh
PY=${VENV:-.venv}/bin/python
DATA=${DATA:-data/quickstart/seq128}
WORKERS=${WORKERS:-$(nproc)}
$PY -m data_prep shards --input embedded:sotu --output "$DATA" --seq-len 128 \
    --masking static --dupe-factor 2 --num-shards 4 --val-fraction 0.05 --workers "$WORKERS"
$PY -m data_prep inspect "$DATA" --verify
