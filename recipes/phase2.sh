#!/usr/bin/env bash
# BERT phase 2 (seq 512), starting from the phase-1 run's weights, with its own warmup.
#   DATA      phase-2 dataset (bert-data-prep shards --seq-len 512), e.g. data/pretrain/seq512
#   PHASE1    the phase-1 RUN directory (default runs/${MODEL}_phase1)
#   RUN       output directory (default runs/${MODEL}_phase2)
#   MODEL, HOSTFILE, CONFIG, EXTRA as in phase1.sh (CONFIG default ds_configs/bert_${MODEL}_phase2_lamb_fp16.json)
# Launched with bert-launch (deepspeed's arguments; commodity_bert/launch/launcher.py): SIGTERM, SIGUSR1 or
# Ctrl-C to this script (it execs bert-launch) saves a checkpoint and exits 0.
# Re-running the same command resumes phase 2 from its last checkpoint (not from phase 1).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the phase-2 dataset directory}"
MODEL=${MODEL:-base}
PHASE1=${PHASE1:-runs/${MODEL}_phase1}
RUN=${RUN:-runs/${MODEL}_phase2}
# no HOSTFILE: this machine's GPUs; with one, DeepSpeed's pdsh launcher ssh-es into each host
LAUNCH=(--num_gpus "${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)}")
[ -n "${HOSTFILE:-}" ] && LAUNCH=(--hostfile "$HOSTFILE")
CONFIG=${CONFIG:-ds_configs/bert_${MODEL}_phase2_lamb_fp16.json}
BERT_LAUNCH=${BERT_LAUNCH:-${VENV:-.venv}/bin/bert-launch}
# shellcheck disable=SC2086
exec "$BERT_LAUNCH" "${LAUNCH[@]}" train.py --deepspeed_config "$CONFIG" --data "$DATA" \
    --model "$MODEL" --init-from "$PHASE1" --output-dir "$RUN" --resume auto --log-every 50 \
    --eval-every 500 --save-every 200 --save-every-minutes 30 ${EXTRA:-}
