#!/usr/bin/env bash
# Domain adaptation: continue pretraining a BERT on the unlabelled text of your task (its training
# texts and text like them), then fine-tune it beside random init (Gururangan et al. 2020, "Don't
# Stop Pretraining": task-adaptive pretraining). The model is a RUN, its hf_model, or a Hugging
# Face BERT directory (safetensors or pytorch_model.bin, with its tokenizer); the shards are made
# with that model's own vocabulary and casing (bert-data-prep shards --vocab MODEL), and train.py
# refuses shards of another vocabulary in one line.
#
#   MODEL=runs/phase1 TEXT="task_texts.txt more_texts/" bash recipes/adapt.sh
#   MODEL=... TEXT=... TASK=embedded:party bash recipes/adapt.sh      # and fine-tune at the end
#   MODEL=... TASK=embedded:party bash recipes/adapt.sh               # on the task's training texts
#   (the last, the task's own texts alone, did as well as a domain's text at two thirds the time
#   on all-MiniLM-L6-v2; on a task the model already does well, nothing did: docs/evaluation.md)
#
#   MODEL (required), TEXT (bert-data-prep --input paths; required unless TASK is set: a TASK's
#   training texts, all of them, never its dev split, are always added, written by bert-finetune
#   --write-train-text to OUT/task_train.txt), OUT (default runs/adapt), STEPS (default 200:
#   ~9 minutes of a 2-core CPU at 64 sequences a step), LR (peak AdamW rate, default 2e-5: on
#   all-MiniLM-L6-v2 and IMDb reviews 1e-4 moved the encoder further for no gain downstream;
#   warmed up over 20 steps, then constant, so that the same command with a larger STEPS goes on
#   from where it stopped, as a longer run would), HEAD_WARMUP (steps at the start with the
#   encoder frozen and the masked-LM head at 1e-3; default: 50 for a model saved without its
#   head, a BertModel such as a sentence-transformers export, else 0), BATCH (sequences per rank
#   and step, default 32),
#   SEQ_LEN (default 128), RANKS (default 2), CONFIG (default: ds_configs/cpu_mini_adamw_{bf16,fp32}.json
#   by the CPU), TASK (optional: a bert-finetune task, e.g. embedded:party), FINETUNE_ARGS (more
#   bert-finetune flags, e.g. "--train-examples 300 --seeds 1 2 3", or your own task's "--train
#   train.csv --validation dev.csv" without TASK); the result goes to OUT/downstream.json.
#   Re-running resumes the run.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to a RUN, an hf_model or a Hugging Face BERT directory}"
: "${TEXT:=}"
[ -n "$TEXT${TASK:-}" ] || { echo "adapt.sh: set TEXT to the unlabelled text of the task (files or directories bert-data-prep reads) or TASK to an embedded task" >&2; exit 2; }
VENV=${VENV:-.venv}
PY=$VENV/bin/python
OUT=${OUT:-runs/adapt}
STEPS=${STEPS:-200}
LR=${LR:-2e-5}
HEAD_WARMUP=${HEAD_WARMUP:-auto}
if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then PRECISION=bf16; else PRECISION=fp32; fi
CONFIG=${CONFIG:-ds_configs/cpu_mini_adamw_$PRECISION.json}
mkdir -p "$OUT"
if [ -n "${TASK:-}" ]; then
    [ -f "$OUT/task_train.txt" ] || $PY -m commodity_bert.finetune --task "$TASK" --write-train-text "$OUT/task_train.txt"
    TEXT="$TEXT $OUT/task_train.txt"
fi
# shellcheck disable=SC2086  # TEXT is a list of inputs
[ -f "$OUT/shards/manifest.json" ] || $PY -m data_prep shards --input $TEXT --vocab "$MODEL" \
    --seq-len "${SEQ_LEN:-128}" --no-nsp --masking dynamic --num-shards "${RANKS:-2}" --val-fraction 0.02 \
    --output "$OUT/shards"
# the config's recipe at this run's rate: warm-up over 20 steps, then constant
$PY - "$CONFIG" "$OUT/ds_config.json" "$LR" "$STEPS" "${BATCH:-32}" "$HEAD_WARMUP" "$MODEL" <<'EOF'
import json, sys
from pathlib import Path
source, target, lr, steps, batch, head_warmup, model = sys.argv[1:]
if head_warmup == "auto":  # a BertModel (no "For...") was saved without its pretraining heads
    found = [p for p in (Path(model) / "config.json", Path(model) / "hf_model" / "config.json") if p.is_file()]
    head_warmup = 50 if found and json.loads(found[0].read_text()).get("architectures") == ["BertModel"] else 0
lr, steps, head_warmup = float(lr), int(steps), int(head_warmup)
config = json.load(open(source))
config["train_micro_batch_size_per_gpu"] = int(batch)
config["optimizer"]["params"]["lr"] = lr
config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                      "warmup_num_steps": min(20, steps), "warmup_type": "linear"}}
if head_warmup:
    config["commodity_bert"] = {"head_warmup": {"steps": head_warmup, "encoder_lr_scale": 0.0, "head_lr_scale": 1e-3 / lr}}
json.dump(config, open(target, "w"), indent=1)
EOF
echo "adapting $MODEL: $STEPS steps at lr $LR on $OUT/shards ($PRECISION$(grep -q head_warmup "$OUT/ds_config.json" && echo ', a head warm-up'))"
"$VENV/bin/deepspeed" --num_gpus "${RANKS:-2}" train.py --deepspeed_config "$OUT/ds_config.json" \
    --data "$OUT/shards" --init-from "$MODEL" --output-dir "$OUT/run" --max-steps "$STEPS" \
    --log-every 50 --eval-every "$(( STEPS / 5 > 0 ? STEPS / 5 : 1 ))" --num-workers 1 2>&1 \
    | grep --line-buffered -E '^(step|done|stopping|warning|left the|--init-from)|error|Error'
if [ -n "${TASK:-}${FINETUNE_ARGS:-}" ]; then
    # shellcheck disable=SC2086  # a list of flags
    $PY -m commodity_bert.finetune --model "$OUT/run" ${TASK:+--task "$TASK"} --random-init --quiet \
        --json "$OUT/downstream.json" ${FINETUNE_ARGS:-}
fi
