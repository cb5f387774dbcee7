#!/usr/bin/env bash
# BERT phase 1 (seq 128) with DeepSpeed's launcher.
#   DATA      phase-1 dataset (bert-data-prep shards --seq-len 128), e.g. data/pretrain/seq128
#   RUN       output directory (default runs/${MODEL}_phase1)
#   MODEL     base | large (default base)
#   HOSTFILE  DeepSpeed hostfile, e.g. hostfiles/two_nodes (default: this machine's GPUs, or GPUS of them)
#   CONFIG    DeepSpeed config (default ds_configs/bert_${MODEL}_phase1_lamb_fp16.json)
#   EXTRA     more train.py flags, e.g. "--time-budget 24h"
# Launched with bert-launch (deepspeed's arguments; commodity_bert/launch/launcher.py): SIGTERM, SIGUSR1 or
# Ctrl-C to this script (it execs bert-launch) saves a checkpoint and exits 0.
# Re-running the same command resumes from the last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the phase-1 dataset directory}"
MODEL=${MODEL:-base}
RUN=${RUN:-runs/${MODEL}_phase1}
# no HOSTFILE: this machine's GPUs; with one, DeepSpeed's pdsh launcher ssh-es into each host
LAUNCH=(--num_gpus "${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)}")
[ -n "${HOSTFILE:-}" ] && LAUNCH=(--hostfile "$HOSTFILE")
CONFIG=${CONFIG:-ds_configs/bert_${MODEL}_phase1_lamb_fp16.json}
BERT_LAUNCH=${BERT_LAUNCH:-${VENV:-.venv}/bin/bert-launch}
# shellcheck disable=SC2086  # EXTRA holds several flags
exec "$BERT_LAUNCH" "${LAUNCH[@]}" train.py --deepspeed_config "$CONFIG" --data "$DATA" \
    --model "$MODEL" --output-dir "$RUN" --resume auto --log-every 50 --eval-every 1000 \
    --save-every 500 --save-every-minutes 30 ${EXTRA:-}
