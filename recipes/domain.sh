#!/usr/bin/env bash
# A BERT for your domain from scratch, in one command: a folder of unlabelled in-domain text (and,
# with TASK, the task's own training texts, never its dev split) -> an in-domain WordPiece
# vocabulary -> shards -> a pretraining run whose schedule is sized to TIME_BUDGET on this
# machine -> the export -> the task judged beside the same model from random weights, each arm by
# its own cross-validated rate and length (docs/domain.md; measured on film reviews there).
#
#   TEXT=reviews/ TASK=embedded:polarity TIME_BUDGET=90m bash recipes/domain.sh
#   TEXT="notes/ more.jsonl" TIME_BUDGET=4h bash recipes/domain.sh            # pretraining alone
#   TEXT=... FINETUNE_ARGS="--train train.csv --validation dev.csv" bash recipes/domain.sh
#
#   TEXT (required: bert-data-prep --input paths), TASK (an embedded bert-finetune task; its
#   training texts are added unless TASK_TEXT=0, and the pretraining text is checked for its dev
#   texts first: python -m commodity_bert.domain check-text), TIME_BUDGET (default 90m: the pretraining's wall
#   time, checkpoints and evaluations included), OUT (default runs/domain), MODEL (default mini),
#   VOCAB_SIZE (default 8192), VOCAB (a ready vocab.txt instead, e.g. BERT's own 30,522 pieces:
#   data_prep/resources/bert_base_uncased_vocab.txt; default: VOCAB_SIZE pieces trained on TEXT),
#   SEQ_LEN (default 128), MASK_PROB (default 0.15), LR (peak AdamW rate, default 1e-3, warmed up
#   over the first 10% and decayed linearly to 0 at the sized end), BATCH (sequences per rank and
#   step, default 32), RANKS (default 2), STEPS (default: sized to TIME_BUDGET from a short timing
#   run of the same job), CHECKPOINTS (default 5: the run keeps
#   that many evenly spaced, for the gain curve), TIMING_STEPS (default 30), MASTER_PORT (default
#   29500; another for a second job on the same machine), CONFIG (default
#   ds_configs/cpu_mini_adamw_{bf16,fp32}.json by the CPU), FINETUNE_ARGS (default
#   "--train-examples 1000"; with TASK, more bert-finetune flags; without TASK, the task itself).
#   The result goes to OUT/downstream.json. Re-running resumes what is unfinished.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TEXT:?set TEXT to your domain\'s unlabelled text (files or directories bert-data-prep reads)}"
VENV=${VENV:-.venv}
PY=$VENV/bin/python
OUT=${OUT:-runs/domain}
MODEL=${MODEL:-mini}
RANKS=${RANKS:-2}
TIME_BUDGET=${TIME_BUDGET:-90m}
FINETUNE_ARGS=${FINETUNE_ARGS:---train-examples 1000}
if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then PRECISION=bf16; else PRECISION=fp32; fi
CONFIG=${CONFIG:-ds_configs/cpu_mini_adamw_$PRECISION.json}
if [ -n "${VOCAB:-}" ]; then
    [ -f "$VOCAB" ] || { echo "domain.sh: VOCAB=$VOCAB is not a file: give a vocab.txt (one WordPiece" \
        "a line)" >&2; exit 2; }
    # a run keeps the vocabulary its shards were made with: another one is a new OUT
    [ ! -f "$OUT/vocab.txt" ] || cmp -s "$VOCAB" "$OUT/vocab.txt" || { echo "domain.sh: $OUT was made with" \
        "another vocabulary than VOCAB=$VOCAB: give a new OUT, or leave VOCAB out" >&2; exit 2; }
fi
mkdir -p "$OUT"
INPUTS="$TEXT"
if [ -n "${TASK:-}" ]; then
    if [ "${TASK_TEXT:-1}" != 0 ]; then
        [ -f "$OUT/task_train.txt" ] || $PY -m commodity_bert.finetune --task "$TASK" --write-train-text "$OUT/task_train.txt"
        INPUTS="$INPUTS $OUT/task_train.txt"
    fi
    # shellcheck disable=SC2086  # a list of inputs
    $PY -m commodity_bert.domain check-text --text $INPUTS --task "$TASK"
