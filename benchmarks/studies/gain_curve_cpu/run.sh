#!/usr/bin/env bash
# On the CPU, the lower points of the pretraining gain curve. One `mini` run
# (1 rank x micro-batch 32, ds_configs/cpu_mini_adamw_bf16.json with its schedule set to 1,953
# steps: warm-up 195, linear decay to 0) over 62,496 sequences of 128 tokens = 8.0M processed
# tokens of the registry-prose corpus (`bert-data-prep corpus`, dynamic masks, no NSP), checkpoints
# at steps 488 / 976 / 1,953 = 2M / 4M / 8M tokens (--save-every 488 saves at its multiples and
# at the end): the schedule's own snapshots (the first two are taken mid-decay, not at a low
# lr). Each is fine-tuned as a checkpoint (bert-finetune reads RUN/checkpoints/step_N and its
# pretraining record) on both embedded tasks at 100 and 1,000
# labels, seeds 1-3, `--lr auto`; random init is not run again: benchmarks/gain_curve.py takes it
# from the H200 `mini`'s results of the same task, rows, seeds and recipe
# (results/gain_curve/h200_mini_186M_*). Run again to resume; figures: benchmarks/RESULTS.md.
#
#   bash benchmarks/studies/gain_curve_cpu/run.sh [WORK] [PART]    # default runs/gc8m, all parts
#   PART: 1 (pretraining), 2 (both fine-tuning queues), party or polarity (one queue)
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${1:-runs/gc8m}
PART=${2:-all}
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results/gain_curve
mkdir -p "$WORK" "$OUT"
DATA=$WORK/corpus_seq128
[ -f runs/corpus/corpus.txt ] || $PY -m data_prep corpus --output runs/corpus
[ -f "$DATA/manifest.json" ] || $PY -m data_prep shards --input runs/corpus/corpus.txt --output "$DATA" \
    --seq-len 128 --no-nsp --masking dynamic --num-shards 2 --val-fraction 0.02
# part 1: pretraining, 2 threads, ~22 min on an Intel Xeon with AMX (47.5 sequences/s)
if [ "$PART" = all ] || [ "$PART" = 1 ]; then
    $PY - "$WORK/ds_config.json" <<'EOF'
import json, sys
c = json.load(open("ds_configs/cpu_mini_adamw_bf16.json"))
c["scheduler"]["params"].update(warmup_num_steps=195, total_num_steps=1953)
json.dump(c, open(sys.argv[1], "w"), indent=1)
EOF
    [ -f "$WORK/run/summary.json" ] || OMP_NUM_THREADS=2 "$(dirname "$PY")/deepspeed" --num_gpus 1 train.py \
        --deepspeed_config "$WORK/ds_config.json" --data "$DATA" --model mini --output-dir "$WORK/run" --seed 1 \
        --save-every 488 --keep-checkpoints 10 --eval-every 244
fi
# part 2: fine-tuning, two one-thread queues side by side (party, polarity)
finetune() {  # TASK: every snapshot at 100 and 1,000 labels
    for step in 00001953 00000488 00000976; do  # the last snapshot first
        tokens=$(( (10#$step * 32 * 128 + 500000) / 1000000 ))  # 2, 4, 8
        for n in 100 1000; do
            json=$OUT/cpu_mini_${tokens}M_$1_$n.json
            [ -f "$json" ] || OMP_NUM_THREADS=1 $PY -m commodity_bert.finetune \
                --model "$WORK/run/checkpoints/step_$step" --task embedded:$1 --train-examples $n --seeds 1 2 3 \
                --threads 1 --quiet --json "$json"
        done
    done
}
if [ "$PART" = all ] || [ "$PART" = 2 ]; then
    finetune party > "$WORK/ft_party.log" 2>&1 &
    finetune polarity > "$WORK/ft_polarity.log" 2>&1
    wait
fi
# one queue alone: PART=party or polarity
if [ "$PART" = party ] || [ "$PART" = polarity ]; then
    finetune "$PART"
fi
