#!/usr/bin/env bash
# Study 4 (issue 34), exploration on short runs: how DiLoCo's int4 pseudo-gradient should be
# rounded (nearest or stochastic) and whether error feedback helps, beside bf16 and LAMB, on
# Study 3's setting: mini, 300 steps of 64 sequences, 2 ranks on one machine, DiLoCo with plain
# averaging (outer lr 1, no momentum) at H = 50. Run again to resume. Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/streaming_diloco/run.sh [WORK]        # default /tmp/streaming_diloco
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/streaming_diloco}
PY=${PYTHON:-.venv/bin/python}
S3=benchmarks/studies/slow_links
PY=$PY bash benchmarks/studies/sotu_seq128.sh "$WORK"
COMMON="--data $WORK/seq128 --model mini --ranks 2 --samples 19200 --eval-every 25 --seeds 1
        --train-args=--num-workers=1 --out $WORK/mini"
PLAIN="--vary commodity_bert.diloco.inner_steps=50 --vary commodity_bert.diloco.outer_lr=1.0
       --vary commodity_bert.diloco.outer_momentum=0.0"
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $PLAIN --vary commodity_bert.diloco.compression=bf16 $COMMON
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $PLAIN --vary commodity_bert.diloco.compression=int4 \
    --vary commodity_bert.diloco.rounding=nearest,stochastic --vary commodity_bert.diloco.error_feedback=false,true $COMMON
$PY -m commodity_bert.ablate --configs $S3/lamb.json $COMMON

# Second part: runs long enough for the schedules to matter (1,000 steps of 64 sequences), seed 1:
# LAMB against DiLoCo at H = 104 (≥ 400× fewer bytes than LAMB in int4), plain averaging, int4
# rounded to the nearest level with error feedback.
LONG="--data $WORK/seq128 --model mini --ranks 2 --samples 64000 --eval-every 100 --seeds 1
      --train-args=--num-workers=1 --out $WORK/mini_1000"
$PY -m commodity_bert.ablate --configs $S3/lamb.json $LONG
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=104 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 \
    --vary commodity_bert.diloco.compression=int4 --vary commodity_bert.diloco.error_feedback=true $LONG
# H = 112: at most 9 syncs in the 1,000 steps (the last step's included), ≥ 400× fewer bytes than LAMB
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=112 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 \
    --vary commodity_bert.diloco.compression=int4 --vary commodity_bert.diloco.error_feedback=true $LONG