fi
JUDGE=$([ -n "${TASK:-}" ] || [[ " $FINETUNE_ARGS " == *" --train "* || " $FINETUNE_ARGS " == *" --glue "* ]] && echo yes || true)
# the judge's flags checked now, not after the pretraining's hours (the model is not read)
# shellcheck disable=SC2086  # a list of flags
[ -z "$JUDGE" ] || $PY -m commodity_bert.finetune --model "$OUT/run" ${TASK:+--task "$TASK"} $FINETUNE_ARGS --check-only
if [ -f "$OUT/vocab.txt" ]; then
    :  # made by an earlier run of this OUT (VOCAB, if given, was checked to be the same above)
elif [ -n "${VOCAB:-}" ]; then
    cp "$VOCAB" "$OUT/vocab.partial" && mv "$OUT/vocab.partial" "$OUT/vocab.txt"
else
    # shellcheck disable=SC2086
    $PY -m data_prep vocab --input $INPUTS --vocab-size "${VOCAB_SIZE:-8192}" --lowercase --output "$OUT/vocab.txt"
fi
# shellcheck disable=SC2086
[ -f "$OUT/shards/manifest.json" ] || $PY -m data_prep shards --input $INPUTS --vocab "$OUT/vocab.txt" \
    --seq-len "${SEQ_LEN:-128}" --no-nsp --masking dynamic --mask-prob "${MASK_PROB:-0.15}" \
    --num-shards "$(( RANKS * 2 ))" --val-fraction 0.01 --output "$OUT/shards"
launch() {  # RUN_DIR CONFIG STEPS [train.py flags]: this job on this machine's ranks
    local run=$1 config=$2 steps=$3; shift 3
    "$VENV/bin/deepspeed" --num_gpus "$RANKS" --master_port "${MASTER_PORT:-29500}" train.py --deepspeed_config "$config" --data "$OUT/shards" \
        --model "$MODEL" --output-dir "$run" --max-steps "$steps" --num-workers 1 "$@" 2>&1 \
        | grep --line-buffered -E '^(step|done|stopping|warning|left the)|error|Error'
}
if [ ! -f "$OUT/ds_config.json" ]; then
    if [ -z "${STEPS:-}" ]; then
        # the step time of this very job (model, batch, ranks, precision), after 5 steps of warming up
        $PY -m commodity_bert.train.schedule config "$CONFIG" "$OUT/timing_config.json" --steps "${TIMING_STEPS:-30}" \
            --lr "${LR:-1e-3}" --batch "${BATCH:-32}"
        rm -rf "$OUT/timing"
        launch "$OUT/timing" "$OUT/timing_config.json" "${TIMING_STEPS:-30}" --log-every 5 --save-every-minutes 0 \
            --keep-checkpoints 0 --plateau-check-samples 0 >/dev/null
        STEPS=$($PY -m commodity_bert.train.schedule size "$OUT/timing/metrics.jsonl" "$TIME_BUDGET")
        rm -rf "$OUT/timing" "$OUT/timing_config.json"
    fi
    $PY -m commodity_bert.train.schedule config "$CONFIG" "$OUT/ds_config.partial" --steps "$STEPS" \
        --lr "${LR:-1e-3}" --batch "${BATCH:-32}"
    mv "$OUT/ds_config.partial" "$OUT/ds_config.json"
fi
STEPS=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['scheduler']['params']['total_num_steps'])" \
    "$OUT/ds_config.json")
EVERY=$(( STEPS / ${CHECKPOINTS:-5} > 0 ? STEPS / ${CHECKPOINTS:-5} : 1 ))
echo "pretraining $MODEL on $OUT/shards: $STEPS steps sized to $TIME_BUDGET ($PRECISION, $RANKS ranks)"
# a finished run (its summary written) is not trained again; an interrupted one resumes. Only the
# even checkpoints: timed ones would push them out of --keep-checkpoints (a preempted run loses at
# most one spacing)
[ -f "$OUT/run/summary.json" ] || launch "$OUT/run" "$OUT/ds_config.json" "$STEPS" --time-budget "$TIME_BUDGET" \
    --log-every 100 --eval-every "$EVERY" --save-every "$EVERY" --save-every-minutes 0 \
    --keep-checkpoints "${CHECKPOINTS:-5}"
if [ -n "$JUDGE" ] && [ ! -f "$OUT/downstream.json" ]; then
    # shellcheck disable=SC2086  # a list of flags
    $PY -m commodity_bert.finetune --model "$OUT/run" ${TASK:+--task "$TASK"} --random-init --quiet \
        --json "$OUT/downstream.json" $FINETUNE_ARGS
fi
