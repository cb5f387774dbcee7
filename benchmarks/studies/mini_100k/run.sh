#!/usr/bin/env bash
# `mini` (4 x 256, BERT's 30,522-token vocabulary) pretrained on a fixed
# budget of 100,000 sequences of 128 tokens, then fine-tuned on both embedded tasks beside the
# same architecture from random init, the lr chosen per arm on a held-out slice of the training
# split. The embedded State of the Union text, no NSP, 2 ranks x micro-batch 32 = 64 sequences a
# step (1,563 steps), ds_configs/cpu_mini_adamw_bf16.json (AdamW 1e-3, beta2 0.98, warm-up 10%,
# linear decay to 0; bert-ablate fits the schedule to the budget). Run again to resume.
# Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/mini_100k/run.sh [WORK] [PART]    # default /tmp/mini_100k, all parts
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-/tmp/mini_100k}
PART=${2:-all}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1 2 3 4 5}
GRID=${GRID:-3e-4 1e-3}
mkdir -p "$WORK"
[ -f "$WORK/sotu128/manifest.json" ] || $PY -m data_prep shards --input embedded:sotu --output "$WORK/sotu128" \
    --seq-len 128 --no-nsp --num-shards 4 --val-fraction 0.02
# part 1: pretraining, seed 1
if [ "$PART" = all ] || [ "$PART" = 1 ]; then
    $PY -m commodity_bert.ablate --configs ds_configs/cpu_mini_adamw_bf16.json --data "$WORK/sotu128" --model mini \
        --ranks 2 --samples 100000 --seeds 1 --eval-every 200 --train-args=--num-workers=1 --out "$WORK/abl"
fi
# part 2: fine-tuning on both tasks, pretrained beside random init
if [ "$PART" = all ] || [ "$PART" = 2 ]; then
    for task in polarity party; do
        [ -f "$WORK/$task.json" ] || $PY -m commodity_bert.finetune --model "$WORK/abl/runs/cpu_mini_adamw_bf16/seed_1" \
            --task embedded:$task --random-init --seeds $SEEDS --lr-grid $GRID --quiet --json "$WORK/$task.json"
    done
fi
