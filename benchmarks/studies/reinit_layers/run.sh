#!/usr/bin/env bash
# Where in the pretrained weights is what makes `mini` fine-tune worse than
# its random init on embedded:party? The same fine-tuning (lr chosen per run on the held-out
# training slice from GRID, 3 epochs, at least 200 steps, mean pooling) with the top N encoder
# layers re-initialised (bert-finetune --reinit-layers N, Zhang et al. 2020); N = the model's
# depth keeps only the pretrained embeddings. MODEL is a RUN directory (default: the 100,000-
# sequence `mini` of benchmarks/studies/mini_100k/run.sh). Writes WORK/reinit_N_TASK.json;
# run again to skip what is done. Figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/reinit_layers/run.sh [MODEL] [WORK] [N ...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${1:-/tmp/mini_100k/abl/runs/cpu_mini_adamw_bf16/seed_1}
WORK=${2:-/tmp/reinit_layers}
shift $(( $# < 2 ? $# : 2 ))
LAYERS=${*:-0 1 2 4}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1 2 3}
GRID=${GRID:-3e-4 1e-3}
TASKS=${TASKS:-party}
mkdir -p "$WORK"
for task in $TASKS; do
    for n in $LAYERS; do
        # N = 0 is the model as pretrained, with the random-init arm beside it
        random=$([ "$n" = 0 ] && echo --random-init || true)
        [ -f "$WORK/reinit_${n}_$task.json" ] || $PY -m commodity_bert.finetune --model "$MODEL" --task embedded:$task \
            --reinit-layers "$n" $random --seeds $SEEDS --lr-grid $GRID --quiet --json "$WORK/reinit_${n}_$task.json"
    done
done
