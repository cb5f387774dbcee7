#!/usr/bin/env bash
# Is the pretrained `mini`'s deficit against random init on a task a matter of
# the fine-tuning lr? Each arm (pretrained, random init) fine-tuned at every lr of LRS, fixed,
# 3 epochs, at least 200 steps, mean pooling, seeds SEEDS, scored on dev: the whole lr curve of
# each arm rather than the one point the held-out slice picks. Reading a curve's best point is
# choosing on dev (an upper bound for both arms, not a result a user gets); the point of the
# curve is whether the pretrained arm is above random init anywhere. MODEL is a RUN directory
# (default: the 100,000-sequence `mini` of benchmarks/studies/mini_100k/run.sh). Writes
# WORK/lr_LR_TASK.json; run again to skip what is done. Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/finetune_lr_curve/run.sh [MODEL] [WORK]
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${1:-/tmp/mini_100k/abl/runs/cpu_mini_adamw_bf16/seed_1}
WORK=${2:-/tmp/finetune_lr_curve}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1 2 3}
LRS=${LRS:-3e-5 1e-4 3e-4 1e-3}
TASKS=${TASKS:-party polarity}
EXTRA=${EXTRA:-}
mkdir -p "$WORK"
for task in $TASKS; do
    for lr in $LRS; do
        [ -f "$WORK/lr_${lr}_$task.json" ] || $PY -m commodity_bert.finetune --model "$MODEL" --task embedded:$task \
            --random-init --lr "$lr" --seeds $SEEDS $EXTRA --quiet --json "$WORK/lr_${lr}_$task.json"
    done
done
