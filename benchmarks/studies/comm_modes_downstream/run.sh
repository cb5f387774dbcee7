#!/usr/bin/env bash
# The communication studies' chosen variants judged downstream, not only by
# masked-LM accuracy. LAMB (the studies' baseline), 1-bit LAMB frozen at 50% (the freeze study's choice) and
# DiLoCo at H = 50 with plain averaging of a bf16 pseudo-gradient (the slow-links study's choice), each with the
# studies' own settings: `mini`, the embedded SOTU text with an 8,192-token vocabulary, seq 128,
# 2 ranks x micro-batch 32, 19,200 samples (300 steps), LAMB 5e-3. Each model is fine-tuned on both
# embedded tasks (lr chosen per arm on the held-out training slice, seeds SEEDS); the random-init
# arm, the same for every model, runs once, beside LAMB's. Run again to skip what is done.
# Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/comm_modes_downstream/run.sh [WORK] [PART]   # default /tmp/comm_downstream, all
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/comm_downstream}
PART=${2:-all}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1 2 3}
GRID=${GRID:-3e-4 1e-3}
TASKS=${TASKS:-party polarity}
S=benchmarks/studies/slow_links
PY=$PY bash benchmarks/studies/sotu_seq128.sh "$WORK"
COMMON="--data $WORK/seq128 --model mini --ranks 2 --samples 19200 --eval-every 100 --seeds 1
        --train-args=--num-workers=1 --out $WORK/mini"
# part 1: pretraining, one seed each
if [ "$PART" = all ] || [ "$PART" = 1 ]; then
    $PY -m commodity_bert.ablate --configs $S/lamb.json benchmarks/studies/onebit_freeze/onebit_lamb.json $COMMON
    $PY -m commodity_bert.ablate --base $S/diloco_lamb.json --vary commodity_bert.diloco.inner_steps=50 \
        --vary commodity_bert.diloco.outer_lr=1.0 --vary commodity_bert.diloco.outer_momentum=0.0 \
        --vary commodity_bert.diloco.compression=bf16 $COMMON
fi
# part 2: fine-tuning every finished model on both tasks
if [ "$PART" = all ] || [ "$PART" = 2 ]; then
    for task in $TASKS; do
        for run in "$WORK"/mini/runs/*/seed_1; do
            name=$(basename "$(dirname "$run")")
            random=$([ "$name" = lamb ] && echo --random-init || true)
            [ -f "$WORK/${name}_$task.json" ] || $PY -m commodity_bert.finetune --model "$run" --task embedded:$task \
                $random --seeds $SEEDS --lr-grid $GRID --quiet --json "$WORK/${name}_$task.json"
        done
    done
fi
