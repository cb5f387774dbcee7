#!/usr/bin/env bash
# The slow-links study (first part): LAMB, DiLoCo (H = 10, 50) and 0/1 Adam at equal samples on mini, 2 ranks on
# one machine (no link shaping: accuracy, bytes and rounds do not depend on the link), seed 1.
# The data are the 1-bit LAMB freeze study's (onebit_freeze). Run again to resume. Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/slow_links/run.sh [WORK]        # default /tmp/slow_links
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/slow_links}
PY=${PYTHON:-.venv/bin/python}
S=benchmarks/studies/slow_links
PY=$PY bash benchmarks/studies/sotu_seq128.sh "$WORK"
COMMON="--data $WORK/seq128 --model mini --ranks 2 --samples 19200 --eval-every 25 --seeds 1
        --train-args=--num-workers=1 --out $WORK/mini"
$PY -m commodity_bert.ablate --configs $S/lamb.json $S/zero_one_adam.json $COMMON
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=10,50 $COMMON
$PY -m commodity_bert.ablate --configs $S/adamw.json $COMMON
# diagnosis: the outer step as plain averaging (lr 1, no momentum), to tell the outer momentum's part
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=10 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 $COMMON

# Second part: 1-bit LAMB (the freeze study's config, frozen at 50%) in the same grid;
# DiLoCo with plain averaging and a bf16 pseudo-gradient at H = 50 and 200; then second seeds.
$PY -m commodity_bert.ablate --configs benchmarks/studies/onebit_freeze/onebit_lamb.json $COMMON
PLAIN="--vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0
       --vary commodity_bert.diloco.compression=bf16"
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=50,200 $PLAIN $COMMON
SEED2=${COMMON/--seeds 1/--seeds 1 2}
$PY -m commodity_bert.ablate --configs $S/lamb.json benchmarks/studies/onebit_freeze/onebit_lamb.json $SEED2
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=50 $PLAIN $SEED2
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=10 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 $SEED2
# tuning between the two outer steps tried: lr 1 with Nesterov momentum 0.5 (2× the average Δ at a steady Δ, against 7× and 1×)
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=50 \
    --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.5 \
    --vary commodity_bert.diloco.compression=bf16 $COMMON

# Third part: 4 workers (4 ranks on this machine, micro-batch 16: the same global batch of 64),
# LAMB against DiLoCo H = 50 with plain averaging and a bf16 pseudo-gradient, seed 1.
COMMON4="--data $WORK/seq128 --model mini --ranks 4 --samples 19200 --eval-every 25 --seeds 1
         --train-args=--num-workers=1 --out $WORK/mini_4ranks"
$PY -m commodity_bert.ablate --base $S/lamb.json --vary train_micro_batch_size_per_gpu=16 $COMMON4
$PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary train_micro_batch_size_per_gpu=16 \
    --vary commodity_bert.diloco.inner_steps=50 $PLAIN $COMMON4
