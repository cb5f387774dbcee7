#!/usr/bin/env bash
# The domain path's choices screened at a small budget before a full run: each variant is
# recipes/domain.sh (IMDb reviews plus polarity's training sentences, `mini`, 8,192-piece in-domain
# vocabulary) for the same 1,000 steps of 8,192 tokens (8.2M processed tokens, its own warm-up and
# decay to 0), then judged on polarity at 1,000 labels at one fixed setting (3e-4 for 200 steps,
# the full run's chosen setting; 5 seeds), beside random init at the same setting, with the frozen
# probe. A fixed setting keeps the screen cheap (about 2 minutes a variant where the full judge
# takes 17); the chosen variant is then judged in full (run.sh).
#
#   bash benchmarks/studies/domain_polarity/screen.sh WORK [VARIANT ...]   # default: all variants
#   VARIANT: base (seq 128, masking 15%, lr 1e-3), seq64 (64 tokens, 128 sequences a step),
#            lr3e-3 (peak rate 3e-3), tiny (the 2-layer, 128-wide model), tiny4400 (tiny for 4,400
#            steps, about the base's pretraining time on a 2-core Zen 4), small600 (Turc et al.'s
#            4-layer, 512-wide `small` for 600 steps: 2.02 s a step against the base's 1.21 on a
#            2-core Zen 4, so the base's pretraining time), bertvocab (BERT's own
#            30,522-piece uncased vocabulary in place of the in-domain one), mask30 (30% masked;
#            not in the default list: masking rates were screened at 8M tokens on general text,
#            benchmarks/RESULTS.md#small-budget-factors)
# Results: benchmarks/results/domain_polarity/screen_VARIANT.json (the judge) and
# screen_VARIANT_pretraining.json (the run's summary); the table: screen_report.py, run at the end
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:?give the work directory}; shift
VARIANTS=${*:-base seq64 lr3e-3}
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results/domain_polarity
KNOWN="base seq64 mask30 lr3e-3 tiny tiny4400 small600 bertvocab"
for variant in $VARIANTS; do  # every name checked before the corpus is fetched
    [[ " $KNOWN " == *" $variant "* ]] || { echo "screen.sh: unknown variant $variant ($KNOWN)" >&2; exit 2; }
done
mkdir -p "$WORK" "$OUT"
[ -f "$WORK/imdb/corpus.txt" ] || $PY -m data_prep corpus --sources imdb_reviews --output "$WORK/imdb"
for variant in $VARIANTS; do
    same_data=0  # 1: the base's shards serve (the variant changes the training, not the data)
    case $variant in
        base) knobs=() ;;
        seq64) knobs=(SEQ_LEN=64 BATCH=64) ;;  # the same tokens a step as base
        mask30) knobs=(MASK_PROB=0.3) ;;
        lr3e-3) knobs=(LR=3e-3); same_data=1 ;;
        tiny) knobs=(MODEL=tiny); same_data=1 ;;
        tiny4400) knobs=(MODEL=tiny STEPS=4400); same_data=1 ;;  # tiny for mini's 1,000 steps' time
        small600) knobs=(MODEL=small STEPS=600); same_data=1 ;;  # small for mini's 1,000 steps' time
        bertvocab) knobs=(VOCAB=data_prep/resources/bert_base_uncased_vocab.txt) ;;
    esac
    run=$WORK/screen/$variant
    mkdir -p "$run"
    # the vocabulary depends on the text alone: one for every variant
    [ "$variant" = bertvocab ] || [ -f "$run/vocab.txt" ] || [ ! -f "$WORK/screen/base/vocab.txt" ] \
        || cp "$WORK/screen/base/vocab.txt" "$run/vocab.txt"
    [ "$same_data" = 0 ] || [ -e "$run/shards" ] || [ ! -f "$WORK/screen/base/shards/manifest.json" ] \
        || ln -s "$WORK/screen/base/shards" "$run/shards"
    env TEXT="$WORK/imdb/corpus.txt" TASK=embedded:polarity STEPS=1000 TIME_BUDGET=100m CHECKPOINTS=1 \
        OUT="$run" MASTER_PORT=29531 \
        FINETUNE_ARGS="--train-examples 1000 --lr 3e-4 --min-steps 200 --epochs 0.01 --threads ${THREADS:-2}" \
        "${knobs[@]}" bash recipes/domain.sh
    cp "$run/downstream.json" "$OUT/screen_$variant.json"
    cp "$run/run/summary.json" "$OUT/screen_${variant}_pretraining.json"
done
$PY benchmarks/studies/domain_polarity/screen_report.py
