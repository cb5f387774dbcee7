#!/usr/bin/env bash
# The sparse DiLoCo study: bytes against masked-LM accuracy for DiLoCo's pseudo-gradient sent
# sparse (the top share of each 4,096 values in 2 or 4 bits, error feedback) beside dense int4 and
# int2, against LAMB at equal samples (its 16-bit gradient allreduce at every step, the
# baseline's bytes). mini, 4 workers (4 ranks on this machine, micro-batch 16: the global batch
# of 64 of the slow-links study), bf16, plain averaging (outer lr 1, no momentum).
# Run again to resume. Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/sparse_diloco/run.sh [WORK]        # default /tmp/sparse_diloco
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/sparse_diloco}
PY=${PYTHON:-.venv/bin/python}
S3=benchmarks/studies/slow_links
PY=$PY bash benchmarks/studies/sotu_seq128.sh "$WORK"

# The screen: 300 steps of 64 sequences, one seed, evaluated every 100 steps: LAMB; sparse at
# 1% in 2 bits every 20 steps (about 1,080x fewer bytes than LAMB) and every 50; dense int4 and
# int2 every 50 steps; 5% every 50 and 100 steps.
SCREEN="--data $WORK/seq128 --model mini --ranks 4 --samples 19200 --eval-every 100 --seeds 1
        --train-args=--num-workers=1 --out $WORK/screen"
FOUR="--vary train_micro_batch_size_per_gpu=16"
PLAIN="--vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0
       --vary commodity_bert.diloco.error_feedback=true"
SPARSE="--vary commodity_bert.diloco.compression=sparse"
$PY -m commodity_bert.ablate --base $S3/lamb.json $FOUR $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE \
    --vary commodity_bert.diloco.inner_steps=20 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN --vary commodity_bert.diloco.compression=int4 \
    --vary commodity_bert.diloco.inner_steps=50 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE \
    --vary commodity_bert.diloco.inner_steps=50 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE \
    --vary commodity_bert.diloco.density=0.05 --vary commodity_bert.diloco.inner_steps=50 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN --vary commodity_bert.diloco.compression=int2 \
    --vary commodity_bert.diloco.inner_steps=50 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE \
    --vary commodity_bert.diloco.density=0.05 --vary commodity_bert.diloco.inner_steps=100 $SCREEN
# Dense at the bytes of sparse 1% in 2 bits every 20 steps (0.83 parameter-bytes a worker over the
# run): int4 every 300 steps (its one round the last step), int2 every 150.
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN --vary commodity_bert.diloco.compression=int4 \
    --vary commodity_bert.diloco.inner_steps=300 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN --vary commodity_bert.diloco.compression=int2 \
    --vary commodity_bert.diloco.inner_steps=150 $SCREEN
# Values in 4 bits; half the density; every 10 steps.
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE --vary commodity_bert.diloco.value_bits=4 \
    --vary commodity_bert.diloco.inner_steps=20 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE --vary commodity_bert.diloco.density=0.005 \
    --vary commodity_bert.diloco.inner_steps=20 $SCREEN
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE \
    --vary commodity_bert.diloco.inner_steps=10 $SCREEN
$PY benchmarks/sparse_frontier.py $WORK/screen/results.json --json $WORK/screen/frontier.json \
    --plot $WORK/screen/frontier.png --markdown $WORK/screen/frontier.md

# Bytes a round at 2, 4 and 8 workers (8: 4 hosts x 2 ranks, two levels) on namespace hosts (root).
$PY benchmarks/sparse_bytes_by_workers.py --data $WORK/seq128 --work $WORK/bytes_by_workers \
    --json $WORK/bytes_by_workers/bytes.json --markdown $WORK/bytes_by_workers/bytes.md

# The full run: 1,000 steps, LAMB and sparse at 1% in 2 bits every 20 steps (SEEDS, default
# 1 2 3), and dense int4 at about those bytes (every 250 steps: 4 rounds, 12% more bytes), seed 1.
SEEDS=${SEEDS:-1 2 3}
LONG="--data $WORK/seq128 --model mini --ranks 4 --samples 64000 --eval-every 100
      --train-args=--num-workers=1 --out $WORK/mini_1000"
$PY -m commodity_bert.ablate --base $S3/lamb.json $FOUR $LONG --seeds $SEEDS
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN $SPARSE --vary commodity_bert.diloco.inner_steps=20 \
    $LONG --seeds $SEEDS
$PY -m commodity_bert.ablate --base $S3/diloco_lamb.json $FOUR $PLAIN --vary commodity_bert.diloco.compression=int4 \
    --vary commodity_bert.diloco.inner_steps=250 $LONG --seeds 1
$PY benchmarks/sparse_frontier.py $WORK/mini_1000/results.json --json $WORK/mini_1000/frontier.json \
    --plot $WORK/mini_1000/frontier.png --markdown $WORK/mini_1000/frontier.md

# Each 1,000-step model fine-tuned on polarity (1,000 labels, 3 seeds, the rate by 3-fold
# cross-validation), the first beside its random init.
FT=$WORK/mini_1000/finetune; mkdir -p "$FT"
first=--random-init
for run in "$WORK"/mini_1000/runs/*/seed_*; do
    variant=$(basename "$(dirname "$run")"); seed=$(basename "$run")
    [ -f "$FT/${variant}_$seed.json" ] && continue
    $PY -m commodity_bert.finetune --model "$run" --task embedded:polarity --train-examples 1000 --lr auto \
        --lr-grid 3e-4 1e-3 --lr-folds 3 --seeds 1 2 3 --threads 1 --quiet $first --json "$FT/${variant}_$seed.json"
    first=
done
